"""Optimizers, learning-rate schedules and gradient clipping, with OLMo's rules and formulas.

The training loop uses this module in four calls per step: :func:`clip_grads` after the backward
pass, ``scheduler.get_lr`` / ``scheduler.get_max_grad_norm`` for the next values,
:func:`set_learning_rate`, then ``optimizer.step()``. Nothing here syncs with the host, and every
tensor operation also accepts DTensor parameters and gradients (FSDP2). ``skip_step`` holds the versions of
AdamW and LionW whose step can be skipped by a factor on the device (``stability.skip_spikes``); ``scheduler`` the
learning-rate schedules and :func:`build_scheduler` (re-exported here); ``lion`` and ``muon`` those optimizers.

May import: ``olmo.config``, ``olmo.util``, ``olmo.exceptions``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import OptimizerConfig, OptimizerType, TrainConfig
from ..exceptions import OLMoConfigurationError
from .lion import LionW
from .scheduler import (
    WSD,
    BoltOnWarmupScheduler,
    ConstantScheduler,
    ConstantWithWarmup,
    ConstantWithWarmupScheduler,
    CosLinearEnvelope,
    CosWithWarmup,
    InvSqrtWithWarmup,
    LinearWithWarmup,
    MaxScheduler,
    Scheduler,
    build_scheduler,
)

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
    """0 for biases, norm weights and the rest; 1 for a Linear weight (or a module's stacked matrices, such as the
    experts' ``w1``/``w2``/``w3``, which it names in ``matrix_params``); 2 for an Embedding weight."""
    if param_name in getattr(module, "matrix_params", ()):
        return 1
    if param_name != "weight":
        return 0
    return 2 if isinstance(module, nn.Embedding) else 1 if isinstance(module, nn.Linear) else 0


def get_param_groups(cfg: OptimizerConfig, model: nn.Module) -> list[dict[str, Any]]:
    """Split the trainable parameters of ``model`` into a decay and a no-decay group.

    The ``weight`` of an ``nn.Linear`` (and the experts' stacked matrices) decays; the ``weight`` of an
    ``nn.Embedding`` decays only if ``cfg.decay_embeddings``; everything else (biases, norm weights, other bare
    parameters) decays only if
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


def _grad_norms(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each parameter's gradient L2 norm, (P,) fp32 on ``device``: one collective per device mesh (FSDP's; the
    experts' own mesh with expert parallelism), whose shards' partial norms combine element-wise."""
    groups = _by_mesh(params)
    if len(groups) == 1:
        return _stacked_norms(params, device)
    position = {id(p): i for i, p in enumerate(params)}
    out: list[torch.Tensor] = [torch.empty(())] * len(params)
    for same_mesh in groups.values():
        for p, norm in zip(same_mesh, _stacked_norms(same_mesh, device).unbind()):
            out[position[id(p)]] = norm
    return torch.stack(out)


def _stacked_norms(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    norms = torch.stack([torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32).to(device) for p in params])  # type: ignore[arg-type]
    return norms.full_tensor() if isinstance(norms, DTensor) else norms


def clip_grads(
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    max_grad_norm_ratio: float | None = None,
    step: int = 0,
    group: Any = None,
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
    :param group: The process group of the ranks holding the model's other parts (a pipeline's stages): the total
        norm sums their squares too.
    :returns: The total L2 norm of all gradients before clipping, a 0-dim fp32 tensor.
    """
    with_grad = [(p, group) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not with_grad:
        return torch.zeros((), dtype=torch.float32, device=optimizer.param_groups[0]["params"][0].device)
    params = [p for p, _ in with_grad]
    device = params[0].grad.device
    norms = _grad_norms(params, device)
    total_norm = torch.linalg.vector_norm(norms, 2.0)
    if group is not None:  # the other stages' gradients count in the norm
        import torch.distributed as dist

        squared = total_norm.square()
        dist.all_reduce(squared, group=group)
        total_norm = squared.sqrt()

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
        for same_mesh in _by_mesh(params).values():  # torch's foreach kernels take one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(same_mesh, max_grad_norm, total_norm)
    return total_norm


def _by_mesh(params: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """``params`` grouped by their gradients' device mesh (None for plain tensors), in order."""
    out: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        out.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return out
