"""Optimizers, learning-rate schedules and gradient clipping, with OLMo's rules and formulas.

The training loop uses this module in four calls per step: :func:`clip_grads` after the backward
pass, ``scheduler.get_lr`` / ``scheduler.get_max_grad_norm`` for the next values,
:func:`set_learning_rate`, then ``optimizer.step()``. Nothing here syncs with the host, and every
tensor operation also accepts DTensor parameters and gradients (FSDP2). ``skip_step`` holds the versions of
AdamW and LionW whose step can be skipped by a factor on the device (``stability.skip_spikes``).

May import: ``olmo.config``, ``olmo.util``, ``olmo.exceptions``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import OptimizerConfig, OptimizerType, SchedulerConfig, SchedulerType, TrainConfig
from ..config.optim_validation import WSD_NEEDS_T_DECAY
from ..exceptions import OLMoConfigurationError
from .lion import LionW

__all__ = [
    "Optimizer",
    "BoltOnWarmupScheduler",
    "ConstantScheduler",
    "ConstantWithWarmup",
    "ConstantWithWarmupScheduler",
    "WSD",
    "CosLinearEnvelope",
    "CosWithWarmup",
    "InvSqrtWithWarmup",
    "LinearWithWarmup",
    "LionW",
    "MaxScheduler",
    "Scheduler",
    "build_optimizer",
    "build_scheduler",
    "clip_grads",
    "get_param_groups",
    "set_learning_rate",
]

Optimizer = torch.optim.Optimizer
"""OLMo's optimizer base class; every optimizer here is a ``torch.optim.Optimizer``."""


def _decay_rule(module: nn.Module, param_name: str) -> int:
    """0 for biases, norm weights and the rest; 1 for a Linear weight; 2 for an Embedding weight."""
    if param_name != "weight":
        return 0
    return 2 if isinstance(module, nn.Embedding) else 1 if isinstance(module, nn.Linear) else 0


def get_param_groups(cfg: OptimizerConfig, model: nn.Module) -> list[dict[str, Any]]:
    """Split the trainable parameters of ``model`` into a decay and a no-decay group.

    The ``weight`` of an ``nn.Linear`` decays; the ``weight`` of an ``nn.Embedding`` decays only if
    ``cfg.decay_embeddings``; everything else (biases, norm weights, bare parameters) decays only if
    ``cfg.decay_norm_and_bias`` (or ``not cfg.no_decay_norm_and_bias`` when that deprecated flag is set).
    A parameter shared by several modules appears once, under the first name ``named_modules`` gives
    it; if one of its owners is an ``nn.Embedding`` (a tied output matrix), the embedding rule applies.

    :param cfg: The optimizer config.
    :param model: The model; it is only inspected.
    :returns: Up to two groups (decay, then no-decay with ``weight_decay=0.0``), empty ones omitted.
        ``params`` holds ``(name, param)`` pairs sorted by name, which torch turns into ``param_names``.
    """
    no_decay_flag = cfg.no_decay_norm_and_bias
    decides = (cfg.decay_norm_and_bias if no_decay_flag is None else not no_decay_flag, True, cfg.decay_embeddings)
    found: dict[int, tuple[str, nn.Parameter, int]] = {}  # id -> (first name, param, strongest rule)
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            rule = _decay_rule(module, param_name)
            first = found.get(id(param))
            if param.requires_grad and (first is None or rule > first[2]):
                name = first[0] if first else f"{module_name}.{param_name}".lstrip(".")
                found[id(param)] = (name, param, rule)

    decay = sorted((name, p) for name, p, rule in found.values() if decides[rule])
    no_decay = sorted((name, p) for name, p, rule in found.values() if not decides[rule])
    groups = []
    for named, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        if named:
            groups.append({"params": named, "weight_decay": weight_decay, "initial_lr": cfg.learning_rate})
    return groups


