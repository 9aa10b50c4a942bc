"""Checks on the optimizer and the learning-rate schedules (the run's and every stage's own): values, and settings
that only one optimizer or schedule uses. Part of :func:`olmo.config.validation.validate_train_config`."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Optional

from ..exceptions import OLMoConfigurationError
from .sections import OptimizerConfig, OptimizerType, SchedulerConfig, SchedulerType, SchedulerUnits
from .stages import DEFAULT_MAX_DURATION, parse_duration_steps

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = ["WSD_NEEDS_T_DECAY", "optim_problems", "schedule_problems", "warmup_warnings"]


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
MAX_MUON_NS_STEPS = 100


def schedule_problems(s: SchedulerConfig, where: str, length: Optional[float]) -> list[str]:
    """What is inconsistent in the schedule at ``where`` (``scheduler``, ``stages[1].scheduler``).

    :param length: the schedule's span in its units (steps or tokens) when known before the data is opened.
    """
    out: list[str] = []
    if not 0.0 <= s.alpha_f <= 1.0:
        out.append(
            f"{where}.alpha_f={s.alpha_f} must be in [0, 1]: the final learning rate as a fraction of the peak "
            f"(below 0 the rate turns negative, above 1 the decay rises). Set e.g. --{where}.alpha_f=0.1."
        )
    if s.t_warmup < 0:
        out.append(f"{where}.t_warmup={s.t_warmup} must be >= 0.")
    if s.name != SchedulerType.wsd:
        for key, default in _WSD_ONLY.items():
            if getattr(s, key) != default:
                out.append(
                    f"{where}.{key}={getattr(s, key)} is used by {where}.name=wsd only, and the name is {s.name}. "
                    f"Remove {key}, or set {where}.name=wsd."
                )
        return out
    if s.t_decay is None:
        return [*out, WSD_NEEDS_T_DECAY.replace("scheduler.", f"{where}.")]
    if s.t_decay < 0:
        return [*out, f"{where}.t_decay={s.t_decay} must be >= 0 (0: no decay)."]
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
    if not 1 <= o.muon_ns_steps <= MAX_MUON_NS_STEPS:
        out.append(
            f"optimizer.muon_ns_steps={o.muon_ns_steps} must be from 1 to {MAX_MUON_NS_STEPS} (5 is usual: each "
            f"iteration is three matrix products per weight matrix per step, and the orthogonalization has "
            f"converged long before {MAX_MUON_NS_STEPS})."
        )
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
    if not all(0.0 <= b < 1.0 for b in o.betas):
        out.append(f"optimizer.betas={list(o.betas)} must each be in [0, 1).")
    out += _muon_problems(cfg)
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


def warmup_warnings(cfg: TrainConfig) -> list[str]:
    """A line for each schedule whose warmup lasts as long as what it schedules (the run, or a stage with its own
    schedule), which then trains at a fraction of ``optimizer.learning_rate`` throughout: what an official config
    shortened with ``--max_duration`` does with its 2,000-step warmup. Lengths in epochs need the data and are
    not checked."""
    s, out = cfg.scheduler, list[str]()
    if cfg.stages:
        lengths = [_schedule_length(cfg, stage.max_duration, s) for stage in cfg.stages]
        run = None if None in lengths else sum(n for n in lengths if n is not None)
        out += _warmup_warning(cfg, s, "scheduler", run, "the run", "the stages' max_duration")
    else:
        duration = DEFAULT_MAX_DURATION if cfg.max_duration is None else cfg.max_duration
        run = _schedule_length(cfg, duration, s)
        out += _warmup_warning(cfg, s, "scheduler", run, "the run", f"max_duration={duration!r}", "--max_duration")
    for i, stage in enumerate(cfg.stages or []):
        if stage.scheduler is not None:
            length = _schedule_length(cfg, stage.max_duration, stage.scheduler)
            span = f"stages[{i}].max_duration={stage.max_duration!r}"
            out += _warmup_warning(cfg, stage.scheduler, f"stages[{i}].scheduler", length, f"stages[{i}]", span)
    return out


def _warmup_warning(
    cfg: TrainConfig,
    s: SchedulerConfig,
    where: str,
    length: Optional[float],
    what: str,
    span: str,
    longer: str = "",
) -> list[str]:
    """The warning for the schedule ``s`` at ``where`` when its warmup fills ``what``, which lasts ``length`` (in
    the schedule's units) as ``span`` says; ``longer`` is the option that lengthens it, if one does."""
    if length is None or s.name == SchedulerType.constant or s.t_warmup < length:
        return []  # a constant schedule has no warmup
    lr = cfg.optimizer.learning_rate
    start = (s.warmup_min_lr if s.warmup_min_lr is not None else 0.1 * lr) / lr
    end = start + (1 - start) * length / s.t_warmup
    fix = f"--{where}.t_warmup={max(1, int(length) // 10)} (a tenth of it)" + (
        f" or a longer {longer}" if longer else ""
    )
    return [
        f"{where}.t_warmup={s.t_warmup:,.0f} {s.units} is not shorter than {what} ({span}: {length:,.0f} {s.units}), "
        f"so all of it is warmup: the learning rate climbs from {start:.1%} to {end:.1%} of "
        f"optimizer.learning_rate={lr:g} and never decays. Set {fix}."
    ]
