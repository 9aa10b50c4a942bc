"""The ``optimizer:`` and ``scheduler:`` sections (a stage's own ``scheduler`` too), each with the checks of its
values: ranges, and settings that only one optimizer or schedule uses.

Field names and defaults follow the original OLMo's; every field has a docstring (``train.py CONFIG --help`` prints
them). Import them from :mod:`olmo.config`, which re-exports them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from .base import BaseConfig
from .sections import DecayShape, OptimizerType, SchedulerType, SchedulerUnits

__all__ = [
    "OptimizerConfig",
    "SchedulerConfig",
    "WSD_NEEDS_T_DECAY",
    "MAX_MUON_NS_STEPS",
    "schedule_problems",
]


WSD_NEEDS_T_DECAY = (
    "scheduler.name=wsd needs scheduler.t_decay: the length of the final decay, in scheduler.units, which ends "
    "at the end of the run (or t_max). Set e.g. --scheduler.t_decay=1000 (0: no decay, a stable run to branch "
    "decays from)."
)
MAX_MUON_NS_STEPS = 100


@dataclass
class OptimizerConfig(BaseConfig):
    name: OptimizerType = OptimizerType.lionw
    """``adamw``, ``lionw`` (OLMo's default) or ``muon`` (Muon for the blocks' weight matrices, AdamW for the
    rest, with ``betas``, ``eps`` and one ``learning_rate``; :mod:`olmo.optim.muon`)."""
    learning_rate: float = 1.0e-4
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay for the decay group."""
    betas: tuple[float, float] = (0.9, 0.95)
    """(beta1, beta2)."""
    eps: float = 1e-5
    """AdamW epsilon."""
    no_decay_norm_and_bias: Optional[bool] = None
    """Deprecated: when set, overrides ``decay_norm_and_bias`` with its negation."""
    selective_updates: bool = False
    """Skip decay and state updates where the gradient is exactly zero."""
    decay_norm_and_bias: bool = False
    """Apply weight decay to norm weights and biases."""
    decay_embeddings: bool = False
    """Apply weight decay to the embedding matrix (and the tied output matrix)."""
    metrics_log_interval: Optional[int] = None
    """OLMo's interval for per-parameter norm metrics. Mapped onto ours: the global gradient norm is logged at
    every step; per-parameter norms are not collected (a startup warning says so when this is set)."""
    record_update_metrics: bool = False
    """Accepted for OLMo compatibility; not collected yet."""
    muon_momentum: float = 0.95
    """``muon`` only: the momentum of the Muon matrices."""
    muon_nesterov: bool = True
    """``muon`` only: Nesterov momentum for the Muon matrices."""
    muon_ns_steps: int = 5
    """``muon`` only: Newton-Schulz iterations per orthogonalization, from 1 to 100 (each costs three matrix
    products per weight matrix and step; 5 is usual)."""
    muon_rms_scale: float = 0.2
    """``muon`` only: a Muon update is this times ``sqrt(max(rows, cols))`` times the orthogonalized matrix, which
    matches AdamW's update RMS, so ``learning_rate`` serves both parts."""

    def problems(self) -> list[str]:
        """One sentence per value of ``optimizer`` that cannot work (empty when there is none), and per ``muon_*``
        setting given to another optimizer."""
        out: list[str] = []
        if not 0 < self.learning_rate < math.inf:
            out.append(f"optimizer.learning_rate={self.learning_rate} must be a positive, finite number.")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            out.append(f"optimizer.betas={list(self.betas)} must each be in [0, 1).")
        if self.name != OptimizerType.muon:
            return out + [
                f"optimizer.{key}={getattr(self, key)} is used by optimizer.name=muon only, and the name is "
                f"{self.name}. Remove {key}, or set optimizer.name=muon."
                for key, default in _MUON_ONLY.items()
                if getattr(self, key) != default
            ]
        if not 0.0 <= self.muon_momentum < 1.0:
            out.append(f"optimizer.muon_momentum={self.muon_momentum} must be in [0, 1).")
        if not 1 <= self.muon_ns_steps <= MAX_MUON_NS_STEPS:
            out.append(
                f"optimizer.muon_ns_steps={self.muon_ns_steps} must be from 1 to {MAX_MUON_NS_STEPS} (5 is usual: "
                f"each iteration is three matrix products per weight matrix per step, and the orthogonalization has "
                f"converged long before {MAX_MUON_NS_STEPS})."
            )
        if not self.muon_rms_scale > 0:
            out.append(
                f"optimizer.muon_rms_scale={self.muon_rms_scale} must be positive (0.2 matches AdamW's update RMS)."
            )
        if self.selective_updates:
            out.append(
                "optimizer.selective_updates=true is not supported with optimizer.name=muon; set it to false."
            )
        return out


