"""Time of a mixture-of-experts layer alone (``olmo.model.moe.MoEFeedForward``), forward and backward: its experts
as one grouped multiply (``torch._grouped_mm``) and as a loop over the experts, against the dense SwiGLU MLP with the
same active parameters (width ``top_k * hidden``), at a model's real shapes; and the grouped multiplies alone on rows
already in expert order (``experts``), which is what routing and the permutation add to.

    python scripts/benchmark_experts.py [--tokens 8192] [--d-model 2048] [--experts 64] [--top-k 8]
        [--hidden 1024] [--precision fp32|bf16] [--compile] [--repeats 5] [--out result.json]

The defaults are one OLMoE-1B-7B layer with a micro-batch of 2 x 4096 tokens. Time is the median of ``--repeats``
forward+backward passes after one warm-up (the device synchronized around each, the gradients cleared before each).
``--precision bf16`` on CUDA holds the weights in bf16, as FSDP's mixed precision hands them to a layer, and
autocasts (the grouped kernel runs there in bf16 only; the router still computes in fp32); on a CPU it runs fp32.
``--compile`` compiles each variant (``torch.compile``, the model's own guards installed first). Before timing, the
grouped and the loop variants are checked to compute the same output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VARIANTS = ("dense", "grouped", "loop", "experts")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_experts.py", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (B x T)")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024, help="each expert's hidden width")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--compile", action="store_true", help="compile each variant (torch.compile)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("tokens", "d_model", "experts", "top_k", "hidden", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.top_k > args.experts:
        parser.error(f"--top-k={args.top_k} must not exceed --experts={args.experts}")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time each variant; return the shapes and, per variant, the median seconds of a forward+backward pass."""
    import torch
    import torch.nn.functional as F

    from olmo.model.compile_guards import install_compile_guards
    from olmo.model.moe import MoEFeedForward, grouped_mm_runs, permutation, swiglu_experts

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.precision == "bf16" and device.type == "cuda" else None
    held = dtype or torch.float32
    torch.manual_seed(0)
    layer = MoEFeedForward(args.d_model, args.experts, args.top_k, args.hidden, device=device).to(held)
    width = args.top_k * args.hidden
    up = torch.nn.Parameter((torch.randn(2 * width, args.d_model, device=device) * 0.02).to(held))
    down = torch.nn.Parameter((torch.randn(args.d_model, width, device=device) * 0.02).to(held))
    x = torch.randn(args.tokens, args.d_model, device=device, dtype=held, requires_grad=True)
    with torch.no_grad():  # the rows in expert order and the group ends of this input's routing, for `experts`
        layer(x)
        assert layer.routing is not None
        perm = permutation(layer.routing.experts, args.experts)
        ends = torch.cumsum(perm.counts, dim=0).to(torch.int32)
    sorted_rows = x.detach()[perm.token_of].requires_grad_()

    def dense() -> torch.Tensor:
        a, b = F.linear(x, up).chunk(2, dim=-1)
        return F.linear(F.silu(b) * a, down)

    def experts(grouped: bool) -> Callable[[], torch.Tensor]:
        def fn() -> torch.Tensor:
            layer.use_grouped_mm = grouped
            return layer(x)

        return fn

    def experts_alone() -> torch.Tensor:
        return swiglu_experts(sorted_rows, (layer.w1, layer.w3, layer.w2), ends, grouped=True)

    kernel = grouped_mm_runs(x, layer.w1)
    variants: dict[str, Callable[[], torch.Tensor]] = {"dense": dense, "grouped": experts(True)}
    variants["loop"] = experts(False)
    if kernel and (held == torch.bfloat16 or not args.compile):  # compiled, the kernel traces in bf16 only
        variants["experts"] = experts_alone
    if args.compile:
        install_compile_guards()
        variants = {name: torch.compile(fn) for name, fn in variants.items()}
    params = [x, sorted_rows, up, down, *layer.parameters()]
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        with torch.no_grad():
            torch.testing.assert_close(variants["grouped"](), variants["loop"](), rtol=2e-2, atol=2e-3)
        times = {name: _median_seconds(fn, args.repeats, device, params) for name, fn in variants.items()}
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "precision": "bf16" if dtype is not None else "fp32",
        "compiled": args.compile,
        "tokens": args.tokens,
        "d_model": args.d_model,
        "experts": args.experts,
        "top_k": args.top_k,
        "hidden": args.hidden,
        "grouped_kernel": kernel,
        "seconds": times,
        "tokens_per_second": {name: args.tokens / s for name, s in times.items()},
        "grouped_over_dense": times["dense"] / times["grouped"],
    }


def _median_seconds(fn: Callable[[], Any], repeats: int, device: Any, params: list[Any]) -> float:
    import torch

    def once() -> float:
        for p in params:
            p.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn().float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    once()  # warm-up (and the compile, with --compile)
    return statistics.median(once() for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    import sys

    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(
        f"{result['tokens']:,} tokens, d_model {result['d_model']}, {result['experts']} experts of width "
        f"{result['hidden']}, top {result['top_k']}, {result['precision']} on {result['device']} (grouped kernel "
        f"{'runs' if result['grouped_kernel'] else 'cannot run: loop'}){', compiled' if result['compiled'] else ''}:"
    )
    for name in [v for v in VARIANTS if v in result["seconds"]]:
        seconds = result["seconds"][name]
        ratio = result["seconds"]["dense"] / seconds
        print(
            f"  {name:8s} {seconds * 1e3:9.1f} ms   {result['tokens_per_second'][name]:12,.0f} tokens/s   {ratio:.2f}x dense"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
