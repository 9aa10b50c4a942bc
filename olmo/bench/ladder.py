"""Measure throughput one change at a time: eager fp32 -> TF32 -> bf16 -> flash attention -> compile ->
larger micro-batch -> fused loss -> metrics read back every 10 steps. Each rung keeps the changes of the rungs
run before it.

    python scripts/benchmark_ladder.py CONFIG [--out-dir DIR] [--rungs eager,bf16,...] [--steps 20]
        [--warmup 5] [--batch B] [--micro-batch M] [--big-micro-batch M2] [--smoke]
        [--override key=value ...]

Every rung is a separate ``scripts/benchmark.py`` process (so compile caches and memory peaks do not carry
over) writing ``DIR/NN-rung.json``; the ladder then prints a Markdown table (tokens/s, MFU, step time, peak
memory, change against the rung before, attention kernel) and writes it to ``DIR/ladder.md`` with
everything in ``DIR/ladder.json``. The first rung's peak FLOP/s is passed on to the later rungs, so that on
a CPU (whose peak is measured per process) their MFUs use the same figure. A rung that fails (out of
memory, say) is reported as failed, and the next rung is compared with the last one that ran.

The first rung is strict IEEE fp32 (``float32_matmul_precision=highest``; training's default is TF32). On
a CPU, ``tf32``, ``bf16`` and ``flash`` change nothing (TF32, autocast and flash-attn are GPU-only here), so
they are skipped unless named in ``--rungs``. ``flash`` switches to the flash-attn package; without it
installed the model keeps PyTorch SDPA, which already runs its own flash (or cuDNN) kernel on a GPU: the
table's attention column says which kernel each rung ran. ``--override`` applies to every rung (e.g.
``model.n_layers=2``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from olmo.bench.scripts import sibling_script

RUNGS: dict[str, tuple[str, list[str]]] = {
    "eager": (
        "eager fp32",
        [
            "--precision=fp32",
            "--no-compile",
            "--override=model.flash_attention=false",
            "--override=fused_loss=false",
            "--override=metrics_collect_interval=1",
            "--override=float32_matmul_precision=highest",
        ],
    ),
    "tf32": ("+ TF32 for fp32 matmuls", ["--override=float32_matmul_precision=high"]),
    "bf16": ("+ bf16 autocast", ["--precision=amp_bf16"]),
    "flash": ("+ flash attention", ["--override=model.flash_attention=true"]),
    "compile": ("+ torch.compile per block", ["--compile"]),
    "batch": ("+ larger micro-batch", []),  # flags from bigger_batch_flags()
    "fused_loss": ("+ fused loss", ["--override=fused_loss=true"]),
    "collect": ("+ metrics read back every 10 steps", ["--override=metrics_collect_interval=10"]),
}
GPU_ONLY = ("tf32", "bf16", "flash")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_ladder.py", description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--out-dir", default="benchmark-ladder", help="where the JSON results go")
    parser.add_argument("--rungs", help=f"comma-separated subset of {','.join(RUNGS)} (default: all that apply)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--batch", type=int, help="device batch of every rung (default: config)")
    parser.add_argument("--micro-batch", type=int, help="micro-batch before the 'batch' rung (default: config)")
    parser.add_argument("--big-micro-batch", type=int, help="micro-batch from the 'batch' rung on (default: 2x)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--smoke", action="store_true", help="pass --smoke to every benchmark (CI)")
    args = parser.parse_args(argv)
    if args.rungs:
        unknown = sorted(set(args.rungs.split(",")) - set(RUNGS))
        if unknown:
            parser.error(f"unknown rung(s) {unknown}; choose from {','.join(RUNGS)}")
    return args


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def common_flags(args: argparse.Namespace) -> list[str]:
    """Flags every rung gets."""
    flags = [f"--override={o}" for o in args.override]
    for name in ("steps", "warmup", "batch", "micro_batch"):
        if getattr(args, name) is not None:
            flags.append(f"--{name.replace('_', '-')}={getattr(args, name)}")
    return flags + (["--smoke"] if args.smoke else [])


def bigger_batch_flags(args: argparse.Namespace, first: Optional[dict[str, Any]]) -> list[str]:
    """The ``batch`` rung: ``--big-micro-batch``, or twice the micro-batch the first rung ran with; the device
    batch grows with it when it would otherwise be smaller than one micro-batch."""
    ran = first["setup"]["batch"] if first is not None else None
    micro = args.big_micro_batch or 2 * (args.micro_batch or (ran["micro_batch"] if ran else 1))
    flags = [f"--micro-batch={micro}"]
    device_batch = args.batch or (ran["device_batch"] if ran else micro)
    if device_batch < micro or device_batch % micro:
        flags.append(f"--batch={max(micro, device_batch - device_batch % micro)}")
    return flags


def pinned_peak(flags: list[str]) -> bool:
    return any("speed_monitor.gpu_flops_available=" in f for f in flags)


def run_rung(config: str, flags: list[str], out: Path) -> tuple[Optional[dict[str, Any]], str]:
    cmd = [sys.executable, str(sibling_script("benchmark.py")), config, *flags, f"--out={out}"]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        return None, lines[-1] if lines else f"exit code {result.returncode}"
    return json.loads(out.read_text()), ""


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| rung | tokens/s | MFU | step | peak memory | vs previous | attention |\n|---|---|---|---|---|---|---|"
    )
    lines, previous = [head], None
    for row in rows:
        r = row["result"]
        if r is None:
            lines.append(f"| {row['label']} | failed: {row['error'][:80]} | | | | | |")
            continue
        res = r["results"]
        tps = res["tokens_per_second"]
        mfu = "n/a" if res["mfu"] is None else f"{100 * res['mfu']:.1f}%"
        change = "" if previous is None else f"{100 * (tps / previous - 1):+.1f}%"
        attention = r["setup"]["attention"]
        kernel = attention["backend"] + (f" ({attention['sdpa_kernel']})" if attention["sdpa_kernel"] else "")
        lines.append(
            f"| {row['label']} | {tps:,.0f} | {mfu} | {1e3 * res['step_time_s']:,.1f} ms "
            f"| {res['peak_memory_mb']:,.0f} MB | {change} | {kernel} |"
        )
        previous = tps
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    gpu = cuda_available()
    names = args.rungs.split(",") if args.rungs else [n for n in RUNGS if gpu or n not in GPU_ONLY]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    flags = common_flags(args)
    for i, name in enumerate(names):
        # Cumulative over the chosen rungs: each keeps the changes of those before it.
        if name == "batch":
            first = next((row["result"] for row in rows if row["result"] is not None), None)
            flags = flags + bigger_batch_flags(args, first)
        else:
            flags = flags + RUNGS[name][1]
        start = time.perf_counter()
        result, error = run_rung(args.config, flags, out_dir / f"{i:02d}-{name}.json")
        rows.append(
            {
                "rung": name,
                "label": RUNGS[name][0],
                "flags": flags,
                "seconds": round(time.perf_counter() - start, 1),
                "result": result,
                "error": error,
            }
        )
        print(table(rows).splitlines()[-1], flush=True)
        if result is not None and not pinned_peak(flags) and result["setup"]["peak_flops"]:
            # A CPU's peak is measured per process and varies; one figure for all rungs keeps MFU comparable.
            flags = flags + [f"--override=speed_monitor.gpu_flops_available={result['setup']['peak_flops']:.6g}"]
    markdown = table(rows)
    (out_dir / "ladder.md").write_text(markdown + "\n")
    (out_dir / "ladder.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown)
    return 0 if all(row["result"] is not None for row in rows) else 1
