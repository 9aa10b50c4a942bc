"""Training metrics: throughput and MFU, memory, and the sinks (console, metrics.jsonl, wandb)."""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

import torch

from .config import TrainConfig

__all__ = ["SpeedMonitor", "MetricsLogger", "device_peak_flops", "gpu_peak_flops", "peak_memory_mb"]

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
_cpu_peak_cache: dict[str, float] = {}


def device_peak_flops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of one device: a known GPU's dense bf16 figure, or a measured CPU fp32 matmul rate."""
    if override:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return peak
        log.warning("Unknown GPU %r: MFU is not reported (set speed_monitor.gpu_flops_available).", name)
        return None
    if device.type == "cpu":
        if "cpu" not in _cpu_peak_cache:
            _cpu_peak_cache["cpu"] = _measure_cpu_matmul_flops()
        return _cpu_peak_cache["cpu"]
    return None


def gpu_peak_flops(name: str) -> Optional[float]:
    """Dense bf16 peak FLOP/s for a GPU's ``torch.cuda.get_device_name``, or None if unknown."""
    for key, flops in _GPU_PEAKS:
        if key in name:
            return flops
    return None


def _measure_cpu_matmul_flops(n: int = 1024, seconds: float = 0.1, windows: int = 3) -> float:
    """Best of a few short windows, so a moment of contention from other processes does not lower the
    peak (and inflate MFU)."""
    return max(_cpu_matmul_window(n, seconds) for _ in range(windows))


def _cpu_matmul_window(n: int, seconds: float) -> float:
    # A private generator: drawing from the global RNG here would change the run's dropout draws.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    torch.mm(a, b)  # warm up
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        calls += 1
    return 2 * n**3 * calls / (time.perf_counter() - start)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: GPU allocations on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class SpeedMonitor:
    """Tokens/s per device and MFU over a sliding window of steps.

    :param window_size: steps in the window.
    :param flops_per_token: training FLOPs per token (see :meth:`olmo.model.OLMo.num_flops_per_token`).
    :param peak_flops: one device's peak FLOP/s, or None to skip MFU.
    """

    def __init__(self, window_size: int, flops_per_token: int, peak_flops: Optional[float]):
        self.window: deque[tuple[float, int]] = deque(maxlen=max(2, window_size + 1))
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops

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
        if self.peak_flops:
            out["throughput/mfu"] = tps * self.flops_per_token / self.peak_flops
        return out


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
