"""Spike skipping and rollback (``stability.skip_spikes``, ``stability.rollback``; docs/stability.md).

:class:`SpikeDetector` decides on the device, from the step's global loss and gradient norm, whether the optimizer
update is applied (a factor of 1) or skipped (0): a value more than ``z_threshold`` standard deviations above the
mean of the last ``window`` accepted steps, or a non-finite one, is skipped. Every rank computes the same factor
from the same global values, so no rank has to tell another, and the host never waits for the decision.

:class:`StabilityMonitor` reads the decisions back with the step's other metrics (``optim/skipped_steps``, a
cumulative count), logs each skipped step with its instances, and decides a rollback when ``skipped_steps`` of the
last ``within_steps`` steps were skipped (or a loss was non-finite): the trainer then reloads the newest checkpoint
from before the first of them, deletes the checkpoints written since, records the batches from that first step to
the last one trained in ``save_folder/skipped_batches.json``, and trains on, never reading them again.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..config.stability_sections import RollbackConfig, SkipSpikesConfig, StabilityConfig
from ..exceptions import OLMoDataError, OLMoTrainingError
from ..util import write_result_file
from .callback import Callback, ErrorContext, MetricsContext, RewindContext, StepContext
from .metrics import NonFiniteError

__all__ = [
    "SpikeDetector",
    "SkipRange",
    "StabilityMonitor",
    "SKIPPED_BATCHES_FILE",
    "read_skip_ranges",
    "StabilityCallback",
    "locate_batch",
]

log = logging.getLogger(__name__)

SKIPPED_BATCHES_FILE = "skipped_batches.json"
MIN_WINDOW = 8
"""No step is skipped as an outlier before the window holds this many accepted steps."""


class SpikeDetector:
    """The rolling window of accepted steps' (loss, gradient norm), on the device, and the skip decision.

    :param cfg: ``stability.skip_spikes``.
    :param device: where the window lives (the loss's device).
    """

    def __init__(self, cfg: SkipSpikesConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.values = torch.zeros(2, cfg.window, device=device)  # rows: loss, grad norm
        self.count = torch.zeros((), dtype=torch.long, device=device)  # accepted values held (<= window)
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # the slot the next accepted step goes to
        self.skipped = torch.zeros((), device=device)  # steps skipped so far in the run
        self._slots = torch.arange(cfg.window, device=device)

    def step_factor(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The factor of this step's update (1.0 or 0.0, a device tensor) and the z-scores of (loss, grad norm);
        the window takes the values of an accepted step only."""
        x = torch.stack(
            [loss.detach().float().reshape(()), grad_norm.detach().float().reshape(()).to(self.device)]
        )
        finite = torch.isfinite(x).all()
        valid = (self._slots < self.count).float()  # (window,)
        n = self.count.clamp(min=1).float()
        mean = (self.values * valid).sum(dim=1) / n
        var = ((self.values - mean[:, None]) ** 2 * valid).sum(dim=1) / (n - 1).clamp(min=1)
        floor = 1e-3 * mean.abs() + 1e-8  # a window of equal values still has a scale
        z = (x - mean) / torch.maximum(var.sqrt(), floor)
        outlier = (z > self.cfg.z_threshold).any() & (self.count >= MIN_WINDOW)
        if step <= self.cfg.warmup_steps:  # a host int: no sync
            outlier = torch.zeros_like(outlier)
        skip = outlier | ~finite
        accept = ~skip
        slot = self.pos.reshape(1)
        kept = torch.where(accept, x, self.values.index_select(1, slot).reshape(2))
        self.values.index_copy_(1, slot, kept.reshape(2, 1))
        self.pos.add_(accept.long()).remainder_(self.cfg.window)
        self.count.add_(accept.long()).clamp_(max=self.cfg.window)
        self.skipped.add_(skip.float())
        return accept.float(), z

    def state_dict(self) -> dict[str, Any]:
        """Plain values for the trainer state (read on the host: checkpoints sync anyway)."""
        return {
            "values": self.values.tolist(),
            "count": int(self.count.item()),
            "pos": int(self.pos.item()),
            "skipped": int(self.skipped.item()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = torch.tensor(state["values"], dtype=torch.float32)
        if values.shape != self.values.shape:  # a different window: keep the latest values that fit
            n = min(int(state["count"]), self.cfg.window, values.shape[1])
            order = [(int(state["pos"]) - n + i) % values.shape[1] for i in range(n)]
            self.values.zero_()
            self.values[:, :n] = values[:, order].to(self.device)
            self.count.fill_(n)
            self.pos.fill_(n % self.cfg.window)
        else:
            self.values.copy_(values.to(self.device))
            self.count.fill_(int(state["count"]))
            self.pos.fill_(int(state["pos"]))
        self.skipped.fill_(float(state["skipped"]))


@dataclass(frozen=True)
class SkipRange:
    """Instances ``[start, end)`` of an epoch's order (a whole number of global batches) that are never trained,
    in the data order of ``order_dir`` (``train_data``, or ``train_data/stage{i}`` for a stage's own data)."""

    order_dir: str
    epoch: int
    start: int
    end: int
    first_step: int
    """The steps that trained on them before the rollback: ``first_step`` to ``last_step``."""
    last_step: int
    rolled_back_to: int
    """The step of the checkpoint the run went back to."""
    reason: str

    def as_json(self, batch_size: int) -> dict[str, Any]:
        return {
            **asdict(self),
            "first_batch": self.start // batch_size,
            "last_batch": self.end // batch_size - 1,
        }


def read_skip_ranges(save_folder: str | os.PathLike[str]) -> list[SkipRange]:
    """The ranges ``save_folder/skipped_batches.json`` records (none without the file).

    :raises OLMoDataError: naming the file and the fix, when it is not what the trainer writes (a launch checks it
        before writing anything, since the batches trained after a rollback depend on it).
    """
    path = Path(save_folder) / SKIPPED_BATCHES_FILE
    if not path.is_file():
        return []
    fields = set(SkipRange.__dataclass_fields__)
    try:
        ranges = [
            SkipRange(**{k: v for k, v in r.items() if k in fields})
            for r in json.loads(path.read_text())["ranges"]
        ]
        problem = next((p for p in map(_skip_range_problem, ranges) if p is not None), None)
    except OSError as e:
        problem = f"it cannot be read: {e.strerror or e}"
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = f"it is not JSON: {e}"
    except (KeyError, TypeError, AttributeError) as e:  # JSON of another shape
        problem = f"it is JSON of another shape: {type(e).__name__} {e}"
    if problem is None:
        return ranges
    raise OLMoDataError(
        f"'{path}' is damaged: {problem}. The trainer writes it after a rollback as "
        '{"ranges": [{"order_dir", "epoch", "start", "end", "first_step", "last_step", "rolled_back_to", '
        '"reason"}, ...]}, the batches it took out of the data order, and the steps after them depend on it. '
        "Restore it from a backup or the run's copy elsewhere; if no rollback ever skipped batches in this run, "
        "delete it."
    )


def _skip_range_problem(r: SkipRange) -> Optional[str]:
    """What is wrong with a range read from ``skipped_batches.json``, or None."""
    for name in ("epoch", "start", "end", "first_step", "last_step", "rolled_back_to"):
        value = getattr(r, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"a range has {name}={value!r}, not a count"
    if not isinstance(r.order_dir, str):
        return f"a range has order_dir={r.order_dir!r}, not a folder name"
    if r.start > r.end:
        return f"a range starts at {r.start} after its end {r.end}"
    return None


class StabilityMonitor:
    """The host side of ``stability``: what the logged steps say (skipped steps, non-finite losses), when a rollback
    is due, and the ranges of batches that rollbacks took out of the data.

    :param stability: the run's ``stability`` section.
    :param save_folder: where ``skipped_batches.json`` is; ``batch_size``: ``global_train_batch_size``.
    :param rank: only rank 0 writes ``skipped_batches.json``.
    """

    def __init__(self, stability: StabilityConfig, save_folder: str, batch_size: int, rank: int):
        self.skip_cfg: SkipSpikesConfig = stability.skip_spikes
        self.rollback_cfg: RollbackConfig = stability.rollback
        self.save_folder, self.rank = Path(save_folder), rank
        self.batch_size = batch_size
        self.rollbacks = 0
        self.ranges: list[SkipRange] = read_skip_ranges(save_folder)
        self.positions: deque[tuple[int, str, int, int]] = deque(maxlen=4096)
        """(step, order_dir, epoch, position before the step) of the latest steps."""
        self.skipped_steps: deque[int] = deque()
        self._last_skipped_total: Optional[float] = None
        self.due: Optional[tuple[int, str]] = None
        """(first step of the offending stretch, why) once a rollback is due."""

    @property
    def enabled(self) -> bool:
        return self.skip_cfg.enabled or self.rollback_cfg.enabled

    def before_step(self, step: int, order_dir: str, epoch: int, position: int) -> None:
        self.positions.append((step, order_dir, epoch, position))

    def position_of(self, step: int) -> Optional[tuple[str, int, int]]:
        for s, order_dir, epoch, position in self.positions:
            if s == step:
                return order_dir, epoch, position
        return None

    def on_logged(self, step: int, values: dict[str, float], instances: Optional[list[int]]) -> None:
        """Look at one step's read-back metrics: log a skipped step, and note when a rollback is due."""
        total = values.get("optim/skipped_steps")
        if total is not None:
            previous = self._last_skipped_total
            self._last_skipped_total = total
            if previous is not None and total > previous:
                self._on_skipped(step, values, instances)
        if self.rollback_cfg.enabled and self.due is None and values.get("stability/non_finite", 0.0) > 0:
            self.due = (step, f"a non-finite loss or gradient norm at step {step}")

    def _on_skipped(self, step: int, values: dict[str, float], instances: Optional[list[int]]) -> None:
        shown = "" if instances is None else f"; its instances: {_ids(instances)}"
        log.warning(
            "Step %d: the optimizer update was skipped (loss %.4g, z-score %.2f; grad norm %.4g, z-score %.2f; "
            "threshold %.3g)%s.",
            step,
            values.get("train/CrossEntropyLoss", float("nan")),
            values.get("stability/loss_zscore", float("nan")),
            values.get("optim/total_grad_norm", float("nan")),
            values.get("stability/grad_norm_zscore", float("nan")),
            self.skip_cfg.z_threshold,
            shown,
        )
        rb = self.rollback_cfg
        self.skipped_steps.append(step)
        while self.skipped_steps and self.skipped_steps[0] <= step - rb.within_steps:
            self.skipped_steps.popleft()
        if rb.enabled and self.due is None and len(self.skipped_steps) >= rb.skipped_steps:
            self.due = (
                self.skipped_steps[0],
                f"{len(self.skipped_steps)} steps skipped within {rb.within_steps} steps "
                f"({', '.join(map(str, self.skipped_steps))})",
            )

    def record_rollback(
        self, last_step: int, order_dir: str, epoch: int, end: int, restored_step: int
    ) -> SkipRange:
        """Note the rollback that is due (its batches, from its first step to ``last_step``, end at ``end`` of
        ``epoch``) and write ``skipped_batches.json``; return the new range."""
        assert self.due is not None
        first_step, reason = self.due
        found = self.position_of(first_step)
        start = (
            found[2]
            if found is not None and found[:2] == (order_dir, epoch)
            else end - self.batch_size * (last_step - first_step + 1)
        )
        start = max(0, start)
        new = SkipRange(order_dir, epoch, start, end, first_step, last_step, restored_step, reason)
        self.ranges.append(new)
        self.rollbacks += 1
        self.due, self.skipped_steps = None, deque()
        self._last_skipped_total = None
        if self.rank == 0:
            ranges = {"ranges": [r.as_json(self.batch_size) for r in self.ranges]}
            write_result_file(self.save_folder / SKIPPED_BATCHES_FILE, json.dumps(ranges, indent=1))
        return new

    def skip_target(self, order_dir: str, epoch: int, position: int) -> Optional[int]:
        """Where the data jumps to when ``position`` starts a skipped range (the end of the ranges that follow on
        from it), else None."""
        target = position
        moved = True
        while moved:
            moved = False
            for r in self.ranges:
                if (r.order_dir, r.epoch) == (order_dir, epoch) and r.start <= target < r.end:
                    target, moved = r.end, True
        return target if target != position else None

    def state_dict(self, detector: Optional[SpikeDetector] = None) -> dict[str, Any]:
        """What a checkpoint's trainer state holds of stability: the rollbacks, the skipped ranges and the spike
        ``detector``'s window (None without one)."""
        return {
            "rollbacks": self.rollbacks,
            "ranges": [asdict(r) for r in self.ranges],
            "detector": None if detector is None else detector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], detector: Optional[SpikeDetector] = None) -> None:
        self.rollbacks = max(self.rollbacks, int(state.get("rollbacks", 0)))
        for r in state.get("ranges", []):
            candidate = SkipRange(**r)
            if candidate not in self.ranges:
                self.ranges.append(candidate)
        if detector is not None and state.get("detector") is not None:
            detector.load_state_dict(state["detector"])


def _ids(instances: list[int], shown: int = 8) -> str:
    head = ", ".join(map(str, instances[:shown]))
    return head + (f", ... ({len(instances)} in all)" if len(instances) > shown else "")


class StabilityCallback(Callback):
    """Spike skipping and rollback as a loop callback: it counts the rollbacks in each step's metrics, reads every
    logged step's skip decision (:meth:`StabilityMonitor.on_logged`), and asks the loop to rewind when a rollback is
    due (persistent spikes, or a non-finite loss with ``on_non_finite``); when the loop rewinds, it records the
    stretch's batches as skipped (``skipped_batches.json``), or stops the run after ``max_rollbacks``."""

    def __init__(self, monitor: StabilityMonitor, cfg: RollbackConfig):
        self.monitor, self.cfg = monitor, cfg

    def post_step(self, ctx: StepContext) -> None:
        if self.cfg.enabled:
            ctx.metrics["stability/rollbacks"] = self.monitor.rollbacks

    def post_metrics(self, ctx: MetricsContext) -> None:
        if self.monitor.enabled:
            self.monitor.on_logged(ctx.step, ctx.values, ctx.instances())
            if self.monitor.due is not None:
                ctx.loop.rewind(*self.monitor.due)

    def on_error(self, ctx: ErrorContext) -> None:
        error = ctx.error
        if isinstance(error, NonFiniteError) and self.cfg.enabled and self.cfg.on_non_finite:
            self.monitor.due = (error.step, f"a non-finite loss or gradient norm at step {error.step}")
            ctx.loop.rewind(*self.monitor.due)

    def on_rewind(self, ctx: RewindContext) -> None:
        """Record the offending stretch's batches as skipped (the rewind this callback asked for).

        :raises OLMoTrainingError: when ``max_rollbacks`` rollbacks were made already; the message sums them up.
        """
        monitor = self.monitor
        if monitor.due is None:
            return  # another callback's rewind
        reason = monitor.due[1]
        history = "; ".join(f"steps {r.first_step}-{r.last_step} ({r.reason})" for r in monitor.ranges) or "none"
        if monitor.rollbacks >= self.cfg.max_rollbacks:
            raise OLMoTrainingError(
                f"Step {ctx.from_step}: {reason}, and the run has rolled back {monitor.rollbacks} time(s) already "
                f"(stability.rollback.max_rollbacks={self.cfg.max_rollbacks}); stopping. Earlier rollbacks: "
                f"{history}. Look at the data of those steps (inspect_batch.py RUN --step N) and at the learning rate; "
                f"resume with --try_load_latest_save once fixed, or raise max_rollbacks."
            )
        new = monitor.record_rollback(ctx.from_step, ctx.order_dir, ctx.epoch, ctx.position, ctx.to_step)
        ctx.loop.log_event(
            ctx.from_step,
            f"Rolling back to step {ctx.to_step} ({reason}); instances {new.start}-{new.end - 1} of epoch {new.epoch} "
            f"(steps {new.first_step}-{new.last_step}) are skipped from now on; rollback {monitor.rollbacks} of at most "
            f"{self.cfg.max_rollbacks}.",
        )


def locate_batch(step: int, batches_per_epoch: int, ranges: list[SkipRange], batch_size: int) -> tuple[int, int]:
    """The (epoch, batch of the epoch) that the ``step``-th step of a data segment (counted from 1) trained on, when
    the ``ranges`` of that segment's order were skipped (as the trainer jumps over them). Epochs after the last one
    with a skipped range are counted arithmetically, so a far step is answered at once."""
    epoch, left = 0, step
    clean = max((r.epoch for r in ranges), default=-1) + 1  # every batch of this epoch and later ones is trained
    while True:
        if epoch >= clean and batches_per_epoch > 0:
            whole = (left - 1) // batches_per_epoch
            return epoch + whole, left - whole * batches_per_epoch - 1
        spans = sorted(
            (r.start // batch_size, min(-(-r.end // batch_size), batches_per_epoch))
            for r in ranges
            if r.epoch == epoch
        )
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            elif a < b:
                merged.append((a, b))
        available = batches_per_epoch - sum(b - a for a, b in merged)
        if left > available:
            left, epoch = left - available, epoch + 1
            continue
        batch = 0
        for a, b in merged:
            if left <= a - batch:
                break
            left -= a - batch
            batch = b
        return epoch, batch + left - 1
