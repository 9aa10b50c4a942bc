"""Time and memory of a linear-attention layer's recurrence (Gated DeltaNet's delta rule) against full attention of
the same heads, forward and backward, at one or more sequence lengths; on a GPU with flash-linear-attention also its
kernels, checked against the pure-PyTorch chunked path first.

    python scripts/benchmark_linear_attention.py [--seq 2048 8192] [--batch 1] [--heads 8] [--key-dim 64]
        [--value-dim 128] [--precision fp32|bf16] [--repeats 3] [--recurrence-max 2048] [--threads N] [--out r.json]

Variants: ``chunked`` (the pure-PyTorch chunked delta rule, :func:`olmo.model.delta_rule_kernels.pure_gated_delta_rule`,
what a CPU trains with), ``recurrence`` (the step-by-step definition, forward only, up to ``--recurrence-max`` tokens),
``chunked-forward`` (its forward alone, beside the recurrence), ``attention`` (causal SDPA over the same heads, q and k of the key size, v of the value size: what a
``full_attention`` layer's core costs), ``kernels`` (flash-linear-attention's ``chunk_gated_delta_rule``, on CUDA when
it imports). Inputs are the layer's: q and k straight from the convolution, the decay ``g`` and ``beta`` in fp32.
Time is the median of ``--repeats`` passes after one warm-up, the device synchronized around each. Memory is what a
variant keeps for its backward (the bytes of the distinct tensors autograd saves, any device) and on CUDA the peak
allocated during the pass. Before timing, the kernels' outputs and input gradients are compared with the chunked
path's in fp32 (largest absolute difference, reported as ``kernels_max_diff``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main", "run", "parse_args"]

VARIANTS = ("chunked", "chunked-forward", "recurrence", "attention", "kernels")
FORWARD_ONLY = ("chunked-forward", "recurrence")
"""Timed without a backward: the recurrence is the reference (no gradient through 8,192 steps), compared with the
chunked path's forward alone."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_linear_attention.py", description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192], help="sequence lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="heads (key heads = value heads)")
    parser.add_argument("--key-dim", type=int, default=64)
    parser.add_argument("--value-dim", type=int, default=128)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: q, k, v in bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recurrence-max", type=int, default=2048, help="longest sequence the recurrence times")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("batch", "heads", "key_dim", "value_dim", "repeats"):
        if not 1 <= getattr(args, name) <= 2**16:
            parser.error(f"--{name.replace('_', '-')} must be between 1 and 65536")
    if any(not 1 <= t <= 2**20 for t in args.seq):
        parser.error("--seq lengths must be between 1 and 1048576")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each variant at each length: median seconds of a forward+backward pass (the recurrence: forward), tokens per
    second, the bytes saved for backward and (CUDA) the peak memory; the kernels' largest difference from the
    chunked path."""
    import torch

    from olmo.model.delta_rule_kernels import load_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    kernel = load_kernels()[0] if device.type == "cuda" else None
    B, H, dk, dv = args.batch, args.heads, args.key_dim, args.value_dim
    rows: list[dict[str, Any]] = []
    max_diff = None
    for T in args.seq:
        gen = torch.Generator().manual_seed(T)
        q, k = (torch.randn(B, T, H, dk, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
        v = torch.randn(B, T, H, dv, generator=gen).to(device, dtype).requires_grad_()
        g = (-torch.rand(B, T, H, generator=gen) * 0.1).to(device).requires_grad_()
        beta = torch.rand(B, T, H, generator=gen).to(device).requires_grad_()
        inputs = (q, k, v, g, beta)

        variants = _variants(inputs, args.recurrence_max, kernel)
        if kernel is not None and max_diff is None:
            max_diff = _kernel_difference(kernel, [t.detach().float() for t in inputs])
        for name, fn in variants.items():
            seconds, saved, peak = _measure(fn, args.repeats, device, backward=name not in FORWARD_ONLY)
            rows.append(
                {
                    "variant": name,
                    "seq": T,
                    "seconds": seconds,
                    "tokens_per_second": B * T / seconds,
                    "saved_for_backward_mb": saved / 2**20,
                    "peak_memory_mb": peak / 2**20 if peak is not None else None,
                    "backward": name not in FORWARD_ONLY,
                }
            )
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "shape": {"batch": B, "heads": H, "key_dim": dk, "value_dim": dv},
        "kernels": load_kernels()[1] if device.type == "cuda" else "not on a CPU",
        "rows": rows,
        "summary": _summary(rows, max_diff),
    }


def _variants(inputs: tuple[Any, ...], recurrence_max: int, kernel: Any) -> dict[str, Callable[[], Any]]:
    """The functions timed at one length, each over the same (B, T, heads, dim) inputs."""
    import torch
    import torch.nn.functional as F

    from olmo.model.delta_rule import l2_normalize, recurrent_gated_delta_rule
    from olmo.model.delta_rule_kernels import gated_delta_rule, pure_gated_delta_rule

    q, k, v, g, beta = inputs
    T, dk = q.shape[1], q.shape[3]

    def recurrence() -> torch.Tensor:
        with torch.no_grad():
            qn = l2_normalize(q.float()) * dk**-0.5
            kn = l2_normalize(k.float())
            return recurrent_gated_delta_rule(*(t.transpose(1, 2) for t in (qn, kn, v, g, beta)))[0]

    variants: dict[str, Callable[[], Any]] = {
        "chunked": lambda: pure_gated_delta_rule(q, k, v, g, beta)[0],
        "attention": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ),
    }
    if T <= recurrence_max:
        variants["recurrence"] = recurrence
        variants["chunked-forward"] = lambda: _no_grad(lambda: pure_gated_delta_rule(q, k, v, g, beta)[0])
    if kernel is not None:
        variants["kernels"] = lambda: gated_delta_rule(q, k, v, g, beta, kernel=kernel)[0]
    return variants


def _no_grad(fn: Callable[[], Any]) -> Any:
    import torch

    with torch.no_grad():
        return fn()


def _kernel_difference(kernel: Callable[..., Any], inputs: list[Any]) -> float:
    """The largest absolute difference between the kernels' and the chunked path's outputs and input gradients, in
    fp32, over the inputs as given and with two documents packed in each row."""
    import torch

    from olmo.model.delta_rule_kernels import gated_delta_rule, pure_gated_delta_rule

    T = inputs[0].shape[1]
    resets = torch.zeros(inputs[0].shape[0], T, dtype=torch.bool, device=inputs[0].device)
    resets[:, T // 3] = True
    worst = 0.0
    for r in (None, resets):
        grads = []
        for on_kernels in (False, True):
            q, k, v, g, beta = xs = [t.clone().requires_grad_() for t in inputs]
            if on_kernels:
                out = gated_delta_rule(q, k, v, g, beta, r, kernel=kernel)[0]
            else:
                out = pure_gated_delta_rule(q, k, v, g, beta, r)[0]
            out.float().square().mean().backward()
            grads.append([out.detach().float()] + [x.grad.float() for x in xs])  # type: ignore[union-attr]
        worst = max(worst, *(float((a - b).abs().max()) for a, b in zip(*grads)))
    return worst


def _measure(fn: Callable[[], Any], repeats: int, device: Any, backward: bool) -> tuple[float, int, int | None]:
    """Median seconds of ``fn`` (and its backward), the bytes of the distinct tensors autograd saved, and the CUDA
    peak of one pass."""
    import torch

    saved: dict[tuple[int, int], int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        saved[key] = t.untyped_storage().nbytes()
        return t

    def once(count: bool = False) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if count:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out = fn()
        else:
            out = fn()
        if backward:
            out.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    once(count=True)  # the warm-up counts what is saved
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        once()
        peak = torch.cuda.max_memory_allocated() - base
    seconds = statistics.median(once() for _ in range(repeats))
    return seconds, sum(saved.values()), peak


def _summary(rows: list[dict[str, Any]], max_diff: float | None) -> dict[str, Any]:
    """The ratios for the table: each variant's speed over the chunked path's and attention's at each length."""
    by = {(r["variant"], r["seq"]): r["seconds"] for r in rows}
    out: dict[str, Any] = {}
    for (variant, seq), seconds in sorted(by.items()):
        base = "chunked-forward" if variant in FORWARD_ONLY else "chunked"
        if variant != base and (base, seq) in by:
            out[f"{variant}/{base} time @{seq}"] = round(seconds / by[(base, seq)], 3)
    if max_diff is not None:
        out["kernels_max_diff"] = max_diff
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    shape = result["shape"]
    print(
        f"batch {shape['batch']}, {shape['heads']} heads, key {shape['key_dim']}, value {shape['value_dim']}, "
        f"{result['precision']} on {result['device']} ({result['threads']} threads; kernels: {result['kernels']}):"
    )
    for r in result["rows"]:
        peak = f"   peak {r['peak_memory_mb']:8.1f} MB" if r["peak_memory_mb"] is not None else ""
        print(
            f"  {r['variant']:15s} T={r['seq']:6d} {r['seconds'] * 1e3:10.1f} ms {'fwd+bwd' if r['backward'] else 'fwd'}"
            f"   {r['tokens_per_second']:12,.0f} tokens/s   saved {r['saved_for_backward_mb']:8.1f} MB{peak}"
        )
    for key, value in result["summary"].items():
        print(f"  {key}: {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
