"""Learning-rate schedules with OLMo's class names, keywords and formulas (``olmo.optim.scheduler`` in OLMo too):
the warmup-then-decay family, WSD, the max of two schedules, bolt-on warmup, and :func:`build_scheduler`, which
turns a ``scheduler`` config section into one. Re-exported by :mod:`olmo.optim`."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import SchedulerConfig, SchedulerType, TrainConfig
from ..config.optim_sections import WSD_NEEDS_T_DECAY
from ..exceptions import OLMoConfigurationError

__all__ = [
    "BoltOnWarmupScheduler",
    "ConstantScheduler",
    "ConstantWithWarmup",
    "ConstantWithWarmupScheduler",
    "WSD",
    "CosLinearEnvelope",
    "CosWithWarmup",
    "InvSqrtWithWarmup",
    "LinearWithWarmup",
    "MaxScheduler",
    "Scheduler",
    "build_scheduler",
]


@dataclass(kw_only=True)
class Scheduler(ABC):
    """A learning-rate schedule plus OLMo's grad-clip warmup.

    ``get_lr(initial_lr, step, max_steps)`` takes the peak rate, the steps or tokens done so far and the
    run's length in the same units (``scheduler.units``; the caller converts); a configured ``t_max``
    overrides the passed one. Constructor keywords and method signatures are OLMo's, so a schedule built by
    hand in an OLMo script carries over; a subclass implements :meth:`get_lr`.

    :param grad_clip_warmup_steps: Steps (up to and including this one) during which the clipping limits are
        multiplied by ``grad_clip_warmup_factor``; None for no grad-clip warmup.
    :param grad_clip_warmup_factor: That multiplier; None for no grad-clip warmup.
    :param warmup_min_lr: The rate at the start of a linear warmup; None means 10% of the peak rate.
    """

    grad_clip_warmup_steps: int | None = None
    grad_clip_warmup_factor: float | None = None
    warmup_min_lr: float | None = None

    @abstractmethod
    def get_lr(self, initial_lr: float, step: int, max_steps: int) -> float: ...

    def get_max_grad_norm(
        self, initial_max_grad_norm: float | None, step: int, max_steps: int | None = None
    ) -> float | None:
        """The clipping limit for ``step``: the configured one, times the warmup factor early on; None stays None.

        :param max_steps: Unused; accepted as in OLMo.
        """
        warming = self.grad_clip_warmup_steps is not None and step <= self.grad_clip_warmup_steps
        if initial_max_grad_norm is None or self.grad_clip_warmup_factor is None or not warming:
            return initial_max_grad_norm
        return initial_max_grad_norm * self.grad_clip_warmup_factor

    def get_max_grad_norm_ratio(
        self, initial_max_grad_norm_ratio: float | None, step: int, max_steps: int | None = None
    ) -> float | None:
        """The adaptive clipping ratio for ``step``, warmed up like :meth:`get_max_grad_norm` (as in OLMo)."""
        return self.get_max_grad_norm(initial_max_grad_norm_ratio, step, max_steps)


@dataclass(kw_only=True)
class _Schedule(Scheduler):
    """A linear warmup from ``warmup_min_lr`` over ``warmup_steps``, then :meth:`_after_warmup`.

    :param warmup_steps: OLMo's name for ``scheduler.t_warmup``.
    :param t_max: The end of the decay; None means the run's length (``max_steps``).
    :param alpha_f: The final rate as a fraction of the peak.
    """

    warmup_steps: int = 0
    t_max: int | None = None
    alpha_f: float = 0.1

    @property
    def t_warmup(self) -> int:
        """``warmup_steps`` under the config's name."""
        return self.warmup_steps

    def get_lr(self, initial_lr: float, step: int, max_steps: int) -> float:
        if step >= self.warmup_steps:
            return self._after_warmup(initial_lr, step, max_steps)
        min_lr = self.warmup_min_lr if self.warmup_min_lr is not None else 0.1 * initial_lr
        assert 0.0 <= min_lr < initial_lr, "TrainConfig.validate() checks scheduler.warmup_min_lr"
        return min_lr + (initial_lr - min_lr) * step / self.warmup_steps

    @abstractmethod
    def _after_warmup(self, initial_lr: float, step: int, max_steps: int) -> float: ...


