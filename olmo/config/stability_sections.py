"""The ``stability:`` section: what keeps a long run alive without a person (docs/stability.md).

``skip_spikes`` skips the optimizer update of a step whose loss or gradient norm is an outlier; ``rollback`` reloads
the newest checkpoint from before a persistent spike (or a non-finite loss) and skips the batches that caused it;
``watchdog`` ends a rank stuck in one phase of a step, writing every thread's stack first; ``stragglers`` names a
rank that is slower than the others. Every detector is off by default: a run that does not turn one on trains
exactly as before (bitwise). Each section checks its own values (``problems``), and what it needs of the rest of
the run is passed in. :mod:`olmo.train.stability` and :mod:`olmo.train.watchdog` implement them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .bounds import MAX_TIMEOUT_SECONDS

__all__ = [
    "SkipSpikesConfig",
    "RollbackConfig",
    "WatchdogConfig",
    "StragglersConfig",
    "StabilityConfig",
    "WATCHDOG_PHASES",
]


@dataclass
class SkipSpikesConfig:
    """Skip the optimizer update of an outlier step (its parameters, moments and step count stay as they were)."""

    enabled: bool = False
    """Off by default, so that runs stay bitwise what they were; the skip-step optimizer replaces torch's AdamW
    (same update, computed on the device with the skip as a factor, so deciding costs no host sync)."""
    z_threshold: float = 6.0
    """A step is an outlier when its loss or its gradient norm is more than this many standard deviations above
    the mean of the window (OLMo-core uses 6)."""
    window: int = 128
    """How many of the latest accepted steps the mean and standard deviation are taken over."""
    warmup_steps: int = 64
    """Steps at the start of the run that are never skipped (the early loss falls too fast to have outliers);
    also, no step is skipped before the window holds at least 8 values."""

    def problems(self, optimizer_name: str) -> list[str]:
        """One sentence per value of ``stability.skip_spikes`` that cannot work, for a run with the optimizer
        ``optimizer_name`` (``optimizer.name``)."""
        out: list[str] = []
        if not (math.isfinite(self.z_threshold) and self.z_threshold > 0):
            out.append(f"stability.skip_spikes.z_threshold={self.z_threshold} must be a positive number (e.g. 6).")
        if not 8 <= self.window <= 100_000:
            out.append(f"stability.skip_spikes.window={self.window} must be from 8 to 100,000 steps.")
        if self.warmup_steps < 0:
            out.append(f"stability.skip_spikes.warmup_steps={self.warmup_steps} must be >= 0.")
        if self.enabled and optimizer_name not in ("adamw", "lionw"):
            out.append(
                f"stability.skip_spikes needs optimizer.name adamw or lionw (the skip-step versions exist for "
                f"those); it is {optimizer_name!r}."
            )
        return out


@dataclass
class RollbackConfig:
    """Reload the newest checkpoint from before a persistent spike, skip the batches that caused it, carry on."""

    enabled: bool = False
    """Off by default. Needs checkpoints (a ``save_interval`` of some kind) to go back to."""
    max_rollbacks: int = 3
    """Rollbacks allowed over the whole run (counted across restarts); one more stops the run with a summary."""
    skipped_steps: int = 3
    """A rollback starts when this many steps were skipped (``skip_spikes``) ..."""
    within_steps: int = 20
    """... within this many consecutive steps."""
    on_non_finite: bool = True
    """Also roll back at a non-finite loss or gradient norm that was not skipped (instead of stopping the run)."""

    def problems(self, skip_spikes: bool, has_checkpoints: bool) -> list[str]:
        """One sentence per value of ``stability.rollback`` that cannot work.

        :param skip_spikes: ``stability.skip_spikes.enabled``, which starts a rollback at a persistent spike.
        :param has_checkpoints: whether the run saves checkpoints (of any kind) to roll back to.
        """
        out: list[str] = []
        if self.max_rollbacks < 0 or self.max_rollbacks > 1000:
            out.append(f"stability.rollback.max_rollbacks={self.max_rollbacks} must be from 0 to 1000.")
        if self.skipped_steps < 1:
            out.append(f"stability.rollback.skipped_steps={self.skipped_steps} must be >= 1.")
        if self.within_steps < self.skipped_steps:
            out.append(
                f"stability.rollback.within_steps={self.within_steps} must be at least "
                f"skipped_steps={self.skipped_steps}."
            )
        if self.enabled and not (skip_spikes or self.on_non_finite):
            out.append(
                "stability.rollback.enabled is true but nothing can start one: turn on stability.skip_spikes.enabled "
                "(persistent spikes) or stability.rollback.on_non_finite (non-finite losses)."
            )
        if self.enabled and not has_checkpoints:
            out.append(
                "stability.rollback.enabled needs checkpoints to roll back to: set save_interval, "
                "save_interval_unsharded or save_interval_ephemeral."
            )
        return out


WATCHDOG_PHASES = ("data_wait", "forward_backward", "optimizer", "checkpoint", "evaluation", "upload_wait")
"""The phases of a step the watchdog times, each with a limit in seconds of the same name."""


@dataclass
class WatchdogConfig:
    """End a rank that is stuck in one phase longer than its limit: write all its threads' stacks to
    ``save_folder/hang-rank{R}.txt``, log the phase and step, and exit with ``EXIT_CODE_HANG`` (76). Every limit
    is above 0 and at most 86400 seconds (a day)."""

    enabled: bool = False
    """Off by default; a rank over a limit ends the job (``EXIT_CODE_HANG``) instead of waiting for the process
    group's timeout (``distributed_timeout_minutes``)."""
    data_wait: float = 1800.0
    """Seconds a step may wait for its batch (remote data included)."""
    forward_backward: float = 1800.0
    """Seconds for the forward and backward passes of a step (collectives included)."""
    optimizer: float = 600.0
    """Seconds for clipping and the optimizer step."""
    checkpoint: float = 3600.0
    """Seconds for writing (or committing) a checkpoint."""
    evaluation: float = 3600.0
    """Seconds for one round of in-loop evaluation."""
    upload_wait: float = 3600.0
    """Seconds the end of the run may wait for the remote uploads of its checkpoints."""

    def problems(self) -> list[str]:
        """One sentence per limit of ``stability.watchdog`` that is not a positive number of seconds up to a day."""
        out: list[str] = []
        for f in fields(self):
            if f.name == "enabled":
                continue
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and 0 < value <= MAX_TIMEOUT_SECONDS):
                out.append(
                    f"stability.watchdog.{f.name}={value} must be a positive number of seconds, at most "
                    f"{MAX_TIMEOUT_SECONDS:g} (a day: a phase that takes longer is hung); the default is "
                    f"{f.default:g}."
                )
        return out


