"""The wheels a lent GPU machine needs for ``scripts/gpu_checks.py``, gathered here (``make gpu-wheels``) and checked
there before anything runs. Standard library only: it runs before anything is installed.

The lent machines (docs/throughput.md, "The GPU checks") have Python 3.12, torch 2.11 with CUDA, numpy, requests, rich, tokenizers,
pyarrow, huggingface_hub and the rest of their image, and no network. What they lack:

* ours: omegaconf (with antlr4), torchao (``model.float8``; 0.17 and newer run on torch >= 2.11) and fla-core with
  einops (flash-linear-attention's kernels for Gated DeltaNet layers: Python and Triton, which the image's torch
  brings);
* the original OLMo 0.6.0 for ``scripts/benchmark_olmo.py``: its own wheel less the 140 MB of evaluation data its
  model code never reads (the same files otherwise, its RECORD rewritten to list them), and what ``import olmo``
  pulls in that the image lacks (boto3, cached_path, datasets, google-cloud-storage and theirs);
* flash-attn: PyPI has no wheel of it, only a source archive that takes hours to build, so a wheel is used when one
  is put into the folder by hand (``flash_attn-*.whl``) and the check says so otherwise.

``manifest.json`` in the folder records what was gathered, for which Python, and each file's size.

:func:`check_wheels` reads the folder within limits: the ``*.whl`` entries of the folder and of ``original/`` (at most
:data:`MAX_ENTRIES` entries each), each a file name of the wheel spec (``name-version(-build)?-python-abi-platform.whl``),
a regular file (or a symlink to one; a FIFO, device or folder is refused without being opened for reading) of at
most :data:`WHEEL_LIMIT`, a zip of at most :data:`MAX_MEMBERS` members declaring at most :data:`UNPACKED_LIMIT`
together, every member name relative and inside the folder it is unpacked into, and a METADATA that unpacks within
:data:`METADATA_LIMIT`. Anything else is one :class:`WheelProblem` naming the file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..exceptions import OLMoError
from ..util.atomic import atomic_write
from ..util.bounded_files import open_zip, read_member

__all__ = [
    "OURS",
    "ORIGINAL",
    "gather",
    "check_wheels",
    "list_wheels",
    "parse_wheel_name",
    "tags_fit",
    "cpython_minor",
    "WheelName",
    "WheelProblem",
    "CARRY_LIMIT_MB",
    "WHEEL_LIMIT",
]

OURS = (
    "omegaconf==2.4.0",
    "antlr4-python3-runtime==4.13.2",
    "torchao==0.18.0",
    "fla-core==0.6.0",
    "einops==0.8.2",
)
"""What our code imports that the lent image lacks."""
ORIGINAL = (
    "cached-path==1.8.10",
    "boto3==1.44.8",
    "botocore==1.44.8",
    "s3transfer==0.19.3",
    "jmespath==1.1.0",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "google-cloud-storage==3.17.1",
    "google-cloud-core==2.8.0",
    "google-api-core==2.44.0",
    "google-auth==2.63.0",
    "google-resumable-media==2.11.0",
    "google-crc32c==1.9.0",
    "proto-plus==1.29.0",
    "googleapis-common-protos==1.76.0",
    "opentelemetry-api==1.45.2",
    "pyasn1==0.6.5",
    "pyasn1-modules==0.4.2",
    "cryptography==50.0.2",
    "cffi==2.1.1",
    "pycparser==3.12",
    "importlib-resources==7.1.0",
)
"""What the original's ``import olmo`` needs beyond the lent image (its util module imports boto3, datasets,
cached_path and google-cloud-storage at the top), pinned to versions that import together on Python 3.12."""
ORIGINAL_WHEEL = "ai2-olmo==0.6.0"
ORIGINAL_KEEP = ("olmo/", "olmo_data/__init__.py", "olmo_data/data.py")
"""The parts of the original's wheel its model, config and optimizer code use (the rest is evaluation data)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64")
CARRY_LIMIT_MB = 64
"""What a device call carries at most: the working tree and the wheels together."""
WHEEL_LIMIT = CARRY_LIMIT_MB * 2**20
"""The largest wheel file read: a larger one cannot travel to the lent machine."""
DOWNLOAD_LIMIT = 2**30
"""The largest downloaded wheel :func:`trim_wheel` reads (the original's is 145 MB)."""
UNPACKED_LIMIT = 2**30
"""The most bytes a wheel's members may declare together (what pip would unpack from it)."""
METADATA_LIMIT = 4 * 2**20
"""The most bytes a wheel's METADATA may unpack to (the gathered ones hold under 100 KB)."""
MAX_MEMBERS = 20_000
"""The most members a wheel may have (torchao's has about 1,000)."""
MAX_ENTRIES = 10_000
"""The most entries of the wheel folder (and of its ``original/``) looked at."""


