"""Training metrics: throughput and MFU, memory, and the sinks (console, metrics.jsonl, wandb)."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .config import TrainConfig
from .distributed import all_reduce
from .exceptions import OLMoTrainingError
from .util import machine_info

__all__ = [
    "SpeedMonitor",
    "MetricsLogger",
    "StepMetrics",
    "StepMetricsQueue",
    "PeakFlops",
    "device_peak_flops",
    "gpu_peak_flops",
    "cpu_peak_flops",
    "model_flops_utilization",
    "peak_memory_mb",
]

log = logging.getLogger(__name__)

# Dense bf16 peaks in FLOP/s. H200 has the same tensor cores as H100 SXM; matching "H100" alone
# would miss it, and falling back to an A100 figure would overstate MFU ~3x.
_GPU_PEAKS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
)
# A CPU peak measured while other work held more than a quarter of its threads' time is provisional.
_MIN_CPU_SHARE = 0.75


@dataclass(frozen=True)
class PeakFlops:
    """One device's peak FLOP/s, where the figure came from, and how to correct it should an MFU above 1
    prove it wrong.

    :param cache_file: the per-machine cache the figure was read from or written to (measured CPU peaks only).
    :param cache_key: its entry in that file.
    """

    flops: float
    source: str
    fix: str
    cache_file: Optional[Path] = None
    cache_key: Optional[str] = None


def device_peak_flops(device: torch.device, override: Optional[float] = None) -> Optional[PeakFlops]:
    """Peak FLOP/s of one device: ``override`` (``speed_monitor.gpu_flops_available``) when set, else a known
    GPU's dense bf16 figure, or this CPU's fp32 matmul rate (see :func:`cpu_peak_flops`). None when unknown."""
    if override:
        return PeakFlops(
            float(override), "speed_monitor.gpu_flops_available", "Set it to one device's real peak FLOP/s."
        )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return PeakFlops(
                peak,
                f"the dense bf16 peak of {name}",
                "The model's FLOP count or this peak is wrong for this setup; set "
                "speed_monitor.gpu_flops_available to the device's real peak.",
            )
        log.warning("Unknown GPU %r: MFU is not reported (set speed_monitor.gpu_flops_available).", name)
        return None
    if device.type == "cpu":
        return cpu_peak_flops()
    return None


def gpu_peak_flops(name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s for a GPU's ``torch.cuda.get_device_name``, or None if unknown."""
    for key, flops in _GPU_PEAKS:
        if key in name:
            return flops
    return None


def model_flops_utilization(
    achieved_flops: float, peak: Optional[PeakFlops], warn: bool = True
) -> Optional[float]:
    """``achieved_flops / peak.flops``, or None when the peak is unknown or the ratio is above 1: an MFU above 1
    is never true (the peak or the FLOP count is wrong), so none is reported.

    :param warn: for a ratio above 1, warn (naming the peak's source and the fix) and drop a cached CPU peak;
        a caller that already did so this run passes False.
    """
    if peak is None:
        return None
    mfu = achieved_flops / peak.flops
    if mfu <= 1:
        return mfu
    if warn:
        if peak.cache_file is not None and peak.cache_key is not None:
            # The cached measurement is proven too low (taken while other work shared the cores): drop it, so
            # that the next run measures again rather than repeat this warning forever.
            cache = _read_peak_cache(peak.cache_file)
            if cache.pop(peak.cache_key, None) is not None:
                _write_peak_cache(peak.cache_file, cache)
        log.warning(
            "MFU would be %.2f: %.4g FLOP/s achieved against a peak of %.4g FLOP/s from %s. An MFU above 1 is never "
            "true, so none is reported. %s",
            mfu,
            achieved_flops,
            peak.flops,
            peak.source,
            peak.fix,
        )
    return None


def cpu_peak_flops() -> PeakFlops:
    """This CPU's fp32 matmul rate at the current thread count, measured and cached per machine.

    The cache is a JSON file, ``$XDG_CACHE_HOME/olmo-trainer/cpu_peak_flops.json`` (``~/.cache/...`` without
    XDG_CACHE_HOME), keyed by CPU model, core count, thread count and torch version, and replaced atomically.
    Each entry keeps the best rate measured and the share of the cores that measurement got: below
    :data:`_MIN_CPU_SHARE` (other work was running) the entry is provisional and is measured again, keeping the
    best, by a later run that finds the machine idle. An entry that an MFU above 1 proves too low is dropped
    (see :func:`model_flops_utilization`).
    """
    path, key = _peak_cache_path(), _cpu_key()
    cache = _read_peak_cache(path)
    entry, cached = cache.get(key), None
    if isinstance(entry, dict) and all(
        isinstance(entry.get(k), (int, float)) for k in ("peak_flops", "cpu_share")
    ):
        cached = (float(entry["peak_flops"]), float(entry["cpu_share"]))
    if cached is not None and (cached[1] >= _MIN_CPU_SHARE or not _machine_idle()):
        flops = cached[0]
    else:
        measured = _measure_cpu_matmul_flops()
        log.info(
            "Measured this CPU's peak: %.4g FLOP/s, with %.0f%% of its threads' time (%s).",
            measured[0],
            100 * measured[1],
            key,
        )
        flops, share = max(measured, cached or measured)
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        cache[key] = {"peak_flops": flops, "cpu_share": share, "measured": now}
        _write_peak_cache(path, cache)
    where = f", cached in {path}" if path is not None else ""
    return PeakFlops(
        flops,
        f"the fp32 matmul rate measured on this CPU{where}",
        "The cached figure is dropped, so the next run measures again (best on an idle machine); or pin "
        "speed_monitor.gpu_flops_available.",
        path,
        key,
    )


