"""A step's mixture-of-experts bookkeeping (``model.moe``): the share of the step each micro-batch's auxiliary losses
get in the backward pass, and the metrics of the routers.

Metrics, per step (no host synchronization: they join the step's other metrics, read back at the collect interval):

- ``train/load_balancing_loss`` and ``train/router_z_loss``: the unweighted auxiliary losses, averaged over the
  layers, over the step's micro-batches (weighted by their rows) and over the ranks; the training loss itself adds
  them with ``model.moe.lb_loss_weight`` and ``model.moe.z_loss_weight``. ``train/CrossEntropyLoss`` stays the cross
  entropy alone.
- ``moe/layer{i}/max_load``: the busiest expert's assignments over a perfectly even share (1 = balanced,
  ``num_experts`` = every token to one expert), counted over each rank's tokens of the step, the largest over ranks.
- ``moe/layer{i}/load_cv``: the coefficient of variation (standard deviation over mean) of the assignments per
  expert over each rank's tokens of the step (0 = balanced), averaged over ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import nn

from ..model.moe import MoEFeedForward
from .metrics import ReduceType

__all__ = ["ExpertLoadMeter"]


class ExpertLoadMeter:
    """The mixture-of-experts layers of ``model`` and their step's measurements; with no such layer (a dense
    model) every method returns at once."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        self._sums: Optional[list[torch.Tensor]] = None  # lb, z, then each layer's counts

    def start_micro_batch(self, share: float) -> None:
        """Give the next backward's auxiliary losses ``share`` of the step (the micro-batch's rows over the rank's)."""
        for layer in self.layers:
            layer.aux_scale = share

    def end_micro_batch(self, share: float) -> None:
        """Add the micro-batch's router measurements, its losses weighted by ``share``."""
        if not self.layers:
            return
        stats = [layer.take_stats() for layer in self.layers]
        if any(s is None for s in stats):
            return  # a forward without gradients (a dry run's or a custom module's)
        lb = torch.stack([s.lb_loss for s in stats if s is not None]).mean() * share
        z = torch.stack([s.z_loss for s in stats if s is not None]).mean() * share
        counts = [s.counts for s in stats if s is not None]
        if self._sums is None:
            self._sums = [lb, z, *counts]
        else:
            self._sums = [a + b for a, b in zip(self._sums, [lb, z, *counts])]

    def record(self, record_metric: Callable[[str, torch.Tensor, ReduceType], None]) -> None:
        """Record the step's metrics (see the module docstring) and start the next step."""
        sums, self._sums = self._sums, None
        if sums is None:
            return
        lb, z, *counts = sums
        record_metric("train/load_balancing_loss", lb, ReduceType.mean)
        record_metric("train/router_z_loss", z, ReduceType.mean)
        for i, count in enumerate(counts):
            mean = count.mean().clamp(min=1e-9)
            record_metric(f"moe/layer{i}/max_load", count.max() / mean, ReduceType.max)
            record_metric(f"moe/layer{i}/load_cv", count.std(correction=0) / mean, ReduceType.mean)
