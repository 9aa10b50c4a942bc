"""Every GPU check in one prepared command, for a lent machine with no network and minutes of time:

    python3 scripts/gpu_checks.py [--wheels .whl] [--out DIR] [--budget 560] [--only PART,...] [--dry-run]

Installs the wheels ``make gpu-wheels`` gathered (:mod:`olmo.bench.gpu_wheels`), then runs the parts in order of
importance, each under its own time limit, so a part that fails or hangs costs only its own minutes (a hung one is
stopped with every process it started, torchrun's workers included); a part whose limit no longer fits in what is
left of ``--budget`` is reported as not run. After every part one markdown table (``DIR/gpu_checks.md``, printed at
the end), the benchmark rows of docs/throughput.md (``DIR/benchmarks.md``: model, GPU, precision, shape, tokens/s,
MFU, memory, the exact command, date and commit) and the details (``DIR/gpu_checks.json``: each part's command,
status, time, numbers and the tail of its output) are written, ready for RESEARCH_LOG. ``--dry-run`` lists the parts with
their commands and limits and checks the wheel folder, and runs nothing.

What it reads is bounded (:mod:`olmo.util.bounded_files`): a wheel must be a regular file (or a symlink to one) of
at most 64 MiB with safe member names (:func:`olmo.bench.gpu_wheels.check_wheels` lists its limits), a part's report
one of at most 16 MiB, and of a part's output only the last 64 KiB are kept. ``--budget`` is 0 to 86400 seconds,
``--python-version`` is ``3.N``; ``gpu_checks.md``/``.json`` and ``benchmarks.md`` are written (by a rename) only over earlier ones.

Standard library only until the wheels are installed: this file is the first thing to run on a bare machine, from
the checkout's root (``PYTHONPATH=. python3 scripts/gpu_checks.py`` where the package is not installed).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from ..exceptions import OLMoError
from ..util.bounded_files import read_tail
from ..util.pids import kill_tagged
from .gpu_check_parts import Part, parts
from .gpu_checks_table import Result, environment_numbers, markdown_table, out_problem, read_report, write_tables
from .gpu_wheels import check_wheels, cpython_minor, gather, list_wheels

__all__ = ["Part", "parts", "main", "markdown_table"]

ROOT = Path.cwd()
"""The checkout the parts run in: the working directory (the device tool runs commands in the repository root)."""


def install(wheels: Path, site: Path, original_site: Path) -> str:
    """Install our wheels into ``site`` and the original's (with its own wheel) into ``original_site``; return
    pip's last lines. ``--no-index --no-deps``: nothing is fetched, the set is what ``make gpu-wheels`` chose."""
    listed = list_wheels(wheels)[0]
    ours = [str(w) for w in listed if w.parent == wheels]
    original = [str(w) for w in listed if w.parent != wheels]
    base = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    out = ""
    for target, files in ((site, ours), (original_site, ours + original)):
        result = subprocess.run([*base, str(target), *files], capture_output=True, text=True, timeout=300)
        out += result.stdout[-500:] + result.stderr[-1500:]
        if result.returncode != 0:
            raise RuntimeError(f"pip install into {target} failed:\n{out}")
    return out


def original_python(folder: Path, original_site: Path) -> Path:
    """A python for ``benchmark_olmo.py --olmo-python``: the original's worker is started with ``-I`` (no
    PYTHONPATH) so that ``import olmo`` cannot find ours; this wrapper drops the flag and points PYTHONPATH at the
    folder holding only the original's install, which then is the only ``olmo`` there is."""
    path = folder / "olmo-python"
    path.write_text(
        f'#!/bin/sh\n[ "$1" = "-I" ] && shift\nPYTHONPATH="{original_site}" exec "{sys.executable}" -s "$@"\n'
    )
    path.chmod(0o755)
    return path


