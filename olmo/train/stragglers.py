"""Straggler detection (``stability.stragglers``): which rank is slower than the others, and by how much.

In a synchronous step every rank takes as long as the slowest, so wall time cannot tell them apart. What can is
the time each rank spends in the parts of the step that wait for no other rank: waiting for its own batch and the
optimizer step (after the gradients are reduced; FSDP2's sharded update is local). A slow GPU, a throttled CPU or a
slow disk makes exactly those longer on one rank. They are timed every step (CUDA events on a GPU, so no sync),
summed, and every ``interval`` steps gathered from all ranks in one small all-gather:
``throughput/slowest_rank`` and ``throughput/rank_skew`` (the slowest rank's time over the median of the other ranks') are logged,
and a rank whose skew is over ``threshold`` at ``sustained`` gatherings in a row is named, with its host, in a
warning (again each time it stays slow for that long).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import statistics
import time
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist

from ..config.stability_sections import StragglersConfig
from .callback import Callback, StepContext

__all__ = ["StragglerMonitor", "StragglerCallback"]

log = logging.getLogger(__name__)


class StragglerMonitor:
    """Times the local parts of each step and names a slow rank; a no-op unless enabled with several ranks.

    :param device: the training device (CUDA events there, the host clock elsewhere).
    """

    def __init__(self, cfg: StragglersConfig, rank: int, world_size: int, device: torch.device):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.enabled = cfg.enabled and world_size > 1 and dist.is_initialized()
        self.host_seconds = 0.0  # data waits and host-timed parts since the last gathering
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._hosts: Optional[list[str]] = None
        self._slow_streak: dict[int, int] = {}

    def data_wait(self, seconds: float) -> None:
        if self.enabled:
            self.host_seconds += seconds

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """Time a part of the step that waits for no other rank."""
        if not self.enabled:
            yield
            return
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.host_seconds += time.perf_counter() - began

    def maybe_gather(self, step: int) -> dict[str, float]:
        """Every ``interval`` steps: gather every rank's local time, return the metrics and warn about a rank that
        has been slow for ``sustained`` gatherings. Every rank calls this at every step."""
        if not self.enabled or step % self.cfg.interval != 0:
            return {}
        if self._hosts is None:
            hosts: list[Optional[str]] = [None] * self.world_size
            dist.all_gather_object(hosts, socket.gethostname())
            self._hosts = [str(h) for h in hosts]
        seconds = self.host_seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1000  # events: done by now
        self.host_seconds, self._events = 0.0, []
        mine = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        times = [float(t.item()) for t in gathered]
        slowest = max(range(self.world_size), key=lambda r: times[r])
        ratios = [
            times[r] / max(statistics.median(times[:r] + times[r + 1 :]), 1e-12) for r in range(self.world_size)
        ]
        skew = ratios[slowest]
        for r in range(self.world_size):
            slow = ratios[r] > self.cfg.threshold
            self._slow_streak[r] = self._slow_streak.get(r, 0) + 1 if slow else 0
            if slow and self._slow_streak[r] % self.cfg.sustained == 0 and self.rank == 0:
                log.warning(
                    "Straggler: rank %d (host %s) has been slow at %d gatherings in a row (steps up to %d): %.2fx the "
                    "median of the other ranks' time in the step's local work (%.3f s over the last %d steps).",
                    r,
                    self._hosts[r],
                    self._slow_streak[r],
                    step,
                    ratios[r],
                    times[r],
                    self.cfg.interval,
                )
        return {"throughput/slowest_rank": float(slowest), "throughput/rank_skew": skew}


class StragglerCallback(Callback):
    """Straggler detection as a loop callback: each step's data wait counts as local work; every ``interval`` steps
    the ranks' times are gathered into the step's metrics (the optimizer step is timed by the train module, through
    :meth:`StragglerMonitor.local`)."""

    def __init__(self, monitor: StragglerMonitor):
        self.monitor = monitor

    def post_step(self, ctx: StepContext) -> None:
        self.monitor.data_wait(ctx.data_wait)
        ctx.metrics.update(self.monitor.maybe_gather(ctx.step))
