"""What OLMo's training step reads of a run: :class:`StepSettings`, the sections and values
:class:`~olmo.train.train_module.TransformerTrainModule` (and its DPO and KL subclasses) are built with, in place of
the whole config (issue 52: a component takes its own sections)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..config import (
    DataConfig,
    DDPConfig,
    DPOConfig,
    KLReferenceConfig,
    ModelConfig,
    OptimizerConfig,
    PipelineParallelConfig,
    RLConfig,
    SchedulerConfig,
    SkipSpikesConfig,
    TokenizerConfig,
)
from ..data.builders import DataContext
from ..distributed.parallelize import ParallelizeOptions

__all__ = ["StepSettings"]


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """The sections (shared with the config: a section changed before the step reads it, such as the DPO reference
    path fixed at launch, is seen) and the top-level values of the run that the training step reads;
    ``TransformerTrainModule.from_config`` takes them from the config."""

    SAME_NAMES: ClassVar[tuple[str, ...]] = (
        "model",
        "optimizer",
        "scheduler",
        "ddp",
        "dpo",
        "kl_reference",
        "data",
        "tokens_per_batch",
        "max_grad_norm",
        "max_grad_norm_ratio",
        "save_folder",
        "rl",
        "tokenizer",
        "seed",
        "pipeline_parallel",
    )
    """The fields that are the config's keys (or properties) of the same name."""

    model: ModelConfig
    optimizer: OptimizerConfig
    """``optimizer``: its ``learning_rate`` is the schedule's peak."""
    scheduler: SchedulerConfig
    """``scheduler``: its units, and the warmup of a fresh optimizer restarting mid-run."""
    ddp: Optional[DDPConfig]
    skip_spikes: SkipSpikesConfig
    """``stability.skip_spikes``."""
    dpo: DPOConfig
    kl_reference: KLReferenceConfig
    parallel: ParallelizeOptions
    """How a frozen reference model is built, and whether replicas may defer their gradient all-reduce."""
    data: DataConfig
    """``data``: what the DPO reference's precomputation reads."""
    data_context: DataContext
    micro_batch_size: int
    """``device_train_microbatch_size``: instances per forward pass."""
    tokens_per_batch: int
    """Tokens per optimizer step over all ranks (a schedule in tokens counts these)."""
    fused_loss: bool
    z_loss_multiplier: Optional[float]
    """The z-loss weight with ``softmax_auxiliary_loss`` (``auxiliary_loss_multiplier``, 1e-4 by default), else None."""
    max_grad_norm: Optional[float]
    max_grad_norm_ratio: Optional[float]
    autocast_precision: Optional[str]
    """The autocast dtype's name on an accelerator (None: fp32)."""
    save_folder: str
    """``save_folder``: where a staged run's KL reference snapshots and the DPO reference's values are kept."""
    rl: RLConfig
    """``rl``: the RL step's section (:class:`olmo.rl.rl_train_module.RLTrainModule`)."""
    tokenizer: TokenizerConfig
    """``tokenizer``: what decodes the RL step's completions for its rewards."""
    seed: int
    """``seed``: it seeds the RL step's sampling."""
    pipeline_parallel: PipelineParallelConfig
    """``pipeline_parallel``: the schedule and micro-batches of a pipeline's step."""
