"""Training metrics: throughput and MFU (peak FLOP/s in :mod:`olmo.model.flops`), memory, the queue of steps whose
metrics are still on the device, and how metrics are reduced over ranks (:class:`ReduceType`). The sinks (console,
metrics.jsonl, wandb) are in :mod:`olmo.train.metrics_sinks`."""

from __future__ import annotations

import logging
import math
import resource
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, TypeVar, Union

import torch
import torch.distributed as dist

from ..data import FetchStats
from ..distributed import all_reduce
from ..exceptions import OLMoTrainingError
from ..model.flops import PeakFlops, cpu_peak_flops, device_peak_flops, gpu_peak_flops, model_flops_utilization
from .callback import Callback, StepContext
from .metrics_sinks import MetricsLogger

T = TypeVar("T")

__all__ = [
    "SpeedMonitor",
    "ThroughputMonitor",
    "ThroughputCallback",
    "fetch_metrics",
    "MetricsLogger",
    "StepMetrics",
    "StepMetricsQueue",
    "ReduceType",
    "NonFiniteError",
    "PeakFlops",
    "device_peak_flops",
    "gpu_peak_flops",
    "cpu_peak_flops",
    "model_flops_utilization",
    "peak_memory_mb",
]

log = logging.getLogger(__name__)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: GPU allocations on CUDA, resident set size on CPU.

    On Linux the resident peak is ``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` also counts the parent's
    resident set at the moment it started this process (the kernel carries it over through exec), so a run
    launched from a large process (a notebook, a test runner) would report that process's size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class SpeedMonitor:
    """Tokens/s per device and MFU over a sliding window of steps.

    :param window_size: steps in the window.
    :param flops_per_token: training FLOPs per token (see :meth:`olmo.model.OLMo.num_flops_per_token`).
    :param peak_flops: one device's peak FLOP/s (:func:`device_peak_flops`), or None to skip MFU.
    """

    def __init__(self, window_size: int, flops_per_token: int, peak_flops: Optional[PeakFlops]):
        self.window: deque[tuple[float, int]] = deque(maxlen=max(2, window_size + 1))
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.warned = False

    def reset(self) -> None:
        """Forget the window (after a checkpoint or eval, whose time is not training time)."""
        self.window.clear()

    def step(self, device_tokens: int, settled: bool = True) -> dict[str, float]:
        """Record that a step that processed ``device_tokens`` on this device just finished.

        :param settled: the device had finished the step's work when the clock was read (always on a CPU; on a GPU
            only at a step whose metrics were read back). The host runs ahead of a GPU by the steps it has queued, so
            an unsettled window can look faster than the device is; its MFU above 1 is dropped without a warning
            (the first steps of every GPU run looked 3-6 times faster than the H200's peak). A settled window's
            time covers at least its own steps' work, so an MFU above 1 there proves the peak or the FLOPs wrong.
        """
        self.window.append((time.perf_counter(), device_tokens))
        if len(self.window) < 2:
            return {}
        elapsed = self.window[-1][0] - self.window[0][0]
        tokens = sum(t for _, t in list(self.window)[1:])
        tps = tokens / max(elapsed, 1e-9)
        out = {"throughput/device/tokens_per_second": tps}
        # A window whose MFU would exceed 1 reports none; the warning comes once a run, from a settled window.
        warn = settled and not self.warned
        mfu = model_flops_utilization(tps * self.flops_per_token, self.peak_flops, warn=warn)
        if mfu is not None:
            out["throughput/mfu"] = mfu
        elif self.peak_flops is not None and warn:
            self.warned = True
        return out


class ThroughputMonitor:
    """The throughput metrics of every training step, as the loop logs them: tokens/s and MFU over a window of steps
    (:class:`SpeedMonitor`), the seconds the step waited for its batch, what reading remote training data cost this
    launch, the tokens seen, and the peak memory.

    :param speed: the window of step times.
    :param device_tokens: tokens one step processes on this device, or what gives the step's count after it ran
        (an RL step's: the tokens it trained on).
    :param device: where the peak memory is measured.
    """

    def __init__(self, speed: SpeedMonitor, device_tokens: Union[int, Callable[[], int]], device: torch.device):
        self.speed, self.device_tokens, self.device = speed, device_tokens, device
        self.data_wait = 0.0

    def next_batch(self, batches: Iterator[T]) -> T:
        """The next batch, timing how long the step waits for it."""
        start = time.perf_counter()
        batch = next(batches)
        self.data_wait = time.perf_counter() - start
        return batch

    def reset(self) -> None:
        """Forget the window of step times (after a checkpoint, an evaluation or a new stage)."""
        self.speed.reset()

    def step_metrics(
        self, tokens_seen: int, fetch_stats: Optional[FetchStats], read_back: bool = True
    ) -> dict[str, float]:
        """The metrics of the step that just finished (call once per step); ``read_back``: its metrics were read
        back from the device, so a GPU had finished its work (see :meth:`SpeedMonitor.step`)."""
        tokens = self.device_tokens() if callable(self.device_tokens) else self.device_tokens
        metrics = self.speed.step(tokens, settled=read_back or self.device.type != "cuda")
        metrics["throughput/data_wait_seconds"] = self.data_wait
        metrics.update(fetch_metrics(fetch_stats))
        metrics["throughput/total_tokens"] = tokens_seen
        metrics["System/Peak Memory (MB)"] = peak_memory_mb(self.device)
        return metrics


def fetch_metrics(stats: Optional[FetchStats]) -> dict[str, float]:
    """What reading remote training data has cost this launch (nothing for local files)."""
    if stats is None:
        return {}
    counts = stats.snapshot()
    return {
        "throughput/data_bytes_fetched": counts["bytes"],
        "throughput/data_requests": counts["requests"] + counts["metadata_requests"],
        "throughput/data_retries": counts["retries"],
    }


class NonFiniteError(OLMoTrainingError):
    """A non-finite loss or gradient norm reached the weights at ``step`` (``stability.rollback`` can recover)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class ReduceType(str, Enum):
    """How a metric recorded on every rank becomes one number (see :meth:`olmo.train.train_module.TrainModule.record_metric`)."""

    mean = "mean"
    """The average over ranks."""
    sum = "sum"
    """The sum over ranks."""
    max = "max"
    """The largest value on any rank."""
    ratio = "ratio"
    """A (numerator, denominator) pair, each summed over ranks, logged as their quotient (not at all when the
    denominator is 0): a token-weighted mean such as a source's loss."""


@dataclass
class StepMetrics:
    """One optimizer step's metrics. The loss and gradient norm stay on the device (``device``) until
    :meth:`StepMetricsQueue.collect` reads every pending step back in one transfer and fills ``values``."""

    step: int
    values: dict[str, float]
    device: Optional[dict[str, torch.Tensor]]
    """This rank's ``ce_sum`` and ``z_sum``, the global ``n_labels`` and ``grad_norm``; None once read."""
    extra: dict[str, tuple[torch.Tensor, ReduceType]] = field(default_factory=dict)
    """Further metrics a train module recorded on this rank, and how to reduce them over ranks; empty once read."""


class StepMetricsQueue:
    """Training steps whose metrics are not logged yet, oldest first.

    Reading a GPU value on the host waits for every kernel queued before it, so the loop reads the steps'
    losses and gradient norms back together every ``interval`` steps (``metrics_collect_interval``): one
    all-reduce and one host sync for all of them. With ``interval`` 1 the trainer collects before the
    optimizer step, so a non-finite loss never reaches the weights.

    :param interval: the resolved ``metrics_collect_interval``, for error messages.
    :param rank: this process's rank, to name the rank whose loss was not finite.
    :param z_loss: whether to report ``train/ZLoss``.
    """

    def __init__(self, interval: int, rank: int, z_loss: bool):
        self.interval, self.rank, self.z_loss = interval, rank, z_loss
        self.records: list[StepMetrics] = []

    def add(
        self,
        step: int,
        learning_rate: float,
        ce_sum: torch.Tensor,
        z_sum: torch.Tensor,
        n_labels: torch.Tensor,
        grad_norm: torch.Tensor,
        extra: Optional[dict[str, tuple[torch.Tensor, ReduceType]]] = None,
        applied: Optional[torch.Tensor] = None,
    ) -> StepMetrics:
        """Queue a step: this rank's loss sums, the global label count and gradient norm, still on the device,
        and ``extra`` scalar metrics (name: value on this rank, how to reduce it). ``applied`` (0.0 or 1.0, the
        same on every rank): whether the optimizer applied the step's update; a skipped step's non-finite loss
        is logged, not raised."""
        device = {"ce_sum": ce_sum, "z_sum": z_sum, "n_labels": n_labels, "grad_norm": grad_norm}
        if applied is not None:
            device["applied"] = applied
        record = StepMetrics(step, {"optim/learning_rate_group0": learning_rate}, device, dict(extra or {}))
        self.records.append(record)
        return record

    def collect(self, current_step: int) -> None:
        """Read every pending step back and fill its ``values``; raise :class:`OLMoTrainingError` at the first
        non-finite loss (on any rank) or gradient norm, leaving that step and later ones unread."""
        pending = [r for r in self.records if r.device is not None]
        queued = [r.device for r in pending if r.device is not None]
        if not queued:
            return
        local = torch.stack([torch.stack([d["ce_sum"], d["z_sum"]]) for d in queued])  # (S, 2)
        bad_rank = torch.stack([torch.where(torch.isfinite(d["ce_sum"]), 0.0, self.rank + 1.0) for d in queued])
        n_labels = torch.stack([d["n_labels"] for d in queued]).clamp(min=1.0)  # (S,)
        norms = torch.stack([d["grad_norm"].to(local.device) for d in queued])  # (S,)
        applied = torch.stack([d.get("applied", torch.ones(())).to(local.device).float() for d in queued])
        losses = all_reduce(local) / n_labels[:, None]  # (S, 2)
        table = torch.cat(
            [losses, all_reduce(bad_rank, dist.ReduceOp.MAX)[:, None], norms[:, None], applied[:, None]], dim=1
        )
        for record, (ce, z, bad, norm, was_applied) in zip(pending, table.tolist()):  # the host sync
            if (bad > 0 or not math.isfinite(norm)) and was_applied > 0:
                raise NonFiniteError(
                    self._non_finite_message(record.step, current_step, ce, norm, int(bad) - 1), record.step
                )
            record.device = None
            record.values.update({"train/CrossEntropyLoss": ce, "train/Perplexity": math.exp(min(ce, 50.0))})
            record.values["optim/total_grad_norm"] = norm
            if self.z_loss:
                record.values["train/ZLoss"] = z
        self._collect_extra(pending)

    @staticmethod
    def _collect_extra(records: list[StepMetrics]) -> None:
        """Reduce the records' extra metrics over ranks, one all-reduce per reduce type, and read them back."""
        for reduce_type in ReduceType:
            entries = [(r, n, v) for r in records for n, (v, t) in r.extra.items() if t == reduce_type]
            if not entries:
                continue
            device = entries[0][2].device
            if reduce_type == ReduceType.ratio:
                pairs = all_reduce(torch.stack([v.detach().double().reshape(2).to(device) for _, _, v in entries]))
                for (record, name, _), (num, den) in zip(entries, pairs.tolist()):
                    if den > 0:
                        record.values[name] = num / den
                continue
            local = torch.stack([v.detach().float().reshape(()).to(device) for _, _, v in entries])
            reduced = all_reduce(local, dist.ReduceOp.MAX if reduce_type == ReduceType.max else dist.ReduceOp.SUM)
            if reduce_type == ReduceType.mean and dist.is_initialized():
                reduced = reduced / dist.get_world_size()
            for (record, name, _), value in zip(entries, reduced.tolist()):
                record.values[name] = value
        for record in records:
            record.extra = {}

    def pop_ready(self) -> list[StepMetrics]:
        """Remove and return the oldest steps whose values have been read back."""
        ready = 0
        while ready < len(self.records) and self.records[ready].device is None:
            ready += 1
        out, self.records = self.records[:ready], self.records[ready:]
        return out

    def _non_finite_message(self, step: int, current_step: int, loss: float, norm: float, bad_rank: int) -> str:
        what = f"loss at step {step} on rank {bad_rank}" if bad_rank >= 0 else f"gradient norm at step {step}"
        if self.interval == 1:
            consequence = "The optimizer step was skipped and no checkpoint was written."
        else:
            consequence = (
                f"It was found {current_step - step} step(s) later (metrics_collect_interval={self.interval}); "
                f"no checkpoint or evaluation has seen the damaged weights."
            )
        return (
            f"Non-finite {what} (loss={loss}, grad norm={norm}). {consequence} Resume from the last "
            f"checkpoint with a lower optimizer.learning_rate, max_grad_norm set, or --fast_forward_batches "
            f"to skip the offending data."
        )


class ThroughputCallback(Callback):
    """Throughput and MFU as a loop callback: every step's ``throughput/...`` metrics (:class:`ThroughputMonitor`);
    the window restarts when the time before a step was not training.

    :param fetch_stats: what reading the current training data costs (None for local files).
    :param collect_steps: metrics are read back from the device every this many steps.
    """

    def __init__(
        self, monitor: ThroughputMonitor, fetch_stats: Callable[[], Optional[FetchStats]], collect_steps: int = 1
    ):
        self.monitor, self.fetch_stats, self.collect_steps = monitor, fetch_stats, collect_steps

    def post_step(self, ctx: StepContext) -> None:
        if ctx.clock_restarted:
            self.monitor.reset()
        self.monitor.data_wait = ctx.data_wait
        read_back = ctx.step % self.collect_steps == 0
        ctx.metrics.update(self.monitor.step_metrics(ctx.tokens_seen, self.fetch_stats(), read_back))