@dataclass(frozen=True)
class WheelProblem:
    """One thing wrong with the wheel folder."""

    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def _pip_download(specs: list[str], folder: Path, python_version: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--implementation", "cp"]
    cmd += ["--python-version", python_version, "-d", str(folder), "--progress-bar", "off"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return subprocess.run(cmd + specs, capture_output=True, text=True)


def gather(folder: Path, python_version: str = "3.12") -> dict[str, object]:
    """Download every wheel into ``folder`` for ``python_version`` on x86-64 Linux, trim the original's, write
    ``manifest.json`` and return it. Raises ``RuntimeError`` naming what pip could not find, or
    :class:`~olmo.exceptions.OLMoError` for a downloaded wheel it cannot read within its limits."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path = folder / "manifest.json"
    if os.path.islink(manifest_path) or (os.path.lexists(manifest_path) and not manifest_path.is_file()):
        raise RuntimeError(f"{manifest_path} is not a regular file; remove it (it is written over by a new one).")
    result = _pip_download([*OURS, *ORIGINAL], folder, python_version)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed for Python {python_version}:\n{result.stderr[-2000:]}")
    with tempfile.TemporaryDirectory() as tmp:
        result = _pip_download([ORIGINAL_WHEEL], Path(tmp), python_version)
        if result.returncode != 0:
            raise RuntimeError(f"pip download {ORIGINAL_WHEEL} failed:\n{result.stderr[-2000:]}")
        downloaded = sorted(Path(tmp).glob("*.whl"))
        if len(downloaded) != 1:
            raise RuntimeError(f"pip download {ORIGINAL_WHEEL} gave {len(downloaded)} wheels, not one")
        original = downloaded[0]
        (folder / "original").mkdir(exist_ok=True)
        trim_wheel(original, folder / "original" / original.name, ORIGINAL_KEEP)
    flash = _pip_download(["flash-attn"], folder, python_version)
    manifest: dict[str, object] = {
        "python_version": python_version,
        "ours": list(OURS),
        "original": [*ORIGINAL, ORIGINAL_WHEEL],
        "flash_attn": "downloaded" if flash.returncode == 0 else "no wheel on PyPI (put one here by hand)",
        "files": {
            p.relative_to(folder).as_posix(): p.stat().st_size for p in list_wheels(folder)[0] if p.is_file()
        },
    }
    atomic_write(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return manifest


def trim_wheel(source: Path, target: Path, keep: tuple[str, ...]) -> None:
    """Copy the wheel ``source`` to ``target`` with only the files under ``keep`` and its metadata, the RECORD
    rewritten to list (and hash) exactly what remains, so pip installs it as any wheel. ``source`` is read within
    the limits of :func:`check_wheels` (the original's whole wheel, 145 MB, within :data:`DOWNLOAD_LIMIT`)."""
    what = f"The downloaded wheel '{source}'"
    with (
        open_zip(source, DOWNLOAD_LIMIT, what, max_members=MAX_MEMBERS) as src,
        zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out,
    ):
        record_name = next((n for n in src.namelist() if n.endswith(".dist-info/RECORD")), None)
        if record_name is None:
            raise RuntimeError(f"{what} has no .dist-info/RECORD; download it again.")
        lines = []
        for name in src.namelist():
            if name == record_name or not (name.startswith(keep) or ".dist-info/" in name):
                continue
            data = read_member(src, name, CARRY_LIMIT_MB * 2**20, what)
            out.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
        out.writestr(record_name, "\n".join([*lines, f"{record_name},,"]) + "\n")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _shown(text: str, n: int = 80) -> str:
    """A value read from a file, quoted and cut for a message."""
    return repr(text if len(text) <= n else text[:n] + "...")


def cpython_minor(python_version: str) -> int:
    """The minor version of ``python_version`` (``"3.12"`` -> 12). Raises ``ValueError`` for anything but ``3.N``."""
    match = re.fullmatch(r"3\.([0-9]{1,2})", python_version, flags=re.ASCII)
    if not match:
        raise ValueError(f"{_shown(python_version)} is not a CPython 3 version such as 3.12")
    return int(match.group(1))


@dataclass(frozen=True)
class WheelName:
    """The fields of a wheel's file name: ``name-version(-build)?-python-abi-platform.whl``, each tag field a
    ``.``-separated set of tags."""

    name: str
    version: str
    build: Optional[str]
    pythons: tuple[str, ...]
    abis: tuple[str, ...]
    platforms: tuple[str, ...]


_WHEEL_NAME = re.compile(
    r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._]*[A-Za-z0-9])?)-(?P<version>[A-Za-z0-9_.!+]+)"
    r"(?:-(?P<build>[0-9][A-Za-z0-9_]*))?-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl",
    flags=re.ASCII,
)
_TAG = {
    "python": re.compile(r"(?:py|cp|pp|ip|jy)[0-9]+", flags=re.ASCII),
    "abi": re.compile(r"[a-z0-9_]+", flags=re.ASCII),
    "platform": re.compile(r"[a-z0-9_]+", flags=re.ASCII),
}
_LINUX_X86_64 = re.compile(r"(?:linux|manylinux[0-9]*|manylinux_[0-9]+_[0-9]+)_x86_64", flags=re.ASCII)