@dataclass
class SchedulerConfig(BaseConfig):
    name: SchedulerType = SchedulerType.cosine_with_warmup
    """Learning-rate schedule."""
    units: SchedulerUnits = SchedulerUnits.steps
    """Whether ``t_warmup``/``t_max`` count optimizer steps or training tokens."""
    t_warmup: Union[int, float] = 100
    """Warmup length in ``units`` (>= 0). A warmup as long as the run warns at launch: the run would train at a
    fraction of the learning rate throughout."""
    t_max: Optional[Union[int, float]] = None
    """Schedule length in ``units``; None means the run's max_duration."""
    alpha_f: float = 0.1
    """Final learning rate as a fraction of the peak, in [0, 1] (the cosine, linear, cosine-linear-envelope, max and
    wsd schedules decay to ``alpha_f * learning_rate``; the others ignore it)."""
    grad_clip_warmup_steps: Optional[Union[int, float]] = None
    """For this many steps, multiply ``max_grad_norm`` by ``grad_clip_warmup_factor``."""
    grad_clip_warmup_factor: Optional[float] = None
    """See ``grad_clip_warmup_steps``."""
    warmup_min_lr: Optional[float] = None
    """Learning rate at step 0 of warmup; None means ``0.1 * learning_rate``."""
    t_decay: Optional[Union[int, float]] = None
    """``wsd`` only, and required there: the length of the final decay in ``units``, which ends at ``t_max`` (the
    run's ``max_duration`` when null); before it the rate stays at the peak. 0: no decay (a stable run to branch
    decays from)."""
    decay_shape: DecayShape = DecayShape.linear
    """``wsd`` only: the decay's shape, ``linear``, ``cosine`` or ``1-sqrt`` (``1 - sqrt(fraction)``)."""

    def problems(self, where: str, length: Optional[float]) -> list[str]:
        """One sentence per value of the schedule at ``where`` (``scheduler``, ``stages[1].scheduler``) that cannot
        work, and per ``wsd`` setting given to another schedule.

        :param length: the schedule's span in its units (steps or tokens) when known before the data is opened.
        """
        out: list[str] = []
        if not 0.0 <= self.alpha_f <= 1.0:
            out.append(
                f"{where}.alpha_f={self.alpha_f} must be in [0, 1]: the final learning rate as a fraction of the peak "
                f"(below 0 the rate turns negative, above 1 the decay rises). Set e.g. --{where}.alpha_f=0.1."
            )
        if self.t_warmup < 0:
            out.append(f"{where}.t_warmup={self.t_warmup} must be >= 0.")
        if self.name != SchedulerType.wsd:
            for key, default in _WSD_ONLY.items():
                if getattr(self, key) != default:
                    out.append(
                        f"{where}.{key}={getattr(self, key)} is used by {where}.name=wsd only, and the name is "
                        f"{self.name}. Remove {key}, or set {where}.name=wsd."
                    )
            return out
        if self.t_decay is None:
            return [*out, WSD_NEEDS_T_DECAY.replace("scheduler.", f"{where}.")]
        if self.t_decay < 0:
            return [*out, f"{where}.t_decay={self.t_decay} must be >= 0 (0: no decay)."]
        end = self.t_max if self.t_max is not None else length
        if end is not None and self.t_decay > 0 and end - self.t_decay < self.t_warmup:
            span = (
                f"{where}.t_max={self.t_max}"
                if self.t_max is not None
                else f"the run's length ({end:g} {self.units})"
            )
            out.append(
                f"{where}.t_decay={self.t_decay} starts the decay at {end - self.t_decay:g} {self.units}, before the "
                f"warmup ends ({where}.t_warmup={self.t_warmup}); {span}. Use a t_decay of at most "
                f"{end - self.t_warmup:g}, or a shorter warmup."
            )
        return out

    def warmup_warnings(
        self, where: str, length: Optional[float], learning_rate: float, what: str, span: str, longer: str = ""
    ) -> list[str]:
        """A line when the warmup of the schedule at ``where`` fills ``what``, which lasts ``length`` (in the
        schedule's units; None when unknown) as ``span`` says: the learning rate then climbs throughout and never
        decays. ``longer`` is the option that lengthens ``what``, if one does."""
        if length is None or self.name == SchedulerType.constant or self.t_warmup < length:
            return []  # a constant schedule has no warmup
        start = (self.warmup_min_lr if self.warmup_min_lr is not None else 0.1 * learning_rate) / learning_rate
        end = start + (1 - start) * length / self.t_warmup
        fix = f"--{where}.t_warmup={max(1, int(length) // 10)} (a tenth of it)" + (
            f" or a longer {longer}" if longer else ""
        )
        return [
            f"{where}.t_warmup={self.t_warmup:,.0f} {self.units} is not shorter than {what} ({span}: {length:,.0f} "
            f"{self.units}), so all of it is warmup: the learning rate climbs from {start:.1%} to {end:.1%} of "
            f"optimizer.learning_rate={learning_rate:g} and never decays. Set {fix}."
        ]


def _defaults(section: type, names: tuple[str, ...]) -> dict[str, Any]:
    """The dataclass defaults of ``names`` in ``section``: set to anything else, they were set on purpose."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    return {name: fields[name].default for name in names}


_WSD_ONLY = _defaults(SchedulerConfig, ("t_decay", "decay_shape"))
_MUON_ONLY = _defaults(OptimizerConfig, ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_rms_scale"))


def schedule_problems(s: SchedulerConfig, where: str, length: Optional[float]) -> list[str]:
    """``s.problems(where, length)`` (see :meth:`SchedulerConfig.problems`), for :mod:`olmo.train.stages`, which checks
    the schedules again once every length is known in steps."""
    return s.problems(where, length)
