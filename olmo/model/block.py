"""The OLMo block (:class:`OLMoBlock`: attention then MLP, with the KV cache of incremental decoding), the
flash-attn kernels it may call, OLMo's other block names, and the parameter initialization the block and
:class:`~olmo.model.OLMo` share (``init_fn``: normal, mitchell, full_megatron)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ActivationType, InitFnType, LayerNormType, ModelConfig
from ..exceptions import OLMoConfigurationError
from .attention import DocumentSpans, flash_varlen_attention
from .context_attention import ContextAttention
from .layers import LayerNorm, RotaryTables, apply_rotary, make_dropout
from .moe import MoEFeedForward

__all__ = [
    "OLMoBlock",
    "OLMoSequentialBlock",
    "OLMoLlamaBlock",
    "BufferCache",
    "init_scales",
    "init_normal",
    "init_tensor",
]

log = logging.getLogger(__name__)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


class _FlashAttn(NamedTuple):
    """The flash-attn kernels the model calls (functions, not the module, so that the model can be deep-copied)."""

    func: Callable[..., torch.Tensor]
    varlen_func: Callable[..., torch.Tensor]


def _load_flash_attn() -> _FlashAttn | None:
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        _warn_once("model.flash_attention is set but the flash-attn package is not installed; using PyTorch SDPA.")
        return None
    return _FlashAttn(flash_attn_func, flash_attn_varlen_func)


def _flash_usable(flash_attn: _FlashAttn | None, device: torch.device, dtype: torch.dtype, has_bias: bool) -> bool:
    """Whether flash-attn can run attention for inputs of this device and dtype, with or without a mask."""
    if flash_attn is None:
        return False
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        _warn_once("flash-attn needs CUDA fp16/bf16 inputs (enable autocast); using PyTorch SDPA.")
        return False
    if has_bias:
        _warn_once("flash-attn cannot take an attention mask or ALiBi; using PyTorch SDPA for those batches.")
        return False
    return True


class TensorParallel(Protocol):
    """A block's tensor-parallel group (``olmo.distributed.tensor_parallel``): its projections hold
    ``1 / degree`` of the heads and hidden units."""

    degree: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group (its gradient summed too)."""
        ...


