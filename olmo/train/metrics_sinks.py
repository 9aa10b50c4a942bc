"""Where logged metrics go: :class:`ConsoleSink` (log lines and a progress bar), :class:`JsonlSink`
(``metrics.jsonl``) and :class:`WandbSink` (offline unless configured), fanned out by :class:`MetricsLogger`.
Only rank 0 writes anything.

A sink has ``log(step, metrics, eval_keys)`` (``eval_keys``: the metrics of an evaluation, shown in full) and
``close(summary, exit_code)``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO

from ..config import WandbConfig
from ..util.progress import estimate_left, format_duration
from ..util.secrets import redact_text
from .callback import Callback, EndContext, MetricsContext, StepContext

__all__ = ["MetricsLogger", "MetricsCallback", "ConsoleSink", "JsonlSink", "SinkOptions", "WandbSink"]

log = logging.getLogger(__name__)


def _format(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.2f}"
    return f"{value:.4f}"


class ConsoleSink:
    """Training metrics as a log line every ``interval`` steps, evaluations in full; a progress bar when
    stderr is a terminal; the run summary at the end."""

    KEYS = (
        ("train/CrossEntropyLoss", "loss"),
        ("train/Perplexity", "ppl"),
        ("train/ZLoss", "z_loss"),
        ("train/KL", "kl"),
        ("train/dpo/loss", "dpo_loss"),
        ("train/dpo/reward_accuracy", "dpo_acc"),
        ("train/rl/reward_mean", "reward"),
        ("train/rl/completion_length", "completion_len"),
        ("train/stage", "stage"),
        ("optim/total_grad_norm", "grad_norm"),
        ("optim/learning_rate_group0", "lr"),
        ("throughput/device/tokens_per_second", "tok/s"),
        ("throughput/mfu", "mfu"),
    )

    def __init__(
        self,
        interval: int,
        max_steps: int,
        progress_bar: Optional[bool] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.interval, self.max_steps = max(1, interval), max_steps
        self.clock, self.start = clock, clock()
        self.first: Optional[tuple[int, float]] = None  # (step, time) of this launch's first logged step
        self.progress: Any = None
        if progress_bar if progress_bar is not None else sys.stderr.isatty():
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

    def log(self, step: int, metrics: dict[str, float], eval_keys: Optional[list[str]]) -> None:
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        loss = metrics.get("train/CrossEntropyLoss")
        if self.progress is not None and loss is not None:
            self.progress.update(self.task, completed=step, status=f"loss {loss:.4f}")
        if eval_keys is not None:
            log.info("[step=%d] %s", step, " ".join(f"{k}={_format(metrics[k])}" for k in eval_keys))
        elif step % self.interval == 0:
            parts = [f"{short}={_format(metrics[key])}" for key, short in self.KEYS if key in metrics]
            parts.append(f"elapsed={format_duration(now - self.start)}")
            # The rate since this launch's first step (its compile and warm-up excluded), evaluations included.
            left = estimate_left(step - self.first[0], self.max_steps - self.first[0], now - self.first[1])
            if left is not None:
                parts.append(f"eta={format_duration(left)}")
            log.info("[step=%d/%d] %s", step, self.max_steps, " ".join(parts))

    def close(self, summary: dict[str, Any], exit_code: int) -> None:
        if self.progress is not None:
            self.progress.stop()
        lines = [f"{k}: {v}" for k, v in summary.items()]
        log.info("Run summary:\n  %s", "\n  ".join(lines))


class JsonlSink:
    """One JSON line per logged step, ``{"step", "time", **metrics}``, appended to ``path`` and flushed."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: TextIO = open(path, "a")

    def log(self, step: int, metrics: dict[str, float], eval_keys: Optional[list[str]]) -> None:
        self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.file.flush()

    def log_records(self, step: int, records: dict[str, Any]) -> None:
        """Non-numeric results (e.g. generated samples) as their own line, which metrics readers skip."""
        self.file.write(json.dumps({"step": step, "time": time.time(), **records}) + "\n")
        self.file.flush()

    def close(self, summary: dict[str, Any], exit_code: int) -> None:
        self.file.close()


@dataclass(frozen=True)
class SinkOptions:
    """What the metrics sinks read from the config: where they write, how often the console shows a training step,
    and the wandb run, if any."""

    save_folder: str
    console_log_interval: int = 1
    wandb: Optional[WandbConfig] = None
    run_name: Optional[str] = None
    """``run_name``: the wandb run's name unless ``wandb.name`` gives one."""
    written: Callable[[], dict[str, Any]] = dict
    """The run's config as written (:meth:`olmo.config.TrainConfig.as_written`), recorded with the wandb run; called
    once, when the run opens."""