def run_part(part: Part, env: dict[str, str], limit: float, log_dir: Optional[Path] = None) -> Result:
    """Run ``part``'s commands under one time limit, each in its own process group, its output in a file (so that
    a process it leaves behind cannot hold a pipe open); at the limit :func:`_stop` ends it and all it started."""
    result = Result(part.name, part.what, "ok", command=" && ".join(" ".join(c) for c in part.commands))
    start = time.monotonic()
    output = ""
    with tempfile.TemporaryDirectory(dir=log_dir) as logs:
        for i, cmd in enumerate(part.commands):
            log_path = Path(logs) / f"{i}.log"
            token = uuid.uuid4().hex
            with open(log_path, "w") as log_file:
                proc = subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env={**env, TOKEN_VAR: token},
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    proc.wait(timeout=max(limit - (time.monotonic() - start), 1))
                except subprocess.TimeoutExpired:
                    _stop(proc, token)
                    result.status, result.note = "timeout", f"stopped at its limit of {limit:.0f} s"
            out = read_tail(log_path, LOG_TAIL).decode(errors="replace")  # a part may print without end
            output += out
            if result.status == "timeout":
                break
            if proc.returncode != 0:
                result.status = "failed"
                result.note = _last_error(out) or f"exit status {proc.returncode}"
                break
    result.seconds = time.monotonic() - start
    result.tail = output[-3000:]
    try:
        if result.status == "ok" and part.report and os.path.lexists(part.report):
            result.numbers = read_report(part.report)
        elif result.status == "ok" and part.name == "environment":
            result.numbers = environment_numbers(output.strip().splitlines()[-1])
    except (OLMoError, ValueError, IndexError, KeyError, TypeError, AttributeError, RecursionError) as e:
        result.note = (
            f"its report could not be read ({type(e).__name__}: {str(e)[:300]})"  # it ran; not its numbers
        )
    return result


LOG_TAIL = 2**16
"""Bytes of a part's output kept (its tail, its last error, the environment's line): a part may print without end."""
GRACE_S = 10.0
"""Seconds a stopped part gets to end its own processes (torchrun stops its workers on SIGTERM) before SIGKILL."""
TOKEN_VAR = "OLMO_GPU_CHECK_PART"
"""Set to a token unique to each run of a part in its environment, which every process it starts inherits."""


def _stop(proc: subprocess.Popen, token: str) -> None:
    """End a part's command and everything it started: SIGTERM to its process group (torchrun stops its workers on
    it), then, after :data:`GRACE_S`, SIGKILL to every process carrying the part's token in its environment (torchrun's
    workers run in sessions of their own, which a signal to the command's group does not reach)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=GRACE_S)
    kill_tagged(TOKEN_VAR, token, timeout=GRACE_S)  # the next part may need the GPU memory they hold
    proc.wait()


def _last_error(output: str) -> str:
    """The line that says why a command failed: the last naming an error, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error:" in line or "FAILED" in line or "failed" in line]
    return (named or lines or [""])[-1][:300]


