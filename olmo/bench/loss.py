"""Time and memory of the output layer + loss alone, plain (logits, then cross entropy) against fused
(``olmo.model.loss.fused_output_loss``), at a model's real shapes.

    python scripts/benchmark_loss.py [--tokens 8192] [--d-model 2048] [--vocab 50304] [--chunk 2048]
        [--precision fp32|bf16] [--repeats 3] [--z-loss 1e-4] [--out result.json]

Each variant runs in its own process, so its peak memory is its own: on CUDA ``max_memory_allocated`` above
what the inputs take, on CPU the growth of the resident set's peak (VmHWM, reset once the inputs exist). Time is the median of
``--repeats`` forward+backward passes after one warm-up. The defaults are OLMo-1B's output layer with a
micro-batch of 4 × 2048 tokens. ``--precision bf16`` autocasts on CUDA (on CPU it runs fp32 either way).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from olmo.bench.scripts import sibling_script

VARIANTS = ("plain", "fused")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_loss.py", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (B x T)")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304, help="embedding size (padded vocabulary)")
    parser.add_argument("--chunk", type=int, default=None, help="fused loss chunk (default: olmo.model.loss's)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--float32-matmul-precision",
        choices=["highest", "high", "medium"],
        default="high",
        help="on CUDA, as in training",
    )
    parser.add_argument("--z-loss", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    parser.add_argument("--out")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run one variant in this process."""
    import torch

    from olmo.model.loss import FUSED_LOSS_CHUNK_TOKENS, cross_entropy_sums, fused_output_loss

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision(args.float32_matmul_precision)  # as build_model does
    gen = torch.Generator().manual_seed(0)
    # Scaled in place: a scaled copy would briefly take a second weight's memory before the baseline is read.
    hidden = torch.randn(args.tokens, args.d_model, generator=gen).mul_(0.5).to(device).requires_grad_()
    weight = torch.randn(args.vocab, args.d_model, generator=gen).mul_(args.d_model**-0.5).to(device)
    weight.requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    labels[-1] = -100  # the last position of a sequence has no label
    chunk = args.chunk or FUSED_LOSS_CHUNK_TOKENS
    autocast = device.type == "cuda" and args.precision == "bf16"

    def step() -> float:
        hidden.grad = weight.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            if args.variant == "fused":
                loss = fused_output_loss(hidden, weight, labels, args.z_loss, chunk_size=chunk)
            else:
                loss = cross_entropy_sums(torch.nn.functional.linear(hidden, weight), labels, args.z_loss)
        loss.total.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return float(loss.ce)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _reset_peak_rss()
    ce = step()  # warm-up; also creates the .grad tensors, which the peak counts
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss() - base
    return {
        "variant": args.variant,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "autocast_bf16": autocast,
        "median_seconds": statistics.median(seconds),
        "seconds": seconds,
        "peak_extra_memory_mb": peak / 2**20,
        "mean_ce": ce / (args.tokens - 1),
    }


def _reset_peak_rss() -> int:
    """Reset the process's peak resident set to its current size (Linux), and return the peak in bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # "5" resets VmHWM, the peak RSS
    except OSError:
        pass  # elsewhere the peak since start-up is the baseline
    return _peak_rss()


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(measure(args)))
        return 0
    results = {}
    for variant in VARIANTS:
        options = {k: v for k, v in vars(args).items() if k not in ("out", "variant") and v is not None}
        # Each variant runs in a child process of this script.
        script = sibling_script("benchmark_loss.py")
        cmd = [sys.executable, str(script), *(f"--{k.replace('_', '-')}={v}" for k, v in options.items())]
        cmd.append(f"--variant={variant}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    shape = f"{args.tokens} tokens x d_model {args.d_model} x vocab {args.vocab}, {args.precision}"
    print(f"Output layer + loss, {shape} on {results['plain']['device']}:")
    print("| variant | forward+backward | extra peak memory | mean CE |\n|---|---|---|---|")
    for variant, r in results.items():
        print(
            f"| {variant} | {1e3 * r['median_seconds']:,.0f} ms | {r['peak_extra_memory_mb']:,.0f} MB "
            f"| {r['mean_ce']:.6f} |"
        )
    if args.out:
        report = {"args": {k: v for k, v in vars(args).items() if k != "variant"}, "results": results}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0