def parse_wheel_name(filename: str) -> WheelName:
    """The fields of the wheel file name ``filename`` (the wheel spec's ``{distribution}-{version}(-{build
    tag})?-{python tag}-{abi tag}-{platform tag}.whl``). Raises ``ValueError`` saying what is malformed."""
    match = _WHEEL_NAME.fullmatch(filename)
    if not match:
        raise ValueError(
            "not name-version(-build)?-python-abi-platform.whl in ASCII letters, digits and . _ ! +, "
            "e.g. omegaconf-2.4.0-py3-none-any.whl"
        )
    tags: dict[str, tuple[str, ...]] = {}
    for field, pattern in _TAG.items():
        tags[field] = tuple(match.group(field).split("."))
        bad = [t for t in tags[field] if not pattern.fullmatch(t)]
        if bad:
            kind = "an implementation and a version, e.g. py3 or cp312" if field == "python" else "lowercase"
            raise ValueError(f"its {field} tag {_shown(bad[0])} is not {kind}")
    return WheelName(
        match["name"], match["version"], match["build"], tags["python"], tags["abi"], tags["platform"]
    )


def tags_fit(wheel: WheelName, python_version: str) -> bool:
    """Whether a wheel's tags fit CPython ``python_version`` on x86-64 Linux (glibc)."""
    minor = cpython_minor(python_version)
    cp = f"cp3{minor}"
    if not any(p == "any" or _LINUX_X86_64.fullmatch(p) for p in wheel.platforms):
        return False
    for python in wheel.pythons:
        stable = re.fullmatch(r"cp3([0-9]+)", python)
        for abi in wheel.abis:
            if abi == "none" and python in (cp, "py3", f"py3{minor}"):
                return True
            if abi == cp and python == cp:
                return True
            if abi == "abi3" and stable and int(stable.group(1)) <= minor:
                return True
    return False


def list_wheels(folder: Path) -> tuple[list[Path], list[WheelProblem]]:
    """The ``*.whl`` entries of ``folder`` and of ``folder/original`` (what :func:`olmo.bench.gpu_checks.install`
    installs; nothing deeper is looked at), sorted, and the problems met listing them. At most
    :data:`MAX_ENTRIES` entries of each folder are looked at; their types are checked when each is read."""
    found: list[Path] = []
    problems: list[WheelProblem] = []
    for sub in (folder, folder / "original"):
        if sub != folder and not os.path.lexists(sub):
            continue
        try:
            with os.scandir(sub) as entries:
                for i, entry in enumerate(entries):
                    if i >= MAX_ENTRIES:
                        problems.append(
                            WheelProblem(str(sub), f"holds more than {MAX_ENTRIES:,} entries; clean it")
                        )
                        break
                    if entry.name.endswith(".whl"):
                        found.append(Path(entry.path))
        except OSError as e:
            problems.append(WheelProblem(str(sub), f"cannot be listed ({e.strerror or e}); it must be a folder"))
    return sorted(found), problems