class OLMoBlock(nn.Module):
    """OLMo's sequential block: attention then MLP, each pre-norm (or post-norm with ``norm_after``).

    :param layer_id: Index of the block (used by the ``mitchell`` init).
    :param config: The model config.
    :param cache: OLMo's shared :class:`BufferCache`; accepted and unused (the RoPE tables live on the model).
    """

    def __init__(self, layer_id: int, config: ModelConfig, cache: Any = None):
        del cache  # OLMo's shared buffer cache: RoPE tables live on the model here
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.n_heads = config.n_heads
        self.n_kv_heads = config.effective_n_kv_heads
        self.head_dim = config.d_model // config.n_heads
        kv_dim = self.n_kv_heads * self.head_dim
        hidden = config.effective_mlp_hidden_size
        bias = config.include_bias

        # Creation order follows OLMo so that parameters are listed in the same order.
        self.dropout = make_dropout(config.residual_dropout)
        self.k_norm: LayerNorm | None = None
        self.q_norm: LayerNorm | None = None
        if config.attention_layer_norm:
            affine = config.attention_layer_norm_with_affine
            self.k_norm = LayerNorm.build(config, size=kv_dim, elementwise_affine=affine)
            self.q_norm = LayerNorm.build(config, elementwise_affine=affine)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=bias)
        # The dense MLP (ff_proj, ff_out); in a mixture-of-experts block only as its shared expert, if any.
        moe = config.moe if config.is_moe else None
        if moe is not None:
            hidden = 0 if moe.shared_expert_hidden_size is None else 2 * moe.shared_expert_hidden_size
        ff_in = hidden // 2 if config.activation_type == ActivationType.swiglu else hidden
        self.ff_out: nn.Linear | None = nn.Linear(ff_in, config.d_model, bias=bias) if hidden else None
        self.attn_norm = LayerNorm.build(config)
        self.ff_norm = LayerNorm.build(config)
        self.att_proj = nn.Linear(config.d_model, config.d_model + 2 * kv_dim, bias=bias)
        self.ff_proj: nn.Linear | None = nn.Linear(config.d_model, hidden, bias=bias) if hidden else None
        self.moe: MoEFeedForward | None = None
        """The mixture of experts (``model.moe``), None in a dense block."""
        if moe is not None:
            self.moe = MoEFeedForward(
                config.d_model,
                moe.num_experts,
                moe.top_k,
                moe.expert_hidden_size(config),
                moe.norm_topk_prob,
                lb_weight=moe.lb_loss_weight / config.n_layers,
                z_weight=moe.z_loss_weight / config.n_layers,
                lb_per_instance=moe.lb_loss_granularity == "instance",
            )
        self._flash_attn = _load_flash_attn() if config.flash_attention else None
        self.tensor_parallel: TensorParallel | None = None
        """Set by ``olmo.distributed.tensor_parallel``: this rank computes its share of the heads and the MLP."""
        self.window: int | None = config.layer_windows()[layer_id]
        """Keys each query sees (itself included) on this layer, None for full attention (``model.sliding_window``):
        flash-attn applies it itself; on SDPA the model's ``attn_bias`` for this layer holds it."""
        if self.window is not None and self._flash_attn is None and torch.cuda.is_available():
            _warn_once(
                "model.sliding_window without flash-attn on a GPU: the window is folded into the SDPA mask, which "
                "still computes every key and rules out cuDNN's fused kernel (on an H200 OLMo-300M with OLMo 3's "
                "windows trained 30-44 % slower than with full attention at 4,096-8,192 tokens). For OLMo 3 on GPUs "
                "install flash-attn (pip install -e '.[flash]') and set --model.flash_attention=true."
            )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize this block's weights per ``config.init_fn`` (as :meth:`OLMo.reset_parameters` does for every
        block, in the same order of draws); biases 0, norm weights 1."""
        cfg = self.config
        cutoff, std, _ = init_scales(cfg)
        for module in self.modules():
            if isinstance(module, LayerNorm):
                module.reset_parameters()
        init_normal(self.att_proj, std, cutoff)
        if self.moe is not None:  # router, gate and up projections as ff_proj; the down projections as ff_out
            for weight in (self.moe.router.weight, self.moe.w1, self.moe.w3):
                init_tensor(weight, std, cutoff)
        if self.ff_proj is not None:
            init_normal(self.ff_proj, std, cutoff)

        def out_std(fan_in: int) -> float:
            if cfg.init_fn == InitFnType.mitchell:
                return 1 / math.sqrt(2 * fan_in * (self.layer_id + 1))
            return std / math.sqrt(2 * cfg.n_layers) if cfg.init_fn == InitFnType.full_megatron else std

        init_normal(self.attn_out, out_std(cfg.d_model), cutoff)
        if self.moe is not None:
            init_tensor(self.moe.w2, out_std(self.moe.w2.shape[1]), cutoff)
        if self.ff_out is not None:
            init_normal(self.ff_out, out_std(self.ff_out.in_features), cutoff)

    def forward(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None = None,
        rope: RotaryTables | None = None,
        doc_spans: DocumentSpans | None = None,
        layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
        use_cache: bool = False,
        context_parallel: ContextAttention | None = None,
    ) -> Any:
        """
        :param x: (B, T, C) residual stream.
        :param attn_bias: Additive attention bias broadcastable to (B, H, T, T) (T + cached keys with
            ``layer_past``), causal part included; None means plain causal attention (with ``layer_past``: one query
            that sees every key).
        :param rope: (cos, sin) tables of these T positions when the model uses RoPE.
        :param doc_spans: Run flash-attn's varlen kernel over these documents instead (``attn_bias`` is then None).
        :param layer_past: Cached (keys, values) of earlier positions, each (B, KV, past, hd).
        :param use_cache: Return ``(x, (keys, values))``, the keys and values of every position so far, instead
            of ``x`` alone.
        :param context_parallel: ``x`` is this rank's share of each instance; the attention gathers every rank's
            keys and values and attends as this says (``attn_bias`` is then None).
        """
        if layer_past is None and not use_cache:  # training: the plain path
            cp = context_parallel
            if self.config.norm_after:
                x = x + self.dropout(self.attn_norm(self.attention(x, attn_bias, rope, doc_spans, cp)))
                return x + self.dropout(self.ff_norm(self.feed_forward(x)))
            x = x + self.dropout(self.attention(self.attn_norm(x), attn_bias, rope, doc_spans, cp))
            return x + self.dropout(self.feed_forward(self.ff_norm(x)))
        if self.config.norm_after:
            y, present = self._attend(x, attn_bias, rope, doc_spans, layer_past)
            x = x + self.dropout(self.attn_norm(y))
            x = x + self.dropout(self.ff_norm(self.feed_forward(x)))
        else:
            y, present = self._attend(self.attn_norm(x), attn_bias, rope, doc_spans, layer_past)
            x = x + self.dropout(y)
            x = x + self.dropout(self.feed_forward(self.ff_norm(x)))
        return (x, present) if use_cache else x

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP: ``ff_out(act(ff_proj(x)))``, or the mixture of experts (plus its shared expert, if any),
        (B, T, C) -> (B, T, C)."""
        if self.moe is None:
            return self._dense_mlp(x)
        y = self.moe(x)
        return y if self.ff_proj is None else y + self._dense_mlp(x)

    def _dense_mlp(self, x: torch.Tensor) -> torch.Tensor:
        assert self.ff_proj is not None and self.ff_out is not None
        h = self.ff_proj(x)  # (B, T, hidden)
        act = self.config.activation_type
        if act == ActivationType.swiglu:
            up, gate = h.chunk(2, dim=-1)  # 2 x (B, T, hidden/2)
            h = F.silu(gate) * up
        elif act == ActivationType.gelu:
            h = F.gelu(h)
        else:
            h = F.relu(h)
        return self.ff_out(h)

    def attention(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None = None,
        rope: RotaryTables | None = None,
        doc_spans: DocumentSpans | None = None,
        context_parallel: ContextAttention | None = None,
    ) -> torch.Tensor:
        """Self-attention including the output projection, (B, T, C) -> (B, T, C)."""
        return self._attend(x, attn_bias, rope, doc_spans, None, context_parallel)[0]

    def _attend(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None,
        rope: RotaryTables | None,
        doc_spans: DocumentSpans | None,
        layer_past: tuple[torch.Tensor, torch.Tensor] | None,
        context_parallel: ContextAttention | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Self-attention (B, T, C) -> (B, T, C) after the cached keys and values ``layer_past``, and the keys and
        values of every position so far."""
        B, T, _ = x.shape
        share = (
            1 if self.tensor_parallel is None else self.tensor_parallel.degree
        )  # this rank: 1/share of the heads
        n_heads, n_kv_heads = self.n_heads // share, self.n_kv_heads // share
        C, kv_dim = n_heads * self.head_dim, n_kv_heads * self.head_dim
        qkv = self.att_proj(x)  # (B, T, C + 2 * kv_dim)
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(-self.config.clip_qkv, self.config.clip_qkv)
        q, k, v = qkv.split((C, kv_dim, kv_dim), dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            dtype = k.dtype  # under autocast the norms return fp32; keep the projection's dtype
            q = self._qk_norm(self.q_norm, q).to(dtype)
            k = self._qk_norm(self.k_norm, k).to(dtype)
        q = q.view(B, T, n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        if rope is not None:
            q, k = self._rotate(q, k, rope)
        if context_parallel is not None:  # every rank's keys and values, each chunk attending to its prefix
            y = context_parallel.attend(q, k, v, self._context_parallel_sdpa)  # (B, T, H, hd)
            return self.attn_out(y.reshape(B, T, C)), (k, v)
        if layer_past is not None:
            k = torch.cat((layer_past[0], k), dim=-2)  # (B, KV, past + T, hd)
            v = torch.cat((layer_past[1], v), dim=-2)
        y = self._scaled_dot_product(q, k, v, attn_bias, doc_spans, causal=layer_past is None)  # (B, T, H, hd)
        return self.attn_out(y.reshape(B, T, C)), (k, v)

    def _qk_norm(self, norm: LayerNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` over every head; under tensor parallelism ``x`` holds this rank's heads, and the statistics are
        summed over the group."""
        tp = self.tensor_parallel
        if tp is None or tp.degree == 1:
            return norm(x)
        return sharded_layer_norm(norm, x, tp)

    def _context_parallel_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        """One chunk's attention under context parallelism: ``mask`` is built in q's dtype, or a ``CausalBias``."""
        return self._scaled_dot_product(q, k, v, mask, None, causal=False, bias_ready=True)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rope: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        dtype = q.dtype
        if self.config.rope_full_precision:
            with torch.autocast(q.device.type, enabled=False):
                return apply_rotary(q.float(), cos, sin).to(dtype), apply_rotary(k.float(), cos, sin).to(dtype)
        cos, sin = cos.to(dtype), sin.to(dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def _scaled_dot_product(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_bias: torch.Tensor | None,
        doc_spans: DocumentSpans | None,
        causal: bool = True,
        bias_ready: bool = False,
    ) -> torch.Tensor:
        """q (B, H, T, hd), k/v (B, KV, S, hd) -> (B, T, H, hd). Without ``attn_bias``: causal attention, or with
        ``causal=False`` (one query after cached keys) attention to every key. ``bias_ready``: ``attn_bias`` is
        context parallelism's, built in q's dtype with finite values (or a ``CausalBias``), used as it is."""
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if doc_spans is not None:
            assert self._flash_attn is not None, "OLMo.forward passes doc_spans only when flash-attn runs"
            return flash_varlen_attention(self._flash_attn.varlen_func, q, k, v, doc_spans, dropout_p, self.window)
        if _flash_usable(self._flash_attn, q.device, q.dtype, attn_bias is not None):
            assert self._flash_attn is not None
            # flash-attn takes (B, T, heads, hd) and handles GQA itself; its causal mask (and window) are aligned to
            # the last key, which is what a query after cached keys needs.
            extra = {} if self.window is None else {"window_size": (self.window - 1, 0)}
            return self._flash_attn.func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, causal=True, **extra
            )
        if self.n_kv_heads != self.n_heads:
            # Query head h reads kv head h // (H / KV), as in OLMo and flash-attn.
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, T, hd)
        if attn_bias is not None and not bias_ready:
            # Finite minimum: a row with every key masked (a left-pad query) must give a uniform softmax, not NaN.
            attn_bias = attn_bias.to(q.dtype).clamp(min=torch.finfo(q.dtype).min)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, is_causal=causal and attn_bias is None
        )  # (B, H, T, hd)
        return y.transpose(1, 2)


