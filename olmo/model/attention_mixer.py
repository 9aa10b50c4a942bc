"""Self-attention as a block's sequence mixer (:class:`AttentionMixer`), with its kernels: flash-attn (dense and
varlen), PyTorch SDPA (causal, or with a mask that may fold in the layer's window), and context parallelism's
per-chunk attention; the KV cache of incremental decoding.

A mixer is a part of a block's class (:func:`olmo.model.block.block_class`): its layers are the block's own
attributes (``att_proj``, ``attn_out``, ``q_norm``, ``k_norm``), so that parameter names stay OLMo's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .attention import DocumentSpans, flash_varlen_attention
from .context_attention import ContextAttention
from .flex_attention import flex_attend, is_block_mask
from .init import init_normal
from .layers import LayerNorm, RotaryTables, apply_rotary

if TYPE_CHECKING:
    from .recurrent_cache import LayerCache

__all__ = ["AttentionMixer", "KeysValues"]

log = logging.getLogger(__name__)

KeysValues = tuple[torch.Tensor, torch.Tensor]
"""A layer's cached (keys, values), each (B, KV, positions, head_dim), keys already rotated by RoPE."""


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


class AttentionMixer(nn.Module):
    """Multi-head (grouped-query) self-attention over the fused ``att_proj`` (q, k, v stacked), optional QK-norm and
    RoPE, then ``attn_out``.

    ``n_heads`` and ``n_kv_heads`` are the heads this module computes: the model's, unless a tensor-parallel plan
    (:func:`olmo.distributed.tensor_parallel.apply_tensor_parallel`) gave it a share of them.
    """

    config: ModelConfig
    layer_id: int

    def _build_mixer(self, layer_id: int, config: ModelConfig) -> None:
        """Create the attention's layers and settings for layer ``layer_id``."""
        self.n_heads = config.n_heads
        self.n_kv_heads = config.effective_n_kv_heads
        self.head_dim = config.d_model // config.n_heads
        kv_dim = self.n_kv_heads * self.head_dim
        self.k_norm: LayerNorm | None = None
        self.q_norm: LayerNorm | None = None
        if config.attention_layer_norm:
            affine = config.attention_layer_norm_with_affine
            self.k_norm = LayerNorm.build(config, size=kv_dim, elementwise_affine=affine)
            self.q_norm = LayerNorm.build(config, elementwise_affine=affine)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=config.include_bias)
        self.att_proj = nn.Linear(config.d_model, config.d_model + 2 * kv_dim, bias=config.include_bias)
        self._flash_attn = _load_flash_attn() if config.flash_attention else None
        self.window: int | None = config.layer_windows()[layer_id]
        """Keys each query sees (itself included) on this layer, None for full attention (``model.sliding_window``):
        flash-attn applies it itself; on SDPA the model's ``attn_bias`` for this layer holds it."""
        sdpa = config.attention_backend == "sdpa"  # null: FlexAttention on a GPU (olmo.model.flex_attention)
        if self.window is not None and self._flash_attn is None and torch.cuda.is_available() and sdpa:
            _warn_once(
                "model.sliding_window without flash-attn on a GPU: the window is folded into the SDPA mask, which "
                "still computes every key and rules out cuDNN's fused kernel (on an H200 OLMo-300M with OLMo 3's "
                "windows trained 30-44 % slower than with full attention at 4,096-8,192 tokens). For OLMo 3 on GPUs "
                "install flash-attn (pip install -e '.[flash]') and set --model.flash_attention=true, or set "
                "model.attention_backend=null (FlexAttention)."
            )

    def _reset_mixer_inputs(self, std: float, cutoff: float | None) -> None:
        """Draw the input projection (``att_proj``)."""
        init_normal(self.att_proj, std, cutoff)

    def _reset_mixer_outputs(self, out_std: Callable[[int], float], cutoff: float | None) -> None:
        """Draw the output projection (``attn_out``) with the std ``out_std`` gives its fan-in."""
        init_normal(self.attn_out, out_std(self.config.d_model), cutoff)

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
        layer_past: LayerCache | None,
        context_parallel: ContextAttention | None = None,
    ) -> tuple[torch.Tensor, LayerCache]:
        """Self-attention (B, T, C) -> (B, T, C) after the cached keys and values ``layer_past``, and the keys and
        values of every position so far."""
        B, T, _ = x.shape
        C, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qkv = self.att_proj(x)  # (B, T, C + 2 * kv_dim)
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(-self.config.clip_qkv, self.config.clip_qkv)
        q, k, v = qkv.split((C, kv_dim, kv_dim), dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            dtype = k.dtype  # under autocast the norms return fp32; keep the projection's dtype
            q = self.q_norm(q).to(dtype)
            k = self.k_norm(k).to(dtype)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
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
        if is_block_mask(attn_bias):  # FlexAttention's (olmo.model.flex_attention): the masked blocks skipped
            return flex_attend(q, k, v, attn_bias).transpose(1, 2)
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
