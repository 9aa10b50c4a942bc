"""The parameter initialization the blocks' parts and :class:`~olmo.model.OLMo` share (``model.init_fn``: normal,
mitchell, full_megatron): the scales of a config and the draws, always full-size from the CPU generator."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import InitFnType, ModelConfig

__all__ = ["init_scales", "init_normal", "init_tensor", "assign_full"]


def init_scales(cfg: ModelConfig) -> tuple[float | None, float, float]:
    """``(cutoff factor, std, embedding std)`` of ``cfg.init_fn``."""
    d = cfg.d_model
    if cfg.init_fn == InitFnType.normal:
        return cfg.init_cutoff_factor, cfg.init_std, cfg.emb_init_std or cfg.init_std
    if cfg.init_fn == InitFnType.mitchell:
        std = 1 / math.sqrt(d)
        return cfg.init_cutoff_factor or 3.0, std, cfg.emb_init_std or std
    assert cfg.init_fn == InitFnType.full_megatron, cfg.init_fn
    std = cfg.init_std
    emb = cfg.emb_init_std or (std * math.sqrt(d) if cfg.scale_emb_init else std)
    return cfg.init_cutoff_factor or 3.0, std, emb


def init_normal(module: nn.Linear | nn.Embedding, std: float, cutoff: float | None) -> None:
    """Draw ``module.weight`` from N(0, std), truncated at ``cutoff`` stds when given (:func:`init_tensor`); zero
    ``module.bias``."""
    init_tensor(module.weight, std, cutoff)
    bias = getattr(module, "bias", None)
    if bias is not None:
        nn.init.zeros_(bias)


def init_tensor(weight: torch.Tensor, std: float, cutoff: float | None) -> None:
    """Draw ``weight`` from N(0, std), truncated at ``cutoff`` stds when given.

    The full tensor is always drawn from the CPU generator and then copied into the parameter (for a sharded
    parameter, each rank keeps its own slice). So a seed gives the same initial weights on CPU or GPU, with one
    process or many, which is what lets a sharded run reproduce a single-process run.
    """
    full = torch.empty(weight.shape, dtype=torch.float32)
    if cutoff is None:
        nn.init.normal_(full, mean=0.0, std=std)
    else:
        nn.init.trunc_normal_(full, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)
    assign_full(weight, full)


def assign_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size tensor into ``param``, which may be a sharded DTensor (every rank holds ``full``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already has the same full tensor, so no communication is needed.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)