@dataclass
class StragglersConfig:
    """Name a rank that is slower than the others: every ``interval`` steps each rank's time in the step outside
    the collectives' waits is gathered, and ``throughput/slowest_rank`` and ``throughput/rank_skew`` logged."""

    enabled: bool = False
    """Off by default."""
    interval: int = 10
    """Steps between gatherings (one small all-gather each)."""
    threshold: float = 1.5
    """A rank whose time in the step's local work is more than this times the median of the other ranks' is
    slow ... (healthy ranks differ by under 1.1x on most gatherings; on a busy CPU machine single gatherings reach
    2-3x, which ``sustained`` absorbs)."""
    sustained: int = 3
    """... and is named in a warning once it has been slow at this many gatherings in a row."""

    def problems(self) -> list[str]:
        """One sentence per value of ``stability.stragglers`` that cannot work."""
        out: list[str] = []
        if self.interval < 1:
            out.append(f"stability.stragglers.interval={self.interval} must be >= 1.")
        if not (math.isfinite(self.threshold) and self.threshold > 1):
            out.append(f"stability.stragglers.threshold={self.threshold} must be a number above 1 (e.g. 1.5).")
        if self.sustained < 1:
            out.append(f"stability.stragglers.sustained={self.sustained} must be >= 1.")
        return out


@dataclass
class StabilityConfig:
    skip_spikes: SkipSpikesConfig = field(default_factory=SkipSpikesConfig)
    """Skip the optimizer update of an outlier step."""
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    """Go back to a checkpoint from before a persistent spike or a non-finite loss, and skip its batches."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """End a rank stuck in one phase of a step, writing its threads' stacks first."""
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    """Name a rank that is slower than the others."""

    def problems(self, optimizer_name: str, has_checkpoints: bool) -> list[str]:
        """What is wrong with ``stability`` before any work: values out of range, and combinations that cannot work.

        :param optimizer_name: ``optimizer.name``: only adamw and lionw can skip a step.
        :param has_checkpoints: whether the run saves checkpoints (of any kind) to roll back to.
        """
        return (
            self.skip_spikes.problems(optimizer_name)
            + self.rollback.problems(self.skip_spikes.enabled, has_checkpoints)
            + self.watchdog.problems()
            + self.stragglers.problems()
        )