def sharded_layer_norm(norm: LayerNorm, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``norm`` over a last dimension split over ``tp``'s ranks (``x`` this rank's share, the norm's weight and bias
    split the same way, as DTensors): ``rms`` and the layer norms, in fp32, their sums taken over the group."""
    from torch.distributed.tensor import DTensor

    weight, bias = (w.to_local() if isinstance(w, DTensor) else w for w in (norm.weight, norm.bias))
    dtype = x.dtype
    with torch.autocast(x.device.type, enabled=False):
        xf = x.float()
        if norm.norm_type == LayerNormType.rms:
            mean_square = tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / norm.size
            y = (xf * torch.rsqrt(mean_square + norm.eps)).to(dtype)
        else:
            mean = tp.all_reduce(xf.sum(-1, keepdim=True)) / norm.size
            centred = xf - mean
            variance = tp.all_reduce(centred.pow(2).sum(-1, keepdim=True)) / norm.size
            y = (centred * torch.rsqrt(variance + norm.eps)).to(dtype)
    if weight is not None:
        y = weight * y
        if bias is not None:
            y = y + bias
    return y


OLMoSequentialBlock = OLMoBlock
"""OLMo's name for the sequential block, the only block type there is here."""


class BufferCache(dict):  # type: ignore[type-arg]
    """OLMo's cache of non-persistent buffers shared by the blocks; accepted by :class:`OLMoBlock` for code written
    against the original, never needed (the model keeps its RoPE tables itself)."""


class OLMoLlamaBlock(OLMoBlock):
    """OLMo's ``block_type: llama`` (separate q, k and v projections). Not implemented: validation refuses the block
    type, and building one says so."""

    def __init__(self, layer_id: int, config: ModelConfig, cache: Any = None):
        raise OLMoConfigurationError(
            "OLMoLlamaBlock (model.block_type=llama) is not implemented; use the sequential block "
            "(model.block_type=sequential), whose fused att_proj computes the same attention."
        )


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
    _assign(weight, full)


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size tensor into ``param``, which may be a sharded DTensor (every rank holds ``full``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already has the same full tensor, so no communication is needed.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)
