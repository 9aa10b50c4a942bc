"""The few settings of a run that size it before its launch (:class:`RunShape`): what the launch's memory check
(:mod:`olmo.distributed.launch_memory`), the memory estimate and the plans of ``scripts/plan.py``, ``scripts/train.py
--dry_run`` and the ladder (:mod:`olmo.ladder`) read, taken from the config once by
:meth:`RunShape.from_train_config`, so that none of them takes the whole config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..exceptions import OLMoConfigurationError
from .layout import ParallelLayout, _degree

if TYPE_CHECKING:
    from ..config import (
        ActivationCheckpointingStrategy,
        CompilerConfig,
        ContextParallelConfig,
        DataConfig,
        DistributedStrategy,
        ExpertParallelConfig,
        FSDPConfig,
        ModelConfig,
        OptimizerConfig,
        PipelineParallelConfig,
        TensorParallelConfig,
        TrainConfig,
    )

__all__ = ["RunShape"]


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """A run's model, batch, parallel sections, precision and the switches that change what a training step keeps,
    as the config gives them."""

    model: ModelConfig
    optimizer: OptimizerConfig
    """``optimizer``: its ``name`` says how many bytes of state each parameter keeps."""
    global_train_batch_size: int
    device_train_microbatch_size: int
    distributed_strategy: Optional[DistributedStrategy]
    fsdp: Optional[FSDPConfig]
    expert_parallel: ExpertParallelConfig
    context_parallel: ContextParallelConfig
    tensor_parallel: TensorParallelConfig
    pipeline_parallel: PipelineParallelConfig
    activation_checkpointing: Optional[ActivationCheckpointingStrategy]
    compile: Optional[CompilerConfig]
    """``compile``: the blocks are compiled when set."""
    precision: Optional[str]
    """``precision`` as configured (``amp_bf16``, ``fp32``, ...)."""
    autocast_precision: Optional[str]
    """The autocast dtype's name on GPU (``TrainConfig.autocast_precision``; None: fp32)."""
    fused_loss: bool
    dpo: bool
    """``dpo.enabled``: a frozen reference model is held, and the loss needs the logits."""
    data: DataConfig
    """``data``: its attention masks (``generate_doc_lengths``, ``generate_attention_mask``) take memory."""

    @classmethod
    def from_train_config(cls, cfg: TrainConfig) -> RunShape:
        """The shape of ``cfg``."""
        return cls(
            model=cfg.model,
            optimizer=cfg.optimizer,
            global_train_batch_size=cfg.global_train_batch_size,
            device_train_microbatch_size=cfg.device_train_microbatch_size,
            distributed_strategy=cfg.distributed_strategy,
            fsdp=cfg.fsdp,
            expert_parallel=cfg.expert_parallel,
            context_parallel=cfg.context_parallel,
            tensor_parallel=cfg.tensor_parallel,
            pipeline_parallel=cfg.pipeline_parallel,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
            precision=cfg.precision,
            autocast_precision=cfg.autocast_precision,
            fused_loss=bool(cfg.fused_loss),
            dpo=cfg.dpo.enabled,
            data=cfg.data,
        )

    def layout(self, world_size: int, local_world_size: Optional[int] = None) -> ParallelLayout:
        """The layout a launch on ``world_size`` ranks (``local_world_size`` per node) would have, for estimates and
        plans: one that validation refuses is sized as ``world_size`` ranks sharding everything, never an error."""
        try:
            return ParallelLayout.from_sections(
                world_size,
                local_world_size=local_world_size,
                distributed_strategy=self.distributed_strategy,
                fsdp=self.fsdp,
                context_parallel=self.context_parallel,
                tensor_parallel=self.tensor_parallel,
                expert_parallel=self.expert_parallel,
                pipeline_parallel=self.pipeline_parallel,
            )
        except OLMoConfigurationError:
            return ParallelLayout(world_size=world_size)

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank, by :meth:`TrainConfig.grad_accum_steps`'s rule (the ranks
        of a context-, tensor- or pipeline-parallel group read the same instances)."""
        shared = _degree(self.context_parallel) * _degree(self.tensor_parallel) * _degree(self.pipeline_parallel)
        device_batch = self.global_train_batch_size // max(1, world_size // shared)
        return math.ceil(device_batch / self.device_train_microbatch_size)