def muon_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`get_param_groups`'s groups with the 2-D weights of the transformer blocks moved into a group of their
    own with ``use_muon=True`` (weight decay as their decay group's); the embedding, the output layer, norms and
    biases stay in AdamW groups. Empty groups are dropped."""
    muon: list[tuple[str, nn.Parameter]] = []
    out = []
    muon_decay = 0.0
    for group in groups:
        mine = [(n, p) for n, p in group["params"] if p.dim() == 2 and ".blocks." in f".{n}"]
        if mine:
            muon += mine
            muon_decay = group["weight_decay"]
        taken = {id(p) for _, p in mine}
        rest = [(n, p) for n, p in group["params"] if id(p) not in taken]
        if rest:
            out.append({**group, "params": rest, "use_muon": False})
    if muon:
        first = groups[0]
        out.insert(
            0,
            {
                **first,
                "params": sorted(muon, key=lambda np_: np_[0]),
                "weight_decay": muon_decay,
                "use_muon": True,
            },
        )
    return out


OPTIMIZER_STATE_KEYS = {
    OptimizerType.adamw: frozenset({"step", "exp_avg", "exp_avg_sq"}),
    OptimizerType.lionw: frozenset({"exp_avg"}),
    OptimizerType.muon: frozenset({"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}),
}
"""The per-parameter state each optimizer keeps (besides what gradient clipping adds), which tells whose state a
checkpoint holds."""


def build_optimizer(
    cfg: OptimizerConfig | TrainConfig, model: nn.Module, skip_steps: bool = False
) -> torch.optim.Optimizer:
    """Build the optimizer named by ``cfg.name`` over :func:`get_param_groups` of ``model``.

    AdamW is torch's own, fused when every parameter lives on CUDA. ``selective_updates`` is
    implemented for LionW only.

    :param cfg: The optimizer config, or (OLMo's signature) the whole config, whose ``optimizer`` is used.
    :param model: The model whose trainable parameters to optimize.
    :param skip_steps: build the skip-step version (:mod:`olmo.optim.skip_step`), whose steps can be skipped by a
        factor on the device (``stability.skip_spikes``).
    """
    if isinstance(cfg, TrainConfig):
        cfg = cfg.optimizer
    groups = get_param_groups(cfg, model)
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    if cfg.name == OptimizerType.muon and not skip_steps:
        from .muon import Muon

        return Muon(
            muon_param_groups(groups),
            cfg.learning_rate,
            betas,
            cfg.eps,
            cfg.weight_decay,
            momentum=cfg.muon_momentum,
            nesterov=cfg.muon_nesterov,
            ns_steps=cfg.muon_ns_steps,
            rms_scale=cfg.muon_rms_scale,
        )
    if skip_steps:
        from .skip_step import SkipStepAdamW, SkipStepLionW

        if cfg.selective_updates or cfg.name not in (OptimizerType.adamw, OptimizerType.lionw):
            raise OLMoConfigurationError(
                f"stability.skip_spikes needs optimizer.name adamw or lionw without selective_updates (it is "
                f"{cfg.name}, selective_updates={cfg.selective_updates}); turn one of them off."
            )
        if cfg.name == OptimizerType.lionw:
            return SkipStepLionW(groups, cfg.learning_rate, betas, cfg.weight_decay)
        return SkipStepAdamW(groups, cfg.learning_rate, betas, cfg.eps, cfg.weight_decay)
    if cfg.name == OptimizerType.lionw:
        return LionW(groups, cfg.learning_rate, betas, cfg.weight_decay, cfg.selective_updates)
    if cfg.name == OptimizerType.adamw:
        if cfg.selective_updates:
            raise OLMoConfigurationError(
                "optimizer.selective_updates=true is not supported yet for adamw; "
                "set optimizer.selective_updates=false or use optimizer.name=lionw."
            )
        # Fused AdamW exists only for CUDA; elsewhere torch picks its own (for-loop or foreach) kernel.
        extra = {"fused": True} if all(p.device.type == "cuda" for g in groups for _, p in g["params"]) else {}
        return torch.optim.AdamW(
            groups, lr=cfg.learning_rate, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **extra
        )
    raise OLMoConfigurationError(f"optimizer.name={cfg.name!r} is unknown; use one of {list(OptimizerType)}.")


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every param group; weight decay stays as configured per group.

    :param optimizer: The optimizer.
    :param lr: The new learning rate, usually ``scheduler.get_lr(group["initial_lr"], step, max_steps)``.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grads(
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    max_grad_norm_ratio: float | None = None,
    step: int = 0,
) -> torch.Tensor:
    """Clip the gradients of ``optimizer``'s parameters in place, without syncing with the host.

    Adaptive clipping (``max_grad_norm_ratio``, takes priority) limits each gradient to ``ratio`` times
    an average of its own norm in ``optimizer.state[p]["grad_norm_exp_avg"]``, updated with the clipped
    norm and ``beta = max(group["betas"])``. As in OLMo it is stored from ``step > 1``, and only once the
    optimizer has state for ``p`` (torch optimizers initialise only an empty state). Fixed clipping
    scales all gradients by ``min(1, max_grad_norm / (total_norm + 1e-6))``. Missing gradients are skipped.

    :param optimizer: The optimizer whose parameters' gradients to clip.
    :param max_grad_norm: Global L2 norm limit, or None.
    :param max_grad_norm_ratio: Per-parameter limit relative to the average norm, or None.
    :param step: The global step (the first optimizer step is 1); needed for adaptive clipping.
    :returns: The total L2 norm of all gradients before clipping, a 0-dim fp32 tensor.
    """
    with_grad = [(p, group) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not with_grad:
        return torch.zeros((), dtype=torch.float32, device=optimizer.param_groups[0]["params"][0].device)
    params = [p for p, _ in with_grad]
    device = params[0].grad.device
    norms = torch.stack([torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32).to(device) for p in params])
    if isinstance(norms, DTensor):
        # One collective for all parameters: the shards' partial norms combine element-wise.
        norms = norms.full_tensor()
    total_norm = torch.linalg.vector_norm(norms, 2.0)

    if max_grad_norm_ratio is not None:
        for (p, group), norm in zip(with_grad, norms.unbind()):
            state = optimizer.state[p]
            exp_avg = state.get("grad_norm_exp_avg")
            if exp_avg is None:
                exp_avg = norm.clone()
                if step > 1 and len(state) > 0:
                    state["grad_norm_exp_avg"] = exp_avg
            # Always multiply, even by 1: testing ``coef < 1`` would sync with the host.
            coef = torch.clamp(max_grad_norm_ratio * exp_avg / (norm + 1e-6), max=1.0)
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
            exp_avg.lerp_(norm * coef, 1.0 - max(group.get("betas", (0.95,))))
    elif max_grad_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, total_norm)
    return total_norm


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
