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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..exceptions import OLMoError
from ..util.bounded_files import read_tail
from ..util.pids import kill_tagged
from .gpu_checks_table import Result, environment_numbers, markdown_table, out_problem, read_report, write_tables
from .gpu_wheels import check_wheels, cpython_minor, gather, list_wheels

__all__ = ["Part", "parts", "main", "markdown_table"]

ROOT = Path.cwd()
"""The checkout the parts run in: the working directory (the device tool runs commands in the repository root)."""
BENCH = [sys.executable, "scripts/benchmark.py"]
LADDER = {"300m": ("configs/official/OLMo-300M.yaml", 16), "1b": ("configs/official/OLMo-1B.yaml", 8)}
"""Config and micro-batch of each ladder model: the sizes that gave the best bf16 tokens/s per memory on the H200
(RESEARCH_LOG 2026-11-26); the same micro-batch for bf16 and float8, as the float8 goal is stated."""


@dataclass
class Part:
    """One check: its commands (run in order in the checkout), the time they may take together, and whether it
    needs a GPU."""

    name: str
    what: str
    commands: list[list[str]]
    limit_s: float
    needs_cuda: bool = True
    report: Optional[str] = None
    """A JSON file the last command writes (a benchmark report), read back for the table's numbers."""
    skip_reason: Optional[str] = None
    """Why the part is left out before it starts (set when the machine lacks what it needs)."""


def _bench(name: str, model: str, float8: Optional[str], work: Path, extra: tuple[str, ...] = ()) -> Part:
    """``benchmark.py`` on a ladder model (``--profile`` in ``extra``: where its time goes, too)."""
    config, micro = LADDER[model]
    out = work / f"{name}.json"
    cmd = [*BENCH, config, "--data", "synthetic", "--steps", "10", "--warmup", "3", "--precision", "amp_bf16"]
    cmd += f"--compile --batch {micro} --micro-batch {micro} --override metrics_collect_interval=10".split()
    if float8:
        cmd += ["--override", "model.float8.enabled=true", "--override", f"model.float8.recipe={float8}"]
    what = f"OLMo-{model.upper()} bf16 compiled, micro-batch {micro}" + (f", float8 {float8}" if float8 else "")
    shown = [e for e in extra if e.startswith("model.")] + (["profiled"] if "--profile" in extra else [])
    return Part(
        name,
        what + "".join(f", {e}" for e in shown),
        [cmd + list(extra) + ["--out", str(out)]],
        75,
        report=str(out),
    )