class _DecayToMin(_Schedule):
    """Decays from the peak after warmup to ``alpha_f * lr`` at ``t_max`` and stays there."""

    def _after_warmup(self, initial_lr: float, step: int, max_steps: int) -> float:
        end = self.t_max if self.t_max is not None else max_steps
        eta_min = initial_lr * self.alpha_f
        if step >= end:
            return eta_min
        return self._decay(initial_lr, eta_min, (step - self.warmup_steps) / (end - self.warmup_steps))

    @abstractmethod
    def _decay(self, initial_lr: float, eta_min: float, fraction: float) -> float:
        """The learning rate ``fraction`` (in [0, 1)) of the way from the end of warmup to ``t_max``."""


class CosWithWarmup(_DecayToMin):
    """Linear warmup, then cosine decay to ``alpha_f * lr`` at ``t_max``."""

    def _decay(self, initial_lr: float, eta_min: float, fraction: float) -> float:
        return eta_min + (initial_lr - eta_min) * (1 + math.cos(math.pi * fraction)) / 2


class LinearWithWarmup(_DecayToMin):
    """Linear warmup, then linear decay to ``alpha_f * lr`` at ``t_max``."""

    def _decay(self, initial_lr: float, eta_min: float, fraction: float) -> float:
        return initial_lr - (initial_lr - eta_min) * fraction


class CosLinearEnvelope(_DecayToMin):
    """Linear warmup, then cosine decay under a linear envelope; ``alpha_f * lr`` from ``t_max`` on."""

    def _decay(self, initial_lr: float, eta_min: float, fraction: float) -> float:
        return eta_min + (1 - fraction) * (initial_lr - eta_min) * (1 + math.cos(math.pi * fraction)) / 2


class InvSqrtWithWarmup(_Schedule):
    """Linear warmup, then ``lr * sqrt(warmup_steps / step)``; ``t_max`` and ``alpha_f`` are unused."""

    def _after_warmup(self, initial_lr: float, step: int, max_steps: int) -> float:
        return initial_lr * math.sqrt(self.warmup_steps / max(self.warmup_steps, step))


class ConstantWithWarmup(_Schedule):
    """Linear warmup, then the peak learning rate."""

    def _after_warmup(self, initial_lr: float, step: int, max_steps: int) -> float:
        return initial_lr


ConstantWithWarmupScheduler = ConstantWithWarmup  # OLMo's name


_DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda fraction: 1.0 - fraction,
    "cosine": lambda fraction: (1.0 + math.cos(math.pi * fraction)) / 2.0,
    "1-sqrt": lambda fraction: 1.0 - math.sqrt(fraction),
}
"""The share of ``peak - alpha_f * peak`` left ``fraction`` (in [0, 1)) of the way through a WSD decay."""


@dataclass(kw_only=True)
class WSD(_Schedule):
    """Warmup-stable-decay: linear warmup, the peak rate, then a decay over the last ``t_decay`` before ``t_max``
    (the run's length when None) to ``alpha_f * lr``, shaped ``decay_shape``; ``alpha_f * lr`` from ``t_max`` on.

    The rate at a step depends only on the step, the end and ``t_decay``, so every checkpoint taken before the decay
    starts is also a checkpoint of any shorter run that decays later: resumed with a new ``max_duration`` (and
    ``t_decay``), it finishes as that run would have (a *decay branch*).

    :param t_decay: The decay's length, in the schedule's units; 0 never decays (a stable run).
    :param decay_shape: ``linear``, ``cosine`` or ``1-sqrt``.
    """

    t_decay: int = 0
    decay_shape: str = "linear"

    def _after_warmup(self, initial_lr: float, step: int, max_steps: int) -> float:
        end = self.t_max if self.t_max is not None else max_steps
        if step <= end - self.t_decay:  # the decay's first point is the peak itself, exactly (bitwise branches)
            return initial_lr
        eta_min = initial_lr * self.alpha_f
        if step >= end:
            return eta_min
        fraction = (step - (end - self.t_decay)) / self.t_decay
        return eta_min + (initial_lr - eta_min) * _DECAY_SHAPES[str(self.decay_shape)](fraction)


class ConstantScheduler(ConstantWithWarmup):
    """The peak learning rate throughout; ``warmup_steps`` is ignored."""

    def get_lr(self, initial_lr: float, step: int, max_steps: int) -> float:
        return initial_lr


@dataclass
class MaxScheduler(Scheduler):
    """The larger learning rate of two schedules; the grad-clip warmup is this scheduler's own, as in OLMo."""

    sched1: Scheduler
    sched2: Scheduler

    def get_lr(self, initial_lr: float, step: int, max_steps: int) -> float:
        return max(
            self.sched1.get_lr(initial_lr, step, max_steps), self.sched2.get_lr(initial_lr, step, max_steps)
        )


