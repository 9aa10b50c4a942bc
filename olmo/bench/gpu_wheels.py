"""The wheels a lent GPU machine needs for ``scripts/gpu_checks.py``, gathered here (``make gpu-wheels``) and checked
there before anything runs. Standard library only: it runs before anything is installed.

The lent machines (docs/throughput.md, "The GPU checks") have Python 3.12, torch 2.11 with CUDA, numpy, requests, rich, tokenizers,
pyarrow, huggingface_hub and the rest of their image, and no network. What they lack:

* ours: omegaconf (with antlr4) and torchao (``model.float8``; 0.17 and newer run on torch >= 2.11);
* the original OLMo 0.6.0 for ``scripts/benchmark_olmo.py``: its own wheel less the 140 MB of evaluation data its
  model code never reads (the same files otherwise, its RECORD rewritten to list them), and what ``import olmo``
  pulls in that the image lacks (boto3, cached_path, datasets, google-cloud-storage and theirs);
* flash-attn: PyPI has no wheel of it, only a source archive that takes hours to build, so a wheel is used when one
  is put into the folder by hand (``flash_attn-*.whl``) and the check says so otherwise.

``manifest.json`` in the folder records what was gathered, for which Python, and each file's size.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OURS", "ORIGINAL", "gather", "check_wheels", "WheelProblem", "CARRY_LIMIT_MB"]

OURS = ("omegaconf==2.4.0", "antlr4-python3-runtime==4.13.2", "torchao==0.18.0")
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
    ``manifest.json`` and return it. Raises ``RuntimeError`` naming what pip could not find."""
    folder.mkdir(parents=True, exist_ok=True)
    result = _pip_download([*OURS, *ORIGINAL], folder, python_version)
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed for Python {python_version}:\n{result.stderr[-2000:]}")
    with tempfile.TemporaryDirectory() as tmp:
        result = _pip_download([ORIGINAL_WHEEL], Path(tmp), python_version)
        if result.returncode != 0:
            raise RuntimeError(f"pip download {ORIGINAL_WHEEL} failed:\n{result.stderr[-2000:]}")
        (original,) = Path(tmp).glob("*.whl")
        (folder / "original").mkdir(exist_ok=True)
        trim_wheel(original, folder / "original" / original.name, ORIGINAL_KEEP)
    flash = _pip_download(["flash-attn"], folder, python_version)
    manifest: dict[str, object] = {
        "python_version": python_version,
        "ours": list(OURS),
        "original": [*ORIGINAL, ORIGINAL_WHEEL],
        "flash_attn": "downloaded" if flash.returncode == 0 else "no wheel on PyPI (put one here by hand)",
        "files": {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*.whl"))},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def trim_wheel(source: Path, target: Path, keep: tuple[str, ...]) -> None:
    """Copy the wheel ``source`` to ``target`` with only the files under ``keep`` and its metadata, the RECORD
    rewritten to list (and hash) exactly what remains, so pip installs it as any wheel."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for name in src.namelist():
            if name == record_name or not (name.startswith(keep) or ".dist-info/" in name):
                continue
            data = src.read(name)
            out.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
        out.writestr(record_name, "\n".join([*lines, f"{record_name},,"]) + "\n")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _tags_fit(filename: str, python_version: str) -> bool:
    """Whether a wheel's file name tags fit CPython ``python_version`` on x86-64 Linux."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) < 5:
        return False
    python, abi, platform = parts[-3:]
    cp = "cp" + python_version.replace(".", "")
    pythons, abis = python.split("."), abi.split(".")
    python_ok = bool({cp, "py3", "py" + cp[2:]} & set(pythons)) or any(
        p.startswith("cp3") and "abi3" in abis and int(p[2:]) <= int(cp[2:]) for p in pythons
    )
    platform_ok = platform == "any" or ("x86_64" in platform and "linux" in platform)
    return python_ok and platform_ok


def check_wheels(folder: Path, python_version: str = "3.12") -> list[WheelProblem]:
    """Everything wrong with ``folder`` for a lent machine's ``python_version`` (empty when it is ready): a missing
    or unreadable wheel, one whose tags or metadata do not fit, two versions of one package, or more than a device
    call can carry."""
    if not folder.is_dir():
        return [WheelProblem(str(folder), "no such folder: run `make gpu-wheels` here first")]
    wheels = sorted(folder.rglob("*.whl"))
    problems: list[WheelProblem] = []
    found: dict[str, list[str]] = {}
    for wheel in wheels:
        shown = wheel.relative_to(folder).as_posix()
        if not _tags_fit(wheel.name, python_version):
            problems.append(WheelProblem(shown, f"does not fit CPython {python_version} on x86-64 Linux"))
        try:
            with zipfile.ZipFile(wheel) as z:
                metadata = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
                text = z.read(metadata).decode("utf-8", "replace") if metadata else ""
        except (zipfile.BadZipFile, OSError) as e:
            problems.append(WheelProblem(shown, f"is not a readable wheel ({e}); run `make gpu-wheels` again"))
            continue
        fields = dict(re.findall(r"^(Name|Version): (.+)$", text, flags=re.M))
        if not fields.get("Name") or not fields.get("Version"):
            problems.append(WheelProblem(shown, "has no METADATA naming the package and version"))
            continue
        stem = wheel.name.split("-")
        if _normal(stem[0]) != _normal(fields["Name"]) or stem[1] != fields["Version"]:
            problems.append(
                WheelProblem(shown, f"holds {fields['Name']} {fields['Version']}, not what its name says")
            )
        found.setdefault(_normal(fields["Name"]), []).append(fields["Version"])
    for name, versions in found.items():
        if len(versions) > 1:
            problems.append(WheelProblem(name, f"{len(versions)} versions ({', '.join(versions)}): keep one"))
    for spec in (*OURS, *ORIGINAL, ORIGINAL_WHEEL):
        name, version = spec.split("==")
        if version not in found.get(_normal(name), []):
            problems.append(WheelProblem(spec, "missing: run `make gpu-wheels`"))
    size_mb = sum(w.stat().st_size for w in wheels) / 2**20
    if size_mb > CARRY_LIMIT_MB - 12:  # the working tree travels too (~10 MB)
        problems.append(WheelProblem(str(folder), f"{size_mb:.0f} MB of wheels leave no room for the tree"))
    return problems
