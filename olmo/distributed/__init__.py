"""Distributed training: ``collectives`` (process groups from torchrun's or Slurm's variables, rank helpers,
``all_reduce``, ``barrier``) and ``parallelize`` (FSDP2, activation checkpointing and compile applied from outside
to a built model; ``float8`` converts its linear layers for ``model.float8`` there) and ``layout`` (the run's
arrangement of ranks and every mesh, :class:`ParallelLayout`). Both are re-exported here; the ``parallelize`` names are loaded on first use, so code below the
parallelization layer (the data order's collectives, evaluators' reductions) imports ``collectives`` without
loading the model.

May import: ``olmo.model``, ``olmo.config``, ``olmo.util``, ``olmo.exceptions``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .collectives import DistEnv, all_reduce, barrier, init_distributed, teardown_distributed
from .layout import ParallelLayout

if TYPE_CHECKING:
    from .parallelize import (
        ParallelizeOptions,
        apply_activation_checkpointing,
        autocast_dtype,
        build_model,
        defer_replica_all_reduce,
        model_config_fingerprint,
    )

_LAZY = {
    "ParallelizeOptions",
    "build_model",
    "apply_activation_checkpointing",
    "defer_replica_all_reduce",
    "autocast_dtype",
    "model_config_fingerprint",
}

__all__ = [
    "DistEnv",
    "init_distributed",
    "teardown_distributed",
    "all_reduce",
    "barrier",
    "ParallelLayout",
    "ParallelizeOptions",
    "build_model",
    "apply_activation_checkpointing",
    "defer_replica_all_reduce",
    "autocast_dtype",
    "model_config_fingerprint",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.parallelize"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