@dataclass
class BoltOnWarmupScheduler(Scheduler):
    """Warm up again into ``inner``, e.g. after loading a model with a fresh optimizer.

    0 before ``warmup_start``, then a linear ramp to ``inner``'s value at ``warmup_end``, then
    ``inner``. Grad-clip warmup is ``inner``'s; this scheduler's own grad-clip fields and
    ``warmup_min_lr`` are unused.
    """

    inner: Scheduler
    warmup_start: int
    warmup_end: int

    @classmethod
    def wrap(cls, scheduler: Scheduler, warmup_start: int, warmup_end: int) -> BoltOnWarmupScheduler:
        """OLMo's constructor: ``scheduler`` warmed up again from ``warmup_start`` to ``warmup_end``."""
        return cls(scheduler, warmup_start, warmup_end)

    def get_lr(self, initial_lr: float, step: int, max_steps: int) -> float:
        if step < self.warmup_start:
            return 0.0
        if step < self.warmup_end:
            target = self.inner.get_lr(initial_lr, self.warmup_end, max_steps)
            return target * (step - self.warmup_start) / (self.warmup_end - self.warmup_start)
        return self.inner.get_lr(initial_lr, step, max_steps)

    def get_max_grad_norm(
        self, initial_max_grad_norm: float | None, step: int, max_steps: int | None = None
    ) -> float | None:
        return self.inner.get_max_grad_norm(initial_max_grad_norm, step, max_steps)


def _max_of_cosine_and_inv_sqrt(**fields: Any) -> MaxScheduler:
    own = ("grad_clip_warmup_steps", "grad_clip_warmup_factor", "warmup_min_lr")
    return MaxScheduler(CosWithWarmup(**fields), InvSqrtWithWarmup(**fields), **{k: fields[k] for k in own})


_SCHEDULES: dict[SchedulerType, Callable[..., Scheduler]] = {
    SchedulerType.cosine_with_warmup: CosWithWarmup,
    SchedulerType.linear_with_warmup: LinearWithWarmup,
    SchedulerType.inverse_sqrt_with_warmup: InvSqrtWithWarmup,
    SchedulerType.constant: ConstantScheduler,
    SchedulerType.constant_with_warmup: ConstantWithWarmup,
    SchedulerType.cosine_linear_envelope: CosLinearEnvelope,
    SchedulerType.max_scheduler: _max_of_cosine_and_inv_sqrt,
    SchedulerType.wsd: WSD,
}


def build_scheduler(cfg: SchedulerConfig | TrainConfig, sched_cfg: SchedulerConfig | None = None) -> Scheduler:
    """Build the schedule named by the scheduler config; ``t_warmup``, ``t_max`` and clip-warmup steps become ints.

    :param cfg: The scheduler config, or (OLMo's signature) the whole config, whose ``scheduler`` is used.
    :param sched_cfg: As in OLMo: the scheduler config to use instead of ``cfg``'s.
    """
    if sched_cfg is None:
        sched_cfg = cfg.scheduler if isinstance(cfg, TrainConfig) else cfg
    inverse_sqrt = (SchedulerType.inverse_sqrt_with_warmup, SchedulerType.max_scheduler)
    if sched_cfg.name in inverse_sqrt and int(sched_cfg.t_warmup) <= 0:
        raise OLMoConfigurationError(
            f"scheduler.t_warmup={sched_cfg.t_warmup} must be positive for scheduler.name={sched_cfg.name}, "
            f"which decays as lr * sqrt(t_warmup / current)."
        )
    clip_steps = sched_cfg.grad_clip_warmup_steps
    fields: dict[str, Any] = {
        "warmup_steps": int(sched_cfg.t_warmup),
        "t_max": None if sched_cfg.t_max is None else int(sched_cfg.t_max),
        "alpha_f": sched_cfg.alpha_f,
        "warmup_min_lr": sched_cfg.warmup_min_lr,
        "grad_clip_warmup_steps": None if clip_steps is None else int(clip_steps),
        "grad_clip_warmup_factor": sched_cfg.grad_clip_warmup_factor,
    }
    if sched_cfg.name == SchedulerType.wsd:
        if sched_cfg.t_decay is None:
            raise OLMoConfigurationError(WSD_NEEDS_T_DECAY)
        fields.update(t_decay=int(sched_cfg.t_decay), decay_shape=str(sched_cfg.decay_shape))
    return _SCHEDULES[sched_cfg.name](**fields)