def _args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", default=".whl", help="the folder `make gpu-wheels` filled (default .whl)")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_checks_out"), help="where the table goes")
    parser.add_argument("--budget", type=float, default=560, help="seconds for all parts together (default 560)")
    parser.add_argument("--only", help="comma-separated part names to run (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="list the parts, check the wheels, run nothing")
    parser.add_argument(
        "--gather", action="store_true", help="download the wheels first (`make gpu-wheels`), then --dry-run"
    )
    parser.add_argument("--python-version", default="3.12", help="the lent machine's Python (for --dry-run)")
    return parser.parse_args(argv)


BUDGET_MAX_S = 86_400.0
"""The largest ``--budget``: a day (a lent machine is held for at most 30 minutes)."""


def _flag_problem(args: argparse.Namespace) -> Optional[str]:
    """The paragraph that refuses a flag's value, or None when every flag is usable."""
    if not (math.isfinite(args.budget) and 0 <= args.budget <= BUDGET_MAX_S):
        return (
            f"--budget {args.budget} is not a number of seconds from 0 to {BUDGET_MAX_S:.0f}; give the seconds all "
            "parts may take together, e.g. --budget 560 (0 runs no part and reports each as not run)."
        )
    try:
        cpython_minor(args.python_version)
    except ValueError as e:
        return f"--python-version {e}; give the lent machine's Python as major.minor, e.g. --python-version 3.12."
    names = [p.name for p in parts(Path("."), "", flash_attn=False)]
    unknown = set((args.only or "").split(",")) - set(names) if args.only else set()
    if unknown:
        return f"--only names unknown parts {sorted(unknown)}; the parts are: {', '.join(names)}"
    return None


def main(argv: Optional[list[str]] = None, clock: Callable[[], float] = time.monotonic) -> int:
    start = clock()  # the budget counts from here: the GPU probe and the install are in it
    args = _args(argv)
    problem = _flag_problem(args)
    if problem:
        print(problem)
        return 2
    if not (ROOT / "scripts" / "benchmark.py").is_file():
        print(f"Run this from the checkout's root (the parts run scripts/ and configs/ there), not from {ROOT}.")
        return 2
    try:
        wheels, out = (ROOT / args.wheels).resolve(), Path(args.out).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError up to Python 3.12
        print(f"--wheels {args.wheels} or --out {args.out} cannot be resolved ({e}); give real folders.")
        return 2
    if args.gather:
        try:
            manifest = gather(wheels, args.python_version)
        except (RuntimeError, OSError, OLMoError) as e:
            print(
                f"Could not gather the wheels into {wheels} for Python {args.python_version}: {e}\nThis needs PyPI "
                "(run it where the package registries can be reached); what was downloaded stays, and a second run "
                "fetches only what is missing."
            )
            return 1
        files: dict[str, int] = manifest["files"]  # type: ignore[assignment]
        print(f"Gathered {len(files)} wheels ({sum(files.values()) / 2**20:.1f} MB) into {wheels}.")
        args.dry_run = True
    if not args.dry_run:  # before any minute is spent: the table must have somewhere to go
        problem = out_problem(out)
        if problem:
            print(f"--out {out} {problem}; pick a writable folder of its own (the table goes there).")
            return 2
    python_version = args.python_version if args.dry_run else f"{sys.version_info.major}.{sys.version_info.minor}"
    problems = check_wheels(wheels, python_version)
    work = Path(tempfile.mkdtemp(prefix="gpu-checks-"))
    flash = any(w.name.startswith("flash_attn-") for w in list_wheels(wheels)[0])
    gpus = 0 if args.dry_run else _cuda_devices(dict(os.environ))
    cuda = gpus > 0
    todo = parts(work, str(work / "olmo-python"), flash, cuda or args.dry_run, gpus if cuda else 2)
    if args.only:
        todo = [p for p in todo if p.name in args.only.split(",")]
    if args.dry_run:
        print(f"Wheel folder {wheels} for Python {python_version}: {'ready' if not problems else 'NOT ready'}")
        for wheel_problem in problems:
            print(f"  - {wheel_problem}")
        total = sum(p.limit_s for p in todo if p.skip_reason is None)
        print(f"\nParts, in order (limits add up to {total:.0f} s; the budget is {args.budget:.0f} s):")
        for p in todo:
            shown = p.skip_reason and f"skipped: {p.skip_reason}" or " && ".join(" ".join(c) for c in p.commands)
            print(f"  {p.name} ({p.limit_s:.0f} s{', GPU' if p.needs_cuda else ''}): {p.what}\n      {shown}")
        shutil.rmtree(work, ignore_errors=True)
        return 1 if problems else 0
    return _run(args, todo, wheels, out, work, problems, cuda, clock, start)


def _run(
    args: argparse.Namespace,
    todo: list[Part],
    wheels: Path,
    out: Path,
    work: Path,
    problems: list,
    cuda: bool,
    clock: Callable[[], float],
    start: float,
) -> int:
    results: list[Result] = []
    site, original_site = work / "site", work / "original" / "site-packages"
    try:
        if problems:
            raise RuntimeError("the wheel folder is not ready:\n" + "\n".join(f"  - {p}" for p in problems))
        install(wheels, site, original_site)
        original_python(work, original_site)
        results.append(
            Result("install", f"{len(list_wheels(wheels)[0])} wheels from {wheels.name}", "ok", clock() - start)
        )
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        results.append(Result("install", "the wheels", "failed", clock() - start, note=str(e).splitlines()[0]))
        print(str(e))
    installed = results[-1].status == "ok"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)]),
        "WANDB_MODE": "disabled",
        "PYTHONUNBUFFERED": "1",
    }
    table = write_tables(out, results)
    for part in todo:
        left = args.budget - (clock() - start)
        if part.skip_reason or not installed or (part.needs_cuda and not cuda):
            reason = part.skip_reason or ("the install failed" if not installed else "no CUDA device")
            results.append(Result(part.name, part.what, "skipped", note=reason))
        elif left < part.limit_s + GRACE_S:  # its limit and the time to stop it must fit
            results.append(Result(part.name, part.what, "not run", note=f"{left:.0f} s of the budget left"))
        else:
            print(f"[{clock() - start:5.0f} s] {part.name}: {part.what} (limit {part.limit_s:.0f} s)", flush=True)
            results.append(run_part(part, env, part.limit_s, work))
            print(f"        {results[-1].status} in {results[-1].seconds:.0f} s {results[-1].note}", flush=True)
        table = write_tables(out, results)  # after every part: a run cut short still leaves its table
    print("\n" + table)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.status in ("ok", "skipped", "not run") for r in results) else 1


def _cuda_devices(env: dict[str, str]) -> int:
    """How many GPUs torch (the machine's own; no wheel is needed) sees, asked in a child process (0: none)."""
    probe = [
        sys.executable,
        "-c",
        "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)",
    ]
    try:
        done = subprocess.run(probe, env=env, capture_output=True, timeout=120, text=True)
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0