def _read_metadata(wheel: Path) -> tuple[dict[str, str], int]:
    """The Name and Version of ``wheel``'s METADATA, and the wheel's size; raises :class:`OLMoError` naming what
    is wrong (not a regular file, too large, an unsafe member name, METADATA unpacking past its limit)."""
    what = "it"
    with open_zip(
        wheel, WHEEL_LIMIT, what, max_members=MAX_MEMBERS, max_unpacked=UNPACKED_LIMIT, kind="wheel"
    ) as z:
        names = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        text = read_member(z, names[0], METADATA_LIMIT, what).decode("utf-8", "replace") if names else ""
    headers = text.replace("\r\n", "\n").split("\n\n", 1)[0]  # the body (a README) is no field
    return dict(re.findall(r"^(Name|Version): *(.+?) *$", headers, flags=re.M)), wheel.stat().st_size


def check_wheels(folder: Path, python_version: str = "3.12") -> list[WheelProblem]:
    """Everything wrong with ``folder`` for a lent machine's ``python_version`` (empty when it is ready): a missing
    or unreadable wheel, a file name that is not a wheel's, one whose tags or metadata do not fit, an entry that is
    not a regular file (or a symlink to one), a file over :data:`WHEEL_LIMIT`, a member with an unsafe name, two
    versions of one package, or more than a device call can carry. Raises ``ValueError`` for a malformed
    ``python_version``."""
    cpython_minor(python_version)
    try:
        problem = None if stat.S_ISDIR(os.stat(folder).st_mode) else "is not a folder"
    except FileNotFoundError:
        problem = "no such folder"
    except OSError as e:
        problem = f"cannot be read ({e.strerror or e})"
    if problem:
        return [WheelProblem(str(folder), f"{problem}: run `make gpu-wheels` here first")]
    wheels, problems = list_wheels(folder)
    found: dict[str, list[str]] = {}
    size = 0
    for wheel in wheels:
        shown = wheel.relative_to(folder).as_posix()
        shown = shown if shown.isprintable() else ascii(shown)  # a name cannot forge lines of the report
        try:
            name = parse_wheel_name(wheel.name)
        except ValueError as e:
            problems.append(WheelProblem(shown, f"is not a wheel's file name: {e}; rename it or remove it"))
            continue
        if not tags_fit(name, python_version):
            problems.append(WheelProblem(shown, f"does not fit CPython {python_version} on x86-64 Linux"))
        try:
            fields, wheel_size = _read_metadata(wheel)
        except OLMoError as e:
            problem = str(e).removeprefix("it ").rstrip(".")
            problems.append(WheelProblem(shown, f"{problem}; remove it or run `make gpu-wheels` again"))
            continue
        size += wheel_size
        if not fields.get("Name") or not fields.get("Version"):
            problems.append(WheelProblem(shown, "has no METADATA naming the package and version"))
            continue
        if _normal(name.name) != _normal(fields["Name"]) or name.version != fields["Version"]:
            held = f"{_shown(fields['Name'])} {_shown(fields['Version'])}"
            problems.append(WheelProblem(shown, f"holds {held}, not what its name says"))
        found.setdefault(_normal(fields["Name"]), []).append(fields["Version"])
    for package, versions in found.items():
        if len(versions) > 1:
            shown_versions = ", ".join(_shown(v, 20) for v in versions[:5])
            problems.append(WheelProblem(package[:80], f"{len(versions)} versions ({shown_versions}): keep one"))
    for spec in (*OURS, *ORIGINAL, ORIGINAL_WHEEL):
        package, version = spec.split("==")
        if version not in found.get(_normal(package), []):
            problems.append(WheelProblem(spec, "missing: run `make gpu-wheels`"))
    if size / 2**20 > CARRY_LIMIT_MB - 12:  # the working tree travels too (~10 MB)
        problems.append(WheelProblem(str(folder), f"{size / 2**20:.0f} MB of wheels leave no room for the tree"))
    return problems
