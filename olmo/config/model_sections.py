"""The ``model:`` section: the transformer's shape and options (:class:`ModelConfig`), with the checks of its values.
Its attention options (``model.sliding_window``, ``model.rope_scaling``) are sections of their own, in
:mod:`olmo.config.attention_sections`, and so is its mixture of experts (``model.moe``, :mod:`olmo.config.moe_sections`), and its hybrid layers
(``model.layer_types``, ``model.linear_attention``, :mod:`olmo.config.linear_attention_sections`).

Field names and defaults follow the original OLMo's; every field has a docstring (``train.py CONFIG --help`` prints
them). Import it from :mod:`olmo.config`, which re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .attention_sections import RopeScalingConfig, SlidingWindowConfig, attention_option_problems
from .base import BaseConfig
from .float8_sections import Float8Config
from .linear_attention_sections import LINEAR_ATTENTION, LinearAttentionConfig, layer_type_problems
from .moe_sections import MoEConfig
from .sections import ActivationType, BlockType, InitFnType, LayerNormType

__all__ = ["ModelConfig", "MAX_LAYERS", "MAX_SEQUENCE_LENGTH", "MAX_PARAMS"]

MAX_LAYERS = 4096
MAX_SEQUENCE_LENGTH = 2**24
MAX_PARAMS = 10**13
"""Sizes no model has (a typo, an extra zero), refused before the model is built on the meta device, which for a
hundred million layers would take hours."""


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
    nope: bool = False
    """No position encoding at all (NoPE): attention sees no RoPE, no ALiBi and no learned positions
    (``transformer.wpe``, which a model with neither ``rope`` nor ``alibi`` otherwise has, as OLMo's). OLMo Hybrid's
    released attention layers are so (transformers' ``rope_parameters.rope_theta: null``; OLMo-core's attention
    without ``rope``, its long-context stage's "DroPE"): the linear-attention layers carry the order."""
    rope_full_precision: bool = True
    """Apply RoPE in fp32 even under autocast."""
    rope_theta: int = 10000
    """RoPE base frequency."""
    flash_attention: bool = False
    """Use the flash-attn package when installed; otherwise warn once and use SDPA."""
    attention_backend: Optional[str] = None
    """Where flash-attn does not run: ``flex`` (PyTorch FlexAttention, block-sparse windows, documents and padding;
    forward only on a CPU), ``sdpa`` (a dense mask), or null: FlexAttention on a GPU, SDPA on a CPU
    (:mod:`olmo.model.flex_attention`)."""
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
    moe: Optional[MoEConfig] = None
    """A mixture of experts in place of every block's MLP (OLMoE, FlexOlmo): ``{num_experts: 64, top_k: 8,
    hidden_size: 1024}``. None (or ``num_experts: 0``): dense blocks."""
    layer_types: Optional[list[str]] = None
    """OLMo Hybrid's sequence mixer of each layer, a pattern cycled over the layers (layer i gets
    ``layer_types[i % len(layer_types)]``): ``full_attention`` or ``linear_attention`` (``model.linear_attention``'s
    recurrence, pre-norm whatever ``norm_after`` says, as transformers' OlmoHybrid has it), e.g. ``[linear_attention,
    linear_attention, linear_attention, full_attention]``. None: every layer is attention."""
    linear_attention: Optional[LinearAttentionConfig] = None
    """The linear-attention layers' recurrence (needed when ``layer_types`` has ``linear_attention``):
    ``{kind: gated_deltanet, num_key_heads, num_value_heads, key_head_dim, value_head_dim, conv_kernel_size,
    allow_neg_eigval}``, transformers' ``OlmoHybridConfig`` defaults for what is left out."""
    float8: Optional[Float8Config] = None
    """Float8 matrix products in the blocks' linear layers through torchao, on GPUs of compute capability 8.9 or newer
    (Ada, Hopper, Blackwell; rowwise 9.0): ``{enabled: true, recipe: tensorwise}``. Changes how training computes,
    not the weights: checkpoints hold ordinary weights. The in-loop evaluators run the trained model as it is (in
    float8); ``eval.py``, generation, conversion and frozen references never use it. None (or ``enabled: false``): no
    float8."""

    @property
    def is_moe(self) -> bool:
        """Whether the blocks hold a mixture of experts (``model.moe`` with ``num_experts > 0``)."""
        return self.moe is not None and self.moe.enabled

    def layer_windows(self) -> list[Optional[int]]:
        """Each layer's attention window in keys (itself included), None for full attention."""
        if self.sliding_window is None:
            return [None] * self.n_layers
        return self.sliding_window.windows(self.n_layers)

    def layer_kinds(self) -> list[str]:
        """Each layer's sequence mixer, ``full_attention`` or ``linear_attention`` (``model.layer_types`` cycled)."""
        types = self.layer_types or ["full_attention"]
        return [types[i % len(types)] for i in range(self.n_layers)]

    @property
    def has_linear_attention(self) -> bool:
        """Whether some layer mixes the sequence with ``model.linear_attention``'s recurrence."""
        return self.layer_types is not None and LINEAR_ATTENTION in self.layer_types

    @property
    def trains_float8(self) -> bool:
        """Whether training converts linear layers to float8 (``model.float8`` with ``enabled: true``)."""
        return self.float8 is not None and self.float8.enabled

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

    def problems(self) -> list[str]:
        """One sentence per value of this section that cannot work (empty when there is none), each naming the key
        and the fix; its attention options' and experts' included. A float that is not finite, or a scale past
        :data:`~olmo.config.bounds.MAX_SCALE`, is reported by the check of the whole config
        (:func:`~olmo.config.bounds.non_finite_problems`) unless a check here reports its key."""
        out: list[str] = []
        if self.d_model % self.n_heads != 0:
            out.append(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}.")
        elif (self.d_model // self.n_heads) % 2 != 0 and self.rope:
            out.append(f"model.rope needs an even head size; d_model/n_heads = {self.d_model // self.n_heads}.")
        if self.n_kv_heads is not None and self.multi_query_attention and self.n_kv_heads != 1:
            out.append(
                f"model.multi_query_attention=true contradicts model.n_kv_heads={self.n_kv_heads}; "
                f"remove multi_query_attention and keep n_kv_heads."
            )
        kv = self.effective_n_kv_heads
        if kv <= 0 or self.n_heads % kv != 0:
            out.append(f"model.n_kv_heads={kv} must be positive and divide model.n_heads={self.n_heads}.")
        if self.alibi and self.rope:
            out.append("model.alibi and model.rope are mutually exclusive; set one of them to false.")
        if self.nope and (self.rope or self.alibi):
            which = "model.rope" if self.rope else "model.alibi"
            out.append(
                f"model.nope=true (no position encoding) contradicts {which}=true; set one of them to false."
            )
        if self.alibi and self.flash_attention:
            out.append("model.alibi does not work with model.flash_attention; disable one of them.")
        if self.attention_backend not in (None, "flex", "sdpa"):
            out.append(
                f"model.attention_backend={self.attention_backend!r} must be flex, sdpa or null (automatic)."
            )
        elif self.attention_backend == "flex" and (self.alibi or self.attention_dropout):
            why = "ALiBi's per-head bias" if self.alibi else f"attention_dropout={self.attention_dropout}"
            out.append(
                f"model.attention_backend=flex cannot apply {why} (FlexAttention computes neither); set "
                f"model.attention_backend=sdpa, or {'alibi: false' if self.alibi else 'attention_dropout: 0'}."
            )
        if self.effective_embedding_size < self.vocab_size:
            out.append(
                f"model.embedding_size={self.embedding_size} must be at least model.vocab_size={self.vocab_size}."
            )
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            out.append(f"model.clip_qkv={self.clip_qkv} must be positive (or null to disable).")
        out += self._unsupported_block_problems()
        for name in ("attention_dropout", "residual_dropout", "embedding_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                out.append(f"model.{name}={p} must be in [0, 1).")
        for name in ("d_model", "n_heads", "n_layers", "max_sequence_length", "vocab_size"):
            if getattr(self, name) <= 0:
                out.append(f"model.{name} must be positive.")
        for name in ("eos_token_id", "pad_token_id"):
            token = getattr(self, name)
            if not 0 <= token < self.effective_embedding_size:
                out.append(
                    f"model.{name}={token} is outside the embedding (size {self.effective_embedding_size})."
                )
        out += attention_option_problems(self.sliding_window, self.rope_scaling, self.rope)
        out += layer_type_problems(self)
        if self.moe is not None:
            out += self.moe.problems(self)
        if self.float8 is not None:
            out += self.float8.problems()
        return out + self._scale_problems() + self._size_problems()

    def _scale_problems(self) -> list[str]:
        """Scales that must be positive: with zero or less a norm divides by zero or an init draws from no
        distribution, and the run fails at its first step (or trains on NaN). ``nan`` is the finite check's."""
        names = ["layer_norm_eps", "init_std", "emb_init_std", "init_cutoff_factor"]
        names += ["alibi_bias_max"] if self.alibi else []
        out = []
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                null = " (or null)" if name in ("emb_init_std", "init_cutoff_factor") else ""
                out.append(f"model.{name}={value} must be a positive number{null}.")
        return out

    def _unsupported_block_problems(self) -> list[str]:
        """OLMo's block options that only OLMo implements."""
        out: list[str] = []
        if self.block_group_size != 1:
            out.append(
                f"model.block_group_size={self.block_group_size} is not supported: in OLMo, block groups only "
                f"change how FSDP wraps the blocks (parameters named transformer.block_groups.G.i...), not what the "
                f"model computes. Set --model.block_group_size=1 (the same model; use fsdp.wrapping_strategy "
                f"one_in_N for coarser FSDP units); checkpoints saved with block groups do not load yet."
            )
        if self.block_type != "sequential":
            out.append(
                f"model.block_type={self.block_type} is not supported: only OLMo's sequential block (fused "
                f"att_proj, as in every released OLMo model) is implemented; OLMo's llama block (separate "
                f"q_proj/k_proj/v_proj) is not. Set --model.block_type=sequential for a new model; a checkpoint of a "
                f"llama-block model cannot be loaded yet."
            )
        return out

    def _size_problems(self) -> list[str]:
        """Sizes past :data:`MAX_LAYERS`, :data:`MAX_SEQUENCE_LENGTH` and :data:`MAX_PARAMS`."""
        out: list[str] = []
        if self.n_layers > MAX_LAYERS:
            out.append(
                f"model.n_layers={self.n_layers:,} is more than {MAX_LAYERS:,}; the deepest released models have "
                f"~130."
            )
        if self.max_sequence_length > MAX_SEQUENCE_LENGTH:
            out.append(
                f"model.max_sequence_length={self.max_sequence_length:,} is more than {MAX_SEQUENCE_LENGTH:,} tokens."
            )
        approx = 12 * self.n_layers * self.d_model**2 + 2 * max(self.effective_embedding_size, 0) * self.d_model
        if not out and approx > MAX_PARAMS:
            out.append(
                f"model.d_model={self.d_model:,} with model.n_layers={self.n_layers:,} makes about {approx:.2g} "
                f"parameters, more than {MAX_PARAMS:.0e} (a typo?); OLMo-2 32B has d_model 5120 and 64 layers."
            )
        return out