class WandbSink:
    """A wandb run in ``save_folder/wandb`` (mode: ``wandb.mode``, else ``$WANDB_MODE``, else offline): training
    metrics every ``wandb.log_interval`` steps, evaluations always, the summary's numbers at the end."""

    def __init__(self, cfg: SinkOptions):
        assert cfg.wandb is not None
        self.interval = cfg.wandb.log_interval
        mode: Any = cfg.wandb.mode or os.environ.get("WANDB_MODE") or "offline"
        (Path(cfg.save_folder) / "wandb").mkdir(parents=True, exist_ok=True)
        # wandb records the command line with the run: with its secrets masked (a --load_path URL's password).
        argv, sys.argv = sys.argv, [redact_text(arg) for arg in sys.argv]
        try:
            self.run = self._init(cfg, mode)
        finally:
            sys.argv = argv

    @staticmethod
    def _init(cfg: SinkOptions, mode: Any) -> Any:
        import wandb

        assert cfg.wandb is not None
        return wandb.init(
            dir=str(Path(cfg.save_folder)),
            mode=mode,
            project=cfg.wandb.project or "olmo-trainer",
            entity=cfg.wandb.entity if mode == "online" else None,
            group=cfg.wandb.group,
            name=cfg.wandb.name or cfg.run_name,
            tags=cfg.wandb.tags,
            config={k: v for k, v in cfg.written().items() if k != "wandb"},  # no secret: see as_written
        )

    def log(self, step: int, metrics: dict[str, float], eval_keys: Optional[list[str]]) -> None:
        if eval_keys is not None or step % self.interval == 0:
            self.run.log(metrics, step=step)

    def log_records(self, step: int, records: dict[str, Any]) -> None:
        """Lists of samples as tables (one row per sample, its fields as columns, the step first)."""
        import wandb

        tables = {}
        for key, rows in records.items():
            if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
                columns = ["step", *rows[0]]
                tables[key] = wandb.Table(
                    columns=columns, data=[[step, *(r.get(c) for c in columns[1:])] for r in rows]
                )
        if tables:
            self.run.log(tables, step=step)

    def close(self, summary: dict[str, Any], exit_code: int) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        self.run.finish(exit_code=exit_code)


class MetricsLogger:
    """The run's sinks: :class:`JsonlSink` (``save_folder/metrics.jsonl``), :class:`ConsoleSink`
    (``console_log_interval``) and, with a ``wandb`` section, :class:`WandbSink`; rank 0 only. It also keeps the
    first and the last training loss for the run summary."""

    def __init__(self, cfg: SinkOptions, rank: int, max_steps: int):
        self.enabled = rank == 0
        self.first_loss: Optional[float] = None
        self.last: dict[str, float] = {}
        self.sinks: list[Any] = []
        if self.enabled:
            self.sinks.append(JsonlSink(Path(cfg.save_folder) / "metrics.jsonl"))
            if cfg.wandb is not None:
                self.sinks.append(WandbSink(cfg))
            self.sinks.append(ConsoleSink(cfg.console_log_interval, max_steps))

    def log(self, step: int, metrics: dict[str, float], console_keys: Optional[list[str]] = None) -> None:
        """Record one step's metrics. Training metrics reach the console every ``console_log_interval`` steps and
        wandb every ``wandb.log_interval``; metrics logged with ``console_keys`` (evaluations) always do, in full."""
        if not self.enabled:
            return
        loss = metrics.get("train/CrossEntropyLoss")
        if loss is not None:
            self.last = metrics
            self.first_loss = loss if self.first_loss is None else self.first_loss
        for sink in self.sinks:
            sink.log(step, metrics, console_keys)

    def log_event(self, step: int, message: str) -> None:
        if self.enabled:
            log.info("[step=%d] %s", step, message)

    def log_records(self, step: int, records: dict[str, Any]) -> None:
        """Record results that are not numbers (generated samples): a line of ``metrics.jsonl``, a wandb table,
        and each sample on the console."""
        if not self.enabled:
            return
        for key, rows in records.items():
            for row in rows if isinstance(rows, list) else []:
                if isinstance(row, dict) and "prompt" in row:
                    log.info("[step=%d] %s: %r -> %r", step, key, row["prompt"], row.get("completion"))
        for sink in self.sinks:
            if hasattr(sink, "log_records"):
                sink.log_records(step, records)

    def close(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        """Print the run summary and close the sinks."""
        for sink in reversed(self.sinks):  # the console first: the progress bar stops before the summary
            sink.close(summary, exit_code)


class MetricsCallback(Callback):
    """Metrics logging as a loop callback: the :class:`MetricsLogger` opens with the run (before the step-0
    checkpoint), the read-back steps are flushed every ``collect_steps`` steps and at the end, each logged step
    goes to the sinks, and the run summary closes the log.

    :param summary: the run summary from the logger's first and last loss (the trainer's ``_summary``).
    """

    def __init__(
        self,
        cfg: SinkOptions,
        rank: int,
        stop_at: int,
        summary: Callable[[MetricsLogger], dict[str, Any]],
        collect_steps: int,
    ):
        self.logger = MetricsLogger(cfg, rank, stop_at)
        self.summary, self.collect_steps = summary, collect_steps
        self.exit_code = 0

    def post_step(self, ctx: StepContext) -> None:
        if ctx.step % self.collect_steps == 0:
            ctx.loop.flush_metrics()

    def post_metrics(self, ctx: MetricsContext) -> None:
        self.logger.log(ctx.step, ctx.values)

    def post_train(self, ctx: EndContext) -> None:
        if ctx.how != "interrupted":  # then other ranks may be inside a collective: only what was read back
            ctx.loop.flush_metrics()

    def close(self) -> None:
        self.logger.close(self.summary(self.logger), self.exit_code)
