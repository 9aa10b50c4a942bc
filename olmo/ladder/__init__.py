"""Scaling ladders: a family of model sizes planned, trained, tracked and fitted from one YAML.

* :mod:`olmo.ladder.config`: :class:`LadderConfig` (the YAML) and :func:`load_ladder`.
* :mod:`olmo.ladder.plan`: each size as a train config and a run plan (:func:`plan_ladder`).
* :mod:`olmo.ladder.fit`: scaling-law fits (loss against compute; the Chinchilla form).
* :mod:`olmo.ladder.report`: checkpoint status, results, predictions and plots.
* :mod:`olmo.ladder.lock`: one ``ladder.py run`` launch at a time per size (:func:`~olmo.ladder.lock.run_lock`).
* :mod:`olmo.ladder.runs`: what ``ladder.py run`` trains for a size (the stable phase, then each budget's branch),
  and its checks before anything is written.

* :mod:`olmo.ladder.run_planner`: what one run will do (parameters, batch, steps, FLOPs, memory, time), for the
  ladder and ``scripts/train.py --dry_run``.

``scripts/ladder.py`` (:mod:`olmo.cli.ladder`) is the command. May import every package below ``olmo.bench``
(the run planner sizes stages with ``olmo.train.stages``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import NAMED_SIZES, BatchRule, LadderConfig, LRRule, SizeSpec, load_ladder
    from .fit import PowerLawFit, fit_chinchilla, fit_loss_vs_compute, fit_power_law
    from .plan import Rung, plan_ladder, write_rung_config

# Loaded on first use: ``scripts/plan.py`` answers its usage and config errors without importing torch.
_LAZY = {
    "config": ("NAMED_SIZES", "BatchRule", "LadderConfig", "LRRule", "SizeSpec", "load_ladder"),
    "fit": ("PowerLawFit", "fit_power_law", "fit_loss_vs_compute", "fit_chinchilla"),
    "plan": ("Rung", "plan_ladder", "write_rung_config"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [
    "NAMED_SIZES",
    "BatchRule",
    "LRRule",
    "LadderConfig",
    "SizeSpec",
    "load_ladder",
    "PowerLawFit",
    "fit_power_law",
    "fit_loss_vs_compute",
    "fit_chinchilla",
    "Rung",
    "plan_ladder",
    "write_rung_config",
]


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
