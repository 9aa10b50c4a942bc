"""The enums of a run's configuration and its small sections (tokenizer, wandb, speed monitor, compile, FSDP, DDP,
single device); of these only the tokenizer has values to check, beside its fields. The larger sections have modules
of their own, each with its checks: :mod:`~olmo.config.model_sections` (``model``), :mod:`~olmo.config.attention_sections`
(its attention options), :mod:`~olmo.config.optim_sections` (``optimizer``, ``scheduler``),
:mod:`~olmo.config.data_sections` (``data``, its mixture, instance filter and remote reads),
:mod:`~olmo.config.eval_sections` (``evaluators``), :mod:`~olmo.config.stage_sections` and :mod:`~olmo.config.stability_sections`.

Field names and defaults follow the original OLMo's; every field has a docstring (``train.py CONFIG
--help`` prints them). Import them from :mod:`olmo.config`, which re-exports all of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from ..exceptions import OLMoConfigurationError
from ..util.tokenizer_files import load_base_tokenizer, resolve_tokenizer_path
from .base import BaseConfig

log = logging.getLogger(__name__)


class StrEnum(str, Enum):
    """An enum whose members are their own string values, so YAML can name them either way."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"'{self.value}'"


class CheckpointType(StrEnum):
    """OLMo's kinds of checkpoint: ``stepN`` (sharded), ``stepN-unsharded``, and ephemeral sharded ones."""

    sharded = "sharded"
    unsharded = "unsharded"
    sharded_ephemeral = "sharded_ephemeral"


class ActivationType(StrEnum):
    gelu = "gelu"
    relu = "relu"
    swiglu = "swiglu"


class BlockType(StrEnum):
    sequential = "sequential"
    llama = "llama"
    """OLMo's Llama-style block (separate q/k/v projections); accepted by name, refused by validation."""


class LayerNormType(StrEnum):
    default = "default"
    """``F.layer_norm`` in the input's dtype (under autocast: fp32)."""
    low_precision = "low_precision"
    """Layer norm run in the autocast dtype (bf16/fp16) to save memory bandwidth."""
    rms = "rms"
    """RMSNorm, computed in fp32 and cast back."""


class InitFnType(StrEnum):
    normal = "normal"
    mitchell = "mitchell"
    full_megatron = "full_megatron"


class ActivationCheckpointingStrategy(StrEnum):
    whole_layer = "whole_layer"
    one_in_two = "one_in_two"
    one_in_three = "one_in_three"
    one_in_four = "one_in_four"
    one_in_eight = "one_in_eight"
    two_in_three = "two_in_three"
    three_in_four = "three_in_four"
    fine_grained = "fine_grained"


class OptimizerType(StrEnum):
    lionw = "lionw"
    adamw = "adamw"
    muon = "muon"


class SchedulerType(StrEnum):
    cosine_with_warmup = "cosine_with_warmup"
    linear_with_warmup = "linear_with_warmup"
    inverse_sqrt_with_warmup = "inverse_sqrt_with_warmup"
    max_scheduler = "max_scheduler"
    constant = "constant"
    constant_with_warmup = "constant_with_warmup"
    cosine_linear_envelope = "cosine_linear_envelope"
    wsd = "wsd"


class DecayShape(StrEnum):
    """How a ``wsd`` schedule's final decay falls from the peak to ``alpha_f * lr``."""

    linear = "linear"
    cosine = "cosine"
    one_minus_sqrt = "1-sqrt"


class SchedulerUnits(StrEnum):
    steps = "steps"
    tokens = "tokens"


class PaddingDirection(StrEnum):
    right = "right"
    left = "left"


class TruncationDirection(StrEnum):
    right = "right"
    left = "left"


class EvaluatorType(StrEnum):
    downstream = "downstream"
    lm = "lm"
    generate = "generate"


class DistributedStrategy(StrEnum):
    fsdp = "fsdp"
    ddp = "ddp"
    single = "single"