def _machine_idle() -> bool:
    """Whether the last minute's load average leaves most cores free (a good time to measure)."""
    return os.getloadavg()[0] < 0.25 * (os.cpu_count() or 1)


def _peak_cache_path() -> Optional[Path]:
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):  # the XDG spec ignores a relative (or empty) value
        try:
            root = str(Path.home() / ".cache")
        except RuntimeError:  # no home directory to be found
            return None
    return Path(root) / "olmo-trainer" / "cpu_peak_flops.json"


def _cpu_key() -> str:
    info = machine_info()
    model = info["cpu_model"] or info["processor"]
    return f"{model} | {info['cpu_count']} CPUs | {torch.get_num_threads()} threads | torch {info['torch']}"


def _read_peak_cache(path: Optional[Path]) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.info("Ignoring the unreadable CPU peak cache %s (%s); measuring again.", path, e)
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_peak_cache(path: Optional[Path], cache: dict[str, Any]) -> None:
    """Write ``cache`` to ``path`` through a temporary file and a rename, so that a reader (another rank on this
    machine, say) never sees half a file."""
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.info("Could not cache the CPU peak in %s (%s); later runs will measure it again.", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _measure_cpu_matmul_flops(
    sizes: tuple[int, ...] = (1024, 2048), rounds: int = 4, seconds: float = 0.05
) -> tuple[float, float]:
    """The best rate over ``rounds`` short runs of each matmul size, interleaved, and the share of its threads'
    time that the best run got from the OS (1 when nothing else wanted the cores). Other work only ever lowers a
    run, so the best run is the closest to what the cores can do; larger matmuls run nearer the peak on many
    CPUs, hence more than one size."""
    # A private generator: drawing from the global RNG here would change the run's dropout draws.
    gen = torch.Generator().manual_seed(0)
    operands = [(torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)) for n in sizes]
    for a, b in operands:
        torch.mm(a, b)  # warm up the thread pool and the kernels
    return max(_matmul_rate(a, b, seconds) for _ in range(rounds) for a, b in operands)


def _matmul_rate(a: torch.Tensor, b: torch.Tensor, seconds: float) -> tuple[float, float]:
    """FLOP/s of ``a @ b`` (square matrices) repeated for about ``seconds`` (at least once), and the CPU time
    this process got over the wall time times its thread count."""
    n, calls = a.shape[0], 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while calls == 0 or time.perf_counter() - start < seconds:
        torch.mm(a, b)
        calls += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return 2 * n**3 * calls / wall, min(1.0, cpu / (wall * torch.get_num_threads()))


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: GPU allocations on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
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

    def step(self, device_tokens: int) -> dict[str, float]:
        """Record that a step that processed ``device_tokens`` on this device just finished."""
        self.window.append((time.perf_counter(), device_tokens))
        if len(self.window) < 2:
            return {}
        elapsed = self.window[-1][0] - self.window[0][0]
        tokens = sum(t for _, t in list(self.window)[1:])
        tps = tokens / max(elapsed, 1e-9)
        out = {"throughput/device/tokens_per_second": tps}
        # A window whose MFU would exceed 1 reports none; the warning comes once a run.
        mfu = model_flops_utilization(tps * self.flops_per_token, self.peak_flops, warn=not self.warned)
        if mfu is not None:
            out["throughput/mfu"] = mfu
        elif self.peak_flops is not None:
            self.warned = True
        return out


