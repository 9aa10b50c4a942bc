"""Process groups, rank helpers, and everything applied to a built model from the outside
(materialization, FSDP2 sharding, torch.compile). The model itself knows nothing of this.

One code path serves ``python scripts/train.py`` (one process, no process group) and
``torchrun --nproc_per_node=N scripts/train.py`` (gloo on CPU, nccl on GPU, picked automatically).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import CompilerConfig, ModelConfig, TrainConfig
from .exceptions import OLMoConfigurationError

__all__ = ["DistEnv", "init_distributed", "teardown_distributed", "all_reduce", "build_model", "barrier"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its device, rank and world size."""

    device: torch.device
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_minutes: float = 30.0) -> DistEnv:
    """Initialize the default process group when launched by torchrun; otherwise run standalone."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if device.type == "cuda" else None,
        )
        log.info("Initialized %s process group with %d ranks.", backend, world_size)
    return DistEnv(device=device, rank=rank, local_rank=local_rank, world_size=world_size)


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce in place when a process group exists; a no-op for one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def build_model(cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """Build ``OLMo(cfg.model)`` on the meta device, shard it when there are several ranks, then
    materialize and initialize the parameters directly on the training device (so no rank ever
    holds a full copy it does not need) and apply ``compile``.
    """
    from .model import OLMo

    with torch.device("meta"):
        model = OLMo(cfg.model)
    if env.world_size > 1:
        _shard(model, cfg, env)
    model.to_empty(device=env.device)
    model.reset_parameters()
    if cfg.compile is not None:
        _compile_blocks(model, cfg.compile)
    return model


def _shard(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> None:
    from torch.distributed.fsdp import fully_shard

    if cfg.distributed_strategy == "ddp":
        raise OLMoConfigurationError(
            "distributed_strategy=ddp is not implemented yet; use the default fsdp (or one process)."
        )
    for block in model.transformer.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)


def _compile_blocks(model: nn.Module, cfg: CompilerConfig) -> None:
    """Compile each block separately: one small graph reused by every layer compiles fast."""
    for block in model.transformer.blocks:  # type: ignore[union-attr]
        block.compile(mode=cfg.mode, fullgraph=cfg.fullgraph, backend=cfg.backend, dynamic=cfg.dynamic)


def model_config_fingerprint(cfg: ModelConfig) -> str:
    """A short hash of the model config, stored in checkpoints to catch mismatched resumes."""
    import hashlib
    import json
    from dataclasses import asdict

    text = json.dumps(asdict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype for this device, or None for fp32. CPUs always train in fp32."""
    name = cfg.autocast_precision
    if name is None or device.type != "cuda":
        return None
    return getattr(torch, name)
