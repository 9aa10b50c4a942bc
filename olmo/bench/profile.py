"""Where a step's time goes: ``torch.profiler`` over a few steps, summed by operation and by kind of work.

:func:`profile_steps` runs ``step`` under the profiler (after the measured steps, so it never touches their numbers)
and returns, per step, the time of the heaviest operations and of each category: on a GPU the kernels' own device
time (so the categories add up to the time the GPU was busy), on a CPU the operators' own CPU time. A kernel's
category is read from its name (:data:`CATEGORIES`, first match wins): a guide to where to look, not an exact
account (a compiled region's fused Triton kernels, for one, are named after what they fuse).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CATEGORIES", "category", "profile_steps"]

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|gloo|c10d|all_?gather|reduce_?scatter|all_?reduce|broadcast"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn|flex"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|aten::(mm|bmm|addmm_?|matmul|linear|_grouped_mm|_scaled_mm)$"),
    ("float8 casts", r"float8|fp8|e4m3|e5m2|triton\w*amax"),
    ("optimizer", r"adam|foreach|multi_tensor"),
    ("copies and indexing", r"memcpy|memset|copy|aten::cat$|cat_|index|gather|scatter|sort|embedding"),
    (
        "elementwise, norms and reductions",
        r"triton|elementwise|vectorized|reduce|unrolled|norm|softmax|aten::(add|sub|mul|div|exp|log|sum|mean|silu"
        r"|gelu|sqrt|rsqrt|pow|fill|neg|where|clamp|max|amax|min|addcmul|addcdiv|lerp|logsumexp)",
    ),
)
"""``(category, regular expression on the lower-cased name)``, tried in order; what matches none is "other"."""


def category(name: str) -> str:
    """The category of an operation or kernel named ``name`` (see :data:`CATEGORIES`)."""
    lowered = name.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, lowered)), "other")


def profile_steps(step: Callable[[], Any], steps: int, device: torch.device, top: int = 25) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under the profiler; return, per step, the busy time in milliseconds, each
    category's, and the ``top`` heaviest operations (name, calls, milliseconds, share of the busy time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    rows = []
    for event in prof.key_averages():
        micros = event.self_device_time_total if cuda else event.self_cpu_time_total
        if micros > 0:
            rows.append((event.key, event.count, micros / 1e3 / steps))
    busy = sum(ms for _, _, ms in rows) or 1.0
    categories: dict[str, float] = {}
    for name, _, ms in rows:
        kind = category(name)
        categories[kind] = categories.get(kind, 0.0) + ms
    rows.sort(key=lambda r: -r[2])
    return {
        "time": "kernels' device time" if cuda else "operators' own CPU time",
        "steps": steps,
        "busy_ms_per_step": round(busy, 3),
        "categories_ms_per_step": {k: round(v, 3) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        "top": [
            {"name": name[:160], "calls_per_step": count / steps, "ms_per_step": round(ms, 3), "share": ms / busy}
            for name, count, ms in rows[:top]
        ],
    }
