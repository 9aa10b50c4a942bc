"""Checks on the optimizer and the learning-rate schedules (the run's and every stage's own): values, and settings
that only one optimizer or schedule uses. Part of :func:`olmo.config.validation.validate_train_config`."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Optional

from ..exceptions import OLMoConfigurationError
from .sections import OptimizerConfig, OptimizerType, SchedulerConfig, SchedulerType, SchedulerUnits
from .stages import parse_duration_steps

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = ["WSD_NEEDS_T_DECAY", "optim_problems", "schedule_problems"]


WSD_NEEDS_T_DECAY = (
    "scheduler.name=wsd needs scheduler.t_decay: the length of the final decay, in scheduler.units, which ends "
    "at the end of the run (or t_max). Set e.g. --scheduler.t_decay=1000 (0: no decay, a stable run to branch "
    "decays from)."
)


def _defaults(section: type, names: tuple[str, ...]) -> dict[str, Any]:
    """The dataclass defaults of ``names`` in ``section``: set to anything else, they were set on purpose."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    return {name: fields[name].default for name in names}


_WSD_ONLY = _defaults(SchedulerConfig, ("t_decay", "decay_shape"))
_MUON_ONLY = _defaults(OptimizerConfig, ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_rms_scale"))


def schedule_problems(s: SchedulerConfig, where: str, length: Optional[float]) -> list[str]:
    """What is inconsistent in the schedule at ``where`` (``scheduler``, ``stages[1].scheduler``).

    :param length: the schedule's span in its units (steps or tokens) when known before the data is opened.
    """
    out: list[str] = []
    if s.name != SchedulerType.wsd:
        for key, default in _WSD_ONLY.items():
            if getattr(s, key) != default:
                out.append(
                    f"{where}.{key}={getattr(s, key)} is used by {where}.name=wsd only, and the name is {s.name}. "
                    f"Remove {key}, or set {where}.name=wsd."
                )
        return out
    if s.t_decay is None:
        return [WSD_NEEDS_T_DECAY.replace("scheduler.", f"{where}.")]
    if s.t_decay < 0:
        return [f"{where}.t_decay={s.t_decay} must be >= 0 (0: no decay)."]
    end = s.t_max if s.t_max is not None else length
    if end is not None and s.t_decay > 0 and end - s.t_decay < s.t_warmup:
        span = f"{where}.t_max={s.t_max}" if s.t_max is not None else f"the run's length ({end:g} {s.units})"
        out.append(
            f"{where}.t_decay={s.t_decay} starts the decay at {end - s.t_decay:g} {s.units}, before the warmup ends "
            f"({where}.t_warmup={s.t_warmup}); {span}. Use a t_decay of at most {end - s.t_warmup:g}, or a "
            f"shorter warmup."
        )
    return out


def _schedule_length(cfg: TrainConfig, duration: Any, s: SchedulerConfig) -> Optional[float]:
    """``duration`` (steps or tokens; not epochs: they need the data) in the units of ``s``, else None."""
    if duration is None or str(duration).strip().endswith("ep"):
        return None
    try:
        steps = parse_duration_steps(duration, cfg.global_train_batch_size, cfg.tokens_per_batch, 0)
    except OLMoConfigurationError:
        return None  # reported by the duration's own check
    return steps * cfg.tokens_per_batch if s.units == SchedulerUnits.tokens else steps


def _muon_problems(cfg: TrainConfig) -> list[str]:
    o = cfg.optimizer
    if o.name != OptimizerType.muon:
        return [
            f"optimizer.{key}={getattr(o, key)} is used by optimizer.name=muon only, and the name is {o.name}. "
            f"Remove {key}, or set optimizer.name=muon."
            for key, default in _MUON_ONLY.items()
            if getattr(o, key) != default
        ]
    out = []
    if not 0.0 <= o.muon_momentum < 1.0:
        out.append(f"optimizer.muon_momentum={o.muon_momentum} must be in [0, 1).")
    if o.muon_ns_steps < 1:
        out.append(f"optimizer.muon_ns_steps={o.muon_ns_steps} must be at least 1 (5 is usual).")
    if not o.muon_rms_scale > 0:
        out.append(
            f"optimizer.muon_rms_scale={o.muon_rms_scale} must be positive (0.2 matches AdamW's update RMS)."
        )
    if o.selective_updates:
        out.append("optimizer.selective_updates=true is not supported with optimizer.name=muon; set it to false.")
    if cfg.stability.skip_spikes.enabled:
        out.append(
            "stability.skip_spikes needs optimizer.name adamw or lionw; muon has no skip-step version yet. Turn "
            "stability.skip_spikes.enabled off, or use adamw."
        )
    return out


def optim_problems(cfg: TrainConfig) -> list[str]:
    """The optimizer's and every schedule's problems (values, and settings that do not go together)."""
    o, s = cfg.optimizer, cfg.scheduler
    out: list[str] = []
    if not 0 < o.learning_rate < math.inf:
        out.append(f"optimizer.learning_rate={o.learning_rate} must be a positive, finite number.")
    for section, values in (("optimizer", o), ("scheduler", s)):
        for field in dataclasses.fields(values):
            value = getattr(values, field.name)
            if isinstance(value, float) and not math.isfinite(value) and field.name != "learning_rate":
                out.append(f"{section}.{field.name}={value} must be a finite number.")
    for name in ("max_grad_norm", "max_grad_norm_ratio"):
        value = getattr(cfg, name, None)
        if isinstance(value, float) and math.isnan(value):
            out.append(f"{name}={value} must be a number (or null to disable).")
    if not all(0.0 <= b < 1.0 for b in o.betas):
        out.append(f"optimizer.betas={list(o.betas)} must each be in [0, 1).")
    out += _muon_problems(cfg)
    if s.t_warmup < 0:
        out.append(f"scheduler.t_warmup={s.t_warmup} must be >= 0.")
    run_length = None if cfg.stages else _schedule_length(cfg, cfg.max_duration, s)
    out += schedule_problems(s, "scheduler", run_length)
    for i, stage in enumerate(cfg.stages or []):
        if stage.scheduler is not None:
            where = f"stages[{i}].scheduler"
            out += schedule_problems(
                stage.scheduler, where, _schedule_length(cfg, stage.max_duration, stage.scheduler)
            )
    if s.warmup_min_lr is not None and not 0 <= s.warmup_min_lr < o.learning_rate:
        out.append(
            f"scheduler.warmup_min_lr={s.warmup_min_lr} must be in [0, optimizer.learning_rate={o.learning_rate})."
        )
    if cfg.max_grad_norm is not None and cfg.max_grad_norm <= 0:
        out.append(f"max_grad_norm={cfg.max_grad_norm} must be positive (or null to disable clipping).")
    if cfg.max_grad_norm_ratio is not None and cfg.max_grad_norm_ratio <= 0:
        out.append(f"max_grad_norm_ratio={cfg.max_grad_norm_ratio} must be positive (or null).")
    return out
