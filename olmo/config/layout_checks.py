"""The run's layout: its batch sizes, parallel degrees and sharding against the number of processes. One function,
:func:`layout_problems`, checks a layout for a launch (through :func:`olmo.config.validation.validate_train_config`),
for ``--dry_run`` and for ``scripts/plan.py``, so that a plan never shows a layout that a launch refuses."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = [
    "MAX_WORLD_SIZE",
    "layout_problems",
    "layout_world_size",
    "smallest_world_size",
    "batch_layout_problems",
    "strategy_problems",
]

log = logging.getLogger(__name__)

MAX_WORLD_SIZE = 1 << 20
"""The most processes a layout is planned for (``scripts/plan.py --world_size``): about a million ranks, ten times
the largest training clusters."""


def layout_world_size(cfg: TrainConfig, world_size: int) -> Optional[int]:
    """The number of processes a launch of ``world_size`` checks its layout for: ``world_size``, except for a dry run
    started as one process (no torchrun), which plans a launch elsewhere: None, its layout is then checked against
    the model and the fewest processes its degrees need (:func:`smallest_world_size`)."""
    return None if cfg.dry_run and world_size == 1 else world_size


def _whole_degree(d: object) -> int:
    """A degree as the layout uses it (a bad value, which its own check reports, counts as 1)."""
    return d if isinstance(d, int) and not isinstance(d, bool) and d >= 1 else 1


def smallest_world_size(cfg: TrainConfig) -> int:
    """The fewest processes the configured degrees can launch on: the least common multiple of
    ``expert_parallel.degree`` and ``context_parallel.degree`` x ``tensor_parallel.degree`` x
    ``pipeline_parallel.degree`` (1 without them)."""
    shared = _whole_degree(cfg.context_parallel.degree) * _whole_degree(cfg.tensor_parallel.degree)
    shared *= _whole_degree(cfg.pipeline_parallel.degree)
    return math.lcm(_whole_degree(cfg.expert_parallel.degree), shared)


def layout_problems(cfg: TrainConfig, world_size: Optional[int]) -> list[str]:
    """Every reason the run's layout cannot launch on ``world_size`` processes: batch sizes against the
    data-parallel ranks, the degrees of expert, context and tensor parallelism against the model, each other and the
    processes, and the sharding strategy. None: any number of processes the degrees divide (a dry run started as one
    process, see :func:`layout_world_size`). A launch (through :func:`validate_train_config`) and ``scripts/plan.py``
    both check a layout with this function."""
    return batch_layout_problems(cfg, world_size) + strategy_problems(cfg, world_size)


def batch_layout_problems(cfg: TrainConfig, world_size: Optional[int]) -> list[str]:
    """The run's batch sizes against ``world_size`` processes (None: the fewest the degrees need)."""
    micro, batch = cfg.device_train_microbatch_size, cfg.global_train_batch_size
    if batch <= 0 or micro <= 0:
        return ["global_train_batch_size and device_train_microbatch_size must be positive."]
    world = smallest_world_size(cfg) if world_size is None else world_size
    dp = cfg.data_parallel_size(world)
    if batch % (micro * dp) != 0:
        ranks = f"world size ({world})" if dp == world else f"data-parallel ranks ({dp} of {world})"
        if world_size is None:
            ranks = f"data-parallel ranks (at least {dp}: the degrees need {world} or a multiple of it)"
        return [
            f"global_train_batch_size={batch} must be divisible by device_train_microbatch_size ({micro}) x "
            f"{ranks} = {micro * dp}; change one of them (e.g. --global_train_batch_size="
            f"{max(1, batch // (micro * dp)) * micro * dp})."
        ]
    derived = cfg.device_batch_size(world)
    if (
        world_size is not None
        and cfg.device_train_batch_size is not None
        and cfg.device_train_batch_size != derived
    ):
        # OLMo wrote this derived value into every saved config.yaml, for the world size of that run.
        log.warning(
            "device_train_batch_size=%d is ignored: it is derived as global_train_batch_size / world size = %d.",
            cfg.device_train_batch_size,
            derived,
        )
    return []


def strategy_problems(cfg: TrainConfig, world_size: Optional[int]) -> list[str]:
    """``distributed_strategy``, the sharding and the parallel degrees against ``world_size`` processes (None: any
    number the degrees divide)."""
    sharding = str((cfg.fsdp.sharding_strategy if cfg.fsdp is not None else None) or "FULL_SHARD")
    strategy = str(cfg.distributed_strategy)
    ep = cfg.expert_parallel.problems(cfg.model, strategy, sharding, world_size)
    ep += cfg.context_parallel.problems(cfg.model, strategy, world_size, cfg.expert_parallel.degree)
    ep += cfg.tensor_parallel.problems(
        cfg.model, strategy, world_size, cfg.expert_parallel.degree, cfg.context_parallel.degree
    )
    ep += cfg.pipeline_parallel.problems(cfg, world_size)
    ep += _hybrid_problems(cfg, world_size)
    if cfg.model.trains_float8 and cfg.tensor_parallel.degree > 1:
        ep.append(
            f"model.float8.enabled=true with tensor_parallel.degree={cfg.tensor_parallel.degree} is not implemented "
            "(float8 layers would need torchao's float8 tensor-parallel styles in place of torch's); train with "
            "FSDP alone (--tensor_parallel.degree=1) or without float8 (--model.float8.enabled=false)."
        )
    if ep:
        return ep
    if cfg.distributed_strategy == "single" and world_size is not None and world_size > 1:
        return [
            f"distributed_strategy=single trains on one device, but {world_size} processes were launched. Use "
            f"--distributed_strategy=fsdp (or ddp) under torchrun, or launch one process."
        ]
    return []


def _hybrid_problems(cfg: TrainConfig, world_size: Optional[int]) -> list[str]:
    """``fsdp.hybrid_sharding_num_model_replicas`` of a hybrid-sharded run: whole, and dividing the ranks FSDP
    spans (the processes over ``tensor_parallel.degree``), as the device mesh needs."""
    fsdp = cfg.fsdp
    hybrid = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    if fsdp is None or cfg.distributed_strategy != "fsdp" or str(fsdp.sharding_strategy) not in hybrid:
        return []
    replicas = fsdp.hybrid_sharding_num_model_replicas
    if replicas is None:
        return []  # one replica per node: the launch's nodes decide
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        return [
            f"fsdp.hybrid_sharding_num_model_replicas={replicas!r} must be a whole number >= 1 (or null: one "
            f"replica per node)."
        ]
    if world_size is None:
        return []
    spanned = world_size // (
        _whole_degree(cfg.tensor_parallel.degree) * _whole_degree(cfg.pipeline_parallel.degree)
    )
    if spanned % replicas:
        return [
            f"fsdp.hybrid_sharding_num_model_replicas={replicas} must divide the ranks FSDP spans ({spanned}: "
            f"{world_size} processes over tensor_parallel.degree); launch a multiple of {replicas} data-parallel "
            f"ranks, or set it to a divisor of {spanned} (null: one replica per node)."
        ]
    return []
