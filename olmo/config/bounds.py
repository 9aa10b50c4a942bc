"""Limits shared by the config checks, and the one check that every float of a config is a finite number of a
size that can be meant.

A duration taken straight from the config ends up in ``time.sleep``, ``threading.Event.wait``, a socket timeout
or ``datetime.timedelta``; past their limits these raise ``OverflowError`` (``inf``, ``1e12``), and well below
them a wait of days makes a job that ignores SIGTERM for as long. The bounds below are far above any sensible
setting and far below any such limit.

A factor, weight, coefficient or scale multiplies something the step computes (a loss term, the attention logits,
an update): ``1e300`` passes every sign check and overflows at step 1, where it reads as a divergence. Such keys are
found by their name (:data:`SCALE_WORDS`), so a new one is bounded without a check of its own.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any

__all__ = [
    "MAX_WAIT_SECONDS",
    "MAX_TIMEOUT_SECONDS",
    "INFINITY_MEANS_OFF",
    "MAX_SCALE",
    "SCALE_WORDS",
    "is_scale_key",
    "non_finite_problems",
    "problem_key",
    "with_bound_problems",
]

MAX_WAIT_SECONDS = 3600.0
"""The longest single wait between two tries (a retry's backoff): an hour. A server down for longer is better
reported than waited for, and a process asleep longer would not react to a stop request for that long."""
MAX_TIMEOUT_SECONDS = 86400.0
"""The longest timeout (a request, a collective, a phase of a step): a day. Anything that has not finished in
a day is hung, and the job should end so that it can be restarted."""
INFINITY_MEANS_OFF = ("max_grad_norm", "max_grad_norm_ratio")
"""Keys for which ``inf`` works and means what null means (no clipping); ``nan`` is still refused."""
MAX_SCALE = 1e6
"""The largest magnitude of a float whose key names a scale (:data:`SCALE_WORDS`). The largest such value in a real
config is a RoPE scaling factor of 8 to 32 or a gradient-clip warmup factor of 10; a million times a loss term, an
attention logit or an initial weight is a typo (an exponent's sign, extra zeros) that overflows in the first step."""
SCALE_WORDS = frozenset(
    ("factor", "multiplier", "coef", "coefficient", "weight", "scale", "std", "beta", "betas", "softcap", "eps")
)
"""A float key one of whose ``_``-separated words is one of these multiplies something (or, ``eps``, is added to a
denominator) and is bounded by :data:`MAX_SCALE`: ``model.rope_scaling.attention_factor``, ``model.moe.lb_loss_weight``,
``dpo.beta``, ``optimizer.betas``, ``model.init_std``, ``auxiliary_loss_multiplier``, ``optimizer.weight_decay``...
Keys of other floats (``model.rope_theta`` of 500,000 and more, token counts, FLOPs, learning rates, durations) are
not: their ranges are their own sections' checks."""


def is_scale_key(key: str) -> bool:
    """Whether the dotted config key ``key`` names a scale (one of its last part's words is in :data:`SCALE_WORDS`)."""
    name = key.rsplit(".", 1)[-1].split("[", 1)[0]
    return not SCALE_WORDS.isdisjoint(name.split("_"))


_SCALE_FIX = (
    f"is beyond {MAX_SCALE:,.0f} in magnitude: no factor, weight, coefficient, scale or epsilon this large can be "
    f"meant, and it overflows (or wipes out what it scales) in the first step. A typo (extra zeros, a lost minus in "
    f"the exponent)? Set the value you meant."
)
"""What follows a key of a scale past :data:`MAX_SCALE` and its value, in the problem reported."""


def non_finite_problems(config: Any, prefix: str = "") -> dict[str, str]:
    """``{dotted key: problem}`` for every float (or list of numbers) in the dataclass instance ``config`` and the
    sections under it that is ``nan`` or ``inf`` (no float field of a run's config means anything with one; those
    of :data:`INFINITY_MEANS_OFF` take ``inf``), or of a key that names a scale (:func:`is_scale_key`) and is
    larger than :data:`MAX_SCALE` in magnitude. Mappings (a stage's ``data``) are not looked into."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        key, value = f"{prefix}{f.name}", getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(non_finite_problems(value, f"{key}."))
        elif isinstance(value, (list, tuple)) and value and all(dataclasses.is_dataclass(v) for v in value):
            for i, item in enumerate(value):
                out.update(non_finite_problems(item, f"{key}[{i}]."))
        elif isinstance(value, (list, tuple)) and any(_non_finite(v, key) for v in value):
            out[key] = f"{key}={list(value)} must be finite numbers."
        elif _non_finite(value, key):
            null = " (or null)" if type(None) in typing.get_args(hints[f.name]) else ""
            out[key] = f"{key}={value} must be a finite number{null}."
        elif isinstance(value, (list, tuple)) and any(_too_large(v, key) for v in value):
            out[key] = f"{key}={list(value)} {_SCALE_FIX}"
        elif _too_large(value, key):
            out[key] = f"{key}={value:g} {_SCALE_FIX}"
    return out


def _non_finite(value: Any, key: str) -> bool:
    if not isinstance(value, float) or math.isfinite(value):
        return False
    return math.isnan(value) or key not in INFINITY_MEANS_OFF


def _too_large(value: Any, key: str) -> bool:
    return isinstance(value, float) and abs(value) > MAX_SCALE and is_scale_key(key)


def problem_key(problem: str) -> str:
    """The key a ``key=value ...`` problem is about (``stages[1] (anneal).kl_beta=...``: ``stages[1].kl_beta``)."""
    return re.sub(r" \([^)]*\)", "", problem.split("=", 1)[0])


def with_bound_problems(problems: list[str], config: Any, prefix: str) -> list[str]:
    """``problems`` (a section's own, each ``key=value ...``) and then :func:`non_finite_problems` of the section
    ``config`` at ``prefix`` for the keys that none of them is about: a section reports every bound itself, once."""
    reported = {problem_key(p) for p in problems}
    return problems + [p for key, p in non_finite_problems(config, prefix).items() if key not in reported]