def parts(work: Path, original_python: str, flash_attn: bool, cuda: bool = True, gpus: int = 2) -> list[Part]:
    """The checks in the order they run (most important first), with the limit of each. Without ``cuda`` the
    comparison with the original runs a small model on the CPU (the other parts need the GPU). With one GPU the
    two-process parts are skipped before they start: NCCL refuses two ranks on one GPU ("Duplicate GPU detected",
    since NCCL 2.5), so they would spend a minute of a lease to fail."""
    env_probe = (
        "import json, platform, torch; d = torch.cuda.is_available(); "
        "info = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'gpu': torch.cuda.get_device_name() if d else None, "
        "'capability': list(torch.cuda.get_device_capability()) if d else None}\n"
        "for m in ('torchao', 'flash_attn', 'fla', 'triton', 'omegaconf'):\n"
        "    try: info[m] = __import__(m).__version__\n"
        "    except Exception as e: info[m] = f'not importable ({type(e).__name__})'\n"
        "print(json.dumps(info))"
    )
    ladder = [
        _bench("1b-bf16", "1b", None, work, ("--profile",)),
        _bench("1b-float8-tensorwise", "1b", "tensorwise", work, ("--profile",)),
        _bench("300m-bf16", "300m", None, work),
        _bench("300m-float8-tensorwise", "300m", "tensorwise", work),
    ]
    size = "--d-model 2048 --n-layers 8 --seq 2048 --batch 4 --rounds 4 --iters 3".split()
    if not cuda:
        size = "--d-model 128 --n-layers 2 --seq 64 --batch 2 --rounds 1 --iters 1".split()
    device = ["--device", "cuda", "--dtype", "bf16"] if cuda else ["--device", "cpu", "--threads", "1"]
    original = Part(
        "original-olmo",
        "against ai2-olmo 0.6.0, same weights: "
        + ("OLMo-1B's shape, 8 layers, bf16" if cuda else "a small model"),
        [
            [sys.executable, "scripts/benchmark_olmo.py", *device, *size, "--warmup", "1"]
            + ["--olmo-python", original_python, "--json", str(work / "original-olmo.json")]
        ],
        90,
        needs_cuda=False,
        report=str(work / "original-olmo.json"),
    )
    fsdp = Part(
        "fsdp-2-processes",
        "torchrun --nproc_per_node=2 on two GPUs: FSDP over NCCL, float8 weights all-gathered in float8",
        [
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "scripts/benchmark.py"]
            + ["configs/official/OLMo-300M.yaml", "--data", "synthetic", "--steps", "5", "--warmup", "2"]
            + ["--precision", "amp_bf16", "--batch", "4", "--micro-batch", "4", "--out", str(work / "fsdp.json")]
            + ["--override", "model.float8.enabled=true", "--override", "distributed_strategy=fsdp"]
        ],
        60,
        report=str(work / "fsdp.json"),
    )
    windows = []
    for name, extra, what in (
        ("windows-8192-full", [], "full attention"),
        (
            "windows-8192-flex",
            ["--override", "model.sliding_window.pattern=[4096,4096,4096,-1]", "--profile"],
            "OLMo 3's windows (4,096) on FlexAttention, profiled",
        ),
        (
            "documents-8192-flex",
            ["--doc-length", "2048", "--profile"],
            "documents of 1,024-3,072 tokens masked, on FlexAttention, profiled",
        ),
        (
            "windows-8192-sdpa",
            ["--override", "model.sliding_window.pattern=[4096,4096,4096,-1]"]
            + ["--override", "model.attention_backend=sdpa"],
            "OLMo 3's windows (4,096) in an SDPA mask",
        ),
    ):
        out = work / f"{name}.json"
        windows.append(
            Part(
                name,
                "OLMo-300M at 8,192 tokens, bf16 compiled, micro-batch 4: " + what,
                [
                    [*BENCH, "configs/official/OLMo-300M.yaml", "--data", "synthetic", "--steps", "10"]
                    + ["--warmup", "3", "--precision", "amp_bf16", "--compile", "--seq-len", "8192"]
                    + ["--batch", "4", "--micro-batch", "4", *extra, "--out", str(out)]
                ],
                90,
                report=str(out),
            )
        )
    pipeline = Part(
        "pipeline-2-processes",
        "torchrun --nproc_per_node=2: OLMo-300M as a 2-stage 1F1B pipeline over NCCL (issue 54), 8 micro-batches",
        [
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "scripts/benchmark.py"]
            + ["configs/official/OLMo-300M.yaml", "--data", "synthetic", "--steps", "5", "--warmup", "2"]
            + [
                "--precision",
                "amp_bf16",
                "--batch",
                "8",
                "--micro-batch",
                "1",
                "--out",
                str(work / "pipeline.json"),
            ]
            + ["--override", "pipeline_parallel.degree=2", "--override", "model.weight_tying=false"]
            + ["--override", "evaluators=[]"]
        ],
        60,
        report=str(work / "pipeline.json"),
    )
    rowwise = [
        _bench("1b-float8-rowwise", "1b", "rowwise", work),
        _bench("300m-float8-rowwise", "300m", "rowwise", work),
    ]
    experts = []
    for name, extra in (("experts-layer", []), ("experts-layer-compiled", ["--compile"])):
        out = work / f"{name}.json"
        shape = "--tokens 16384 --d-model 2048 --experts 64 --top-k 8 --hidden 1024 --precision bf16 --repeats 5"
        experts.append(
            Part(
                name,
                "OLMoE-1B-7B's expert layer, 2 x 8,192 tokens, bf16 weights held (as FSDP hands them)"
                + (", compiled" if extra else ", eager")
                + ": the grouped layer, the loop and the grouped multiplies alone, each over the dense MLP of "
                "equal active width",
                [[sys.executable, "scripts/benchmark_experts.py", *shape.split(), *extra, "--out", str(out)]],
                90 if extra else 60,
                report=str(out),
            )
        )
    olmoe_out = work / "olmoe-4-layers.json"
    olmoe = Part(
        "olmoe-4-layers",
        "OLMoE-1B-7B with 4 layers, 4 x 4,096 tokens, bf16 compiled: MFU on active parameters, profiled",
        [
            [*BENCH, "configs/official/OLMoE-1B-7B.yaml", "--data", "synthetic", "--steps", "10", "--warmup", "3"]
            + ["--precision", "amp_bf16", "--compile", "--batch", "4", "--micro-batch", "4"]
            + ["--override", "model.n_layers=4", "--override", "metrics_collect_interval=10"]
            + ["--profile", "--out", str(olmoe_out)]
        ],
        90,
        report=str(olmoe_out),
    )
    flash = _bench("1b-bf16-flash-attn", "1b", None, work, ("--override", "model.flash_attention=true"))
    if not flash_attn:
        flash.skip_reason = "no flash-attn wheel (PyPI has none; put flash_attn-*.whl into the wheel folder)"
    curves = Part(
        "float8-loss-curves",
        "bf16 and float8 tensorwise, 200 steps of real text (4 layers, d_model 1024), compiled",
        [[sys.executable, "-m", "olmo.bench.float8_curves", "--out", str(work / "float8-curves.json")]],
        120,
        report=str(work / "float8-curves.json"),
    )
    linear = Part(
        "linear-attention-kernels",
        "Gated DeltaNet at OLMo Hybrid's layer shape (30 heads, key 96, value 192), bf16, 2 x 2,048 and 2 x 8,192: "
        "flash-linear-attention's kernels against the pure-PyTorch chunked path (fp32 difference) and attention",
        [
            [sys.executable, "scripts/benchmark_linear_attention.py", "--seq", "2048", "8192", "--batch", "2"]
            + "--heads 30 --key-dim 96 --value-dim 192 --precision bf16 --recurrence-max 0".split()
            + ["--out", str(work / "linear-attention.json")]
        ],
        90,
        report=str(work / "linear-attention.json"),
    )
    tests = Part(
        "gpu-tests", "pytest tests/test_gpu.py", [[sys.executable, "-m", "pytest", "-q", "tests/test_gpu.py"]], 120
    )
    probe = Part(
        "environment",
        "Python, torch, CUDA, GPU, torchao, flash-attn",
        [[sys.executable, "-c", env_probe]],
        30,
        False,
    )
    if gpus < 2:
        for part in (fsdp, pipeline):
            part.skip_reason = "one GPU: NCCL refuses two ranks on one GPU (Duplicate GPU detected); needs two"
    # Issue 55's parts first (windows, the expert layer, float8 on OLMo-1B), then the rest of the checks.
    first = [probe, *windows[:3], *experts, olmoe, ladder[0], ladder[1], rowwise[0], tests, ladder[2], ladder[3]]
    return [*first, rowwise[1], curves, windows[3], fsdp, original, linear, pipeline, flash]


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