@dataclass
class StepMetrics:
    """One optimizer step's metrics. The loss and gradient norm stay on the device (``device``) until
    :meth:`StepMetricsQueue.collect` reads every pending step back in one transfer and fills ``values``."""

    step: int
    values: dict[str, float]
    device: Optional[dict[str, torch.Tensor]]
    """This rank's ``ce_sum`` and ``z_sum``, the global ``n_labels`` and ``grad_norm``; None once read."""


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
    ) -> StepMetrics:
        """Queue a step: this rank's loss sums, the global label count and gradient norm, still on the device."""
        device = {"ce_sum": ce_sum, "z_sum": z_sum, "n_labels": n_labels, "grad_norm": grad_norm}
        record = StepMetrics(step, {"optim/learning_rate_group0": learning_rate}, device)
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
        losses = all_reduce(local) / n_labels[:, None]  # (S, 2)
        table = torch.cat([losses, all_reduce(bad_rank, dist.ReduceOp.MAX)[:, None], norms[:, None]], dim=1)
        for record, (ce, z, bad, norm) in zip(pending, table.tolist()):  # the host sync
            if bad > 0 or not math.isfinite(norm):
                raise OLMoTrainingError(
                    self._non_finite_message(record.step, current_step, ce, norm, int(bad) - 1)
                )
            record.device = None
            record.values.update({"train/CrossEntropyLoss": ce, "train/Perplexity": math.exp(min(ce, 50.0))})
            record.values["optim/total_grad_norm"] = norm
            if self.z_loss:
                record.values["train/ZLoss"] = z

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


def _format(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.2f}"
    return f"{value:.4f}"


class MetricsLogger:
    """Writes metrics to ``metrics.jsonl`` every step, the console every ``console_log_interval``
    steps, and wandb (offline unless configured). Only rank 0 writes anything.
    """

    CONSOLE_KEYS = (
        ("train/CrossEntropyLoss", "loss"),
        ("train/Perplexity", "ppl"),
        ("train/ZLoss", "z_loss"),
        ("optim/total_grad_norm", "grad_norm"),
        ("optim/learning_rate_group0", "lr"),
        ("throughput/device/tokens_per_second", "tok/s"),
        ("throughput/mfu", "mfu"),
    )

    def __init__(self, cfg: TrainConfig, rank: int, max_steps: int):
        self.enabled = rank == 0
        self.console_interval = max(1, cfg.console_log_interval)
        self.max_steps = max_steps
        self.wandb_run: Any = None
        self.wandb_interval = cfg.wandb.log_interval if cfg.wandb else 1
        self.first_loss: Optional[float] = None
        self.last: dict[str, float] = {}
        self.progress: Any = None
        if not self.enabled:
            return
        Path(cfg.save_folder).mkdir(parents=True, exist_ok=True)
        self.jsonl = open(Path(cfg.save_folder) / "metrics.jsonl", "a")
        if cfg.wandb is not None:
            self.wandb_run = _init_wandb(cfg)
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                transient=True,
            )
            self.task = self.progress.add_task("train", total=max_steps, status="")
            self.progress.start()

    def log(self, step: int, metrics: dict[str, float], console_keys: Optional[list[str]] = None) -> None:
        """Record one step's metrics. Training metrics reach the console every ``console_log_interval``
        steps; metrics logged with ``console_keys`` (evaluations) always do, in full."""
        if not self.enabled:
            return
        loss = metrics.get("train/CrossEntropyLoss")
        if loss is not None:
            self.last = metrics
            self.first_loss = loss if self.first_loss is None else self.first_loss
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None and (console_keys is not None or step % self.wandb_interval == 0):
            self.wandb_run.log(metrics, step=step)
        if self.progress is not None and loss is not None:
            self.progress.update(self.task, completed=step, status=f"loss {loss:.4f}")
        if console_keys is not None:
            log.info("[step=%d] %s", step, " ".join(f"{k}={_format(metrics[k])}" for k in console_keys))
        elif step % self.console_interval == 0:
            parts = [f"{short}={_format(metrics[key])}" for key, short in self.CONSOLE_KEYS if key in metrics]
            log.info("[step=%d/%d] %s", step, self.max_steps, " ".join(parts))

    def log_event(self, step: int, message: str) -> None:
        if self.enabled:
            log.info("[step=%d] %s", step, message)

    def close(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        """Stop the progress bar, print the run summary, and close the sinks."""
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.stop()
        lines = [f"{k}: {v}" for k, v in summary.items()]
        log.info("Run summary:\n  %s", "\n  ".join(lines))
        self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
            self.wandb_run.finish(exit_code=exit_code)


def _init_wandb(cfg: TrainConfig) -> Any:
    import wandb

    assert cfg.wandb is not None
    mode: Any = cfg.wandb.mode or os.environ.get("WANDB_MODE") or "offline"
    (Path(cfg.save_folder) / "wandb").mkdir(parents=True, exist_ok=True)
    return wandb.init(
        dir=str(Path(cfg.save_folder)),
        mode=mode,
        project=cfg.wandb.project or "olmo-trainer",
        entity=cfg.wandb.entity if mode == "online" else None,
        group=cfg.wandb.group,
        name=cfg.wandb.name or cfg.run_name,
        tags=cfg.wandb.tags,
        config=cfg.asdict(exclude=["wandb"]),
    )
