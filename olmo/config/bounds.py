"""Limits shared by the config checks, and the one check that every float of a config is a finite number.

A duration taken straight from the config ends up in ``time.sleep``, ``threading.Event.wait``, a socket timeout
or ``datetime.timedelta``; past their limits these raise ``OverflowError`` (``inf``, ``1e12``), and well below
them a wait of days makes a job that ignores SIGTERM for as long. The bounds below are far above any sensible
setting and far below any such limit.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

__all__ = ["MAX_WAIT_SECONDS", "MAX_TIMEOUT_SECONDS", "INFINITY_MEANS_OFF", "non_finite_problems"]

MAX_WAIT_SECONDS = 3600.0
"""The longest single wait between two tries (a retry's backoff): an hour. A server down for longer is better
reported than waited for, and a process asleep longer would not react to a stop request for that long."""
MAX_TIMEOUT_SECONDS = 86400.0
"""The longest timeout (a request, a collective, a phase of a step): a day. Anything that has not finished in
a day is hung, and the job should end so that it can be restarted."""
INFINITY_MEANS_OFF = ("max_grad_norm", "max_grad_norm_ratio")
"""Keys for which ``inf`` works and means what null means (no clipping); ``nan`` is still refused."""


def non_finite_problems(config: Any, prefix: str = "") -> dict[str, str]:
    """``{dotted key: problem}`` for every float (or list of numbers) in the dataclass instance ``config`` and the
    sections under it that is ``nan`` or ``inf``: no float field of a run's config means anything with one (those
    of :data:`INFINITY_MEANS_OFF` take ``inf``). Mappings (a stage's ``data``) are not looked into."""
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
    return out


def _non_finite(value: Any, key: str) -> bool:
    if not isinstance(value, float) or math.isfinite(value):
        return False
    return math.isnan(value) or key not in INFINITY_MEANS_OFF