class ShardingStrategy(StrEnum):
    """Written by name, as in OLMo configs (``FULL_SHARD``); mapped onto FSDP2 in olmo.distributed."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    HYBRID_SHARD = "HYBRID_SHARD"
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"
    NO_SHARD = "NO_SHARD"


class FSDPWrapStrategy(StrEnum):
    by_block = "by_block"
    by_block_and_size = "by_block_and_size"
    by_block_group = "by_block_group"
    by_block_group_and_size = "by_block_group_and_size"
    size_based = "size_based"
    one_in_two = "one_in_two"
    one_in_three = "one_in_three"
    one_in_four = "one_in_four"
    one_in_five = "one_in_five"


class FSDPPrecision(StrEnum):
    pure = "pure"
    """Params, reductions and buffers all in the autocast dtype."""
    mixed = "mixed"
    """Params and buffers in the autocast dtype, gradient reductions in fp32."""


class DDPGradSyncMode(StrEnum):
    batch = "batch"
    micro_batch = "micro_batch"


@dataclass
class TokenizerConfig(BaseConfig):
    identifier: str = "allenai_gpt-neox-olmo-dolma-v1_5.json"
    """A tokenizer.json path, or the name of a file shipped in ``olmo_eval/tokenizers/``."""
    truncate_direction: TruncationDirection = TruncationDirection.right
    """Accepted for OLMo compatibility; OLMo never applied it either. ``left`` warns at startup that it has no
    effect (data is pre-tokenized; downstream tasks truncate queries on the left)."""

    def problems(self, vocab_size: int, used: bool) -> list[str]:
        """What stops this tokenizer from serving a model of ``vocab_size`` tokens (empty when nothing does).

        :param used: whether anything in the run uses the tokenizer (downstream evaluators). Then it must load and
            have ``vocab_size`` tokens. Otherwise it is only resolved (never fetched from the hub), and a name this
            machine cannot resolve is a warning: pre-tokenized data trains without it.
        """
        if not used:
            try:
                resolve_tokenizer_path(self.identifier)
            except OLMoConfigurationError as e:
                log.warning("%s (Nothing in this run uses the tokenizer, so training goes on.)", e)
            return []
        try:
            vocab = load_base_tokenizer(self.identifier).get_vocab_size()
        except OLMoConfigurationError as e:
            return [str(e)]
        if vocab != vocab_size:
            return [
                f"tokenizer.identifier={self.identifier!r} has {vocab} tokens but model.vocab_size={vocab_size}; "
                f"the downstream evaluators need them to match: set the tokenizer the model was trained with."
            ]
        return []


@dataclass
class WandbConfig:
    project: Optional[str] = None
    """The wandb project; None is wandb's default."""
    entity: Optional[str] = "ai2-llm"
    """The wandb team or user the run belongs to."""
    group: Optional[str] = None
    """Groups related runs in the wandb UI."""
    name: Optional[str] = None
    """The wandb run name; None uses ``run_name``."""
    tags: Optional[list[str]] = field(default_factory=lambda: ["watching"])
    """Tags attached to the wandb run."""
    log_artifacts: bool = False
    """Accepted for OLMo compatibility (unused there too); ``true`` warns at startup that nothing is uploaded."""
    rank_zero_only: bool = True
    """Rank 0 always logs alone (metrics are reduced across ranks first); ``false`` warns at startup that it
    has no effect."""
    log_interval: int = 1
    """Steps between wandb log calls."""
    mode: Optional[str] = None
    """``offline`` (default unless WANDB_MODE is set), ``online`` or ``disabled``. Online needs
    WANDB_API_KEY in the environment; keys are never config fields."""


@dataclass
class SpeedMonitorConfig:
    window_size: int = 100
    """Steps averaged for tokens/s and MFU."""
    gpu_flops_available: Optional[float] = None
    """Peak FLOP/s of one device for MFU; None means detect it (known GPUs, or measure the CPU)."""


@dataclass
class CompilerConfig:
    mode: Optional[str] = None
    """torch.compile's mode: ``default``, ``reduce-overhead`` or ``max-autotune``; None is the default."""
    fullgraph: bool = False
    """Compile each block as one graph; fails on graph breaks instead of falling back."""
    backend: str = "inductor"
    """The torch.compile backend."""
    dynamic: Optional[bool] = None
    """torch.compile's dynamic-shape setting; None lets it decide."""


@dataclass
class FSDPConfig:
    use_orig_params: bool = True
    """Accepted for OLMo compatibility: FSDP2 always keeps the original parameters; ``false`` warns at startup."""
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD, mapped onto FSDP2 (see docs/distributed.md)."""
    wrapping_strategy: Optional[FSDPWrapStrategy] = None
    """Which modules become their own FSDP unit: by_block (and null), by_block_and_size, one_in_N
    (by_block_group_and_size acts as by_block_and_size). ``size_based`` and ``by_block_group`` act as
    ``by_block`` and warn at startup."""
    precision: Optional[FSDPPrecision] = FSDPPrecision.pure
    """``mixed``: compute in the autocast dtype, reduce gradients in fp32; ``pure``: reduce in the autocast dtype."""
    hybrid_sharding_num_model_replicas: Optional[int] = None
    """HYBRID_SHARD replica groups; None means one per node. Must divide the world size."""


@dataclass
class DDPConfig:
    grad_sync_mode: DDPGradSyncMode = DDPGradSyncMode.batch
    """``batch``: all-reduce gradients once per step; ``micro_batch``: after every micro-batch."""
    find_unused_params: bool = False
    """Accepted for OLMo compatibility (needs grad_sync_mode micro_batch there); ``true`` warns at startup that
    it has no effect."""


@dataclass
class SingleGPUConfig:
    """OLMo's settings for ``distributed_strategy: single``."""

    device: str = "auto"
    """``auto`` (the default, and the only value with an effect here: CUDA when available, else CPU); any
    other value warns at startup that the device is chosen automatically."""
