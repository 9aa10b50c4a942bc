"""Attention on PyTorch's FlexAttention (issue 55): sliding windows, document masks and padding as a block-sparse
mask, so that blocks of queries and keys the mask hides are skipped rather than computed and thrown away, where the
SDPA path must fold them into a dense (T x T) mask that rules out its fast kernels.

``model.attention_backend``:

- ``null`` (automatic): flash-attn when ``model.flash_attention`` and it runs; otherwise, on a GPU, FlexAttention for
  the layers whose attention needs a mask (a window shorter than the sequence, documents, padding) and SDPA's causal
  kernel for the others; on a CPU, SDPA throughout.
- ``flex``: FlexAttention for every layer that needs a mask, on any device (a CPU runs it forward only: torch has no
  CPU backward for it, so a training run on a CPU is refused).
- ``sdpa``: PyTorch SDPA with a dense mask, as before FlexAttention.

A layer's mask is built once per forward pass (:func:`flex_masks`) from each window, the documents' ids
(``data.generate_doc_lengths``) and the padding (``attention_mask``); a window's alone, the same for every batch, is
built once per sequence length and device and kept; on a GPU the others are built by a compiled
``create_block_mask`` (about 10x faster than eager on a CPU at 4 x 8,192 tokens, and never holding the dense mask). The kernel is compiled on a GPU (eager on a CPU). Its numbers equal the SDPA path's within float rounding (``tests/model/test_flex_attention.py``).
"""

from __future__ import annotations

import warnings
from functools import cache, lru_cache
from typing import Any, Optional

import torch

__all__ = ["flex_attend", "flex_inputs", "flex_masks", "flex_runs", "is_block_mask"]


def flex_runs(backend: Optional[str], device: torch.device, flash_runs: bool) -> bool:
    """Whether the layers that need a mask attend with FlexAttention (see the module's docstring)."""
    if backend == "flex":
        return True
    if backend == "sdpa" or flash_runs:
        return False
    return device.type == "cuda"


def flex_inputs(
    model: Any,
    x: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    doc_ids: Optional[torch.Tensor],
    past: int,
    attention_bias: Optional[torch.Tensor],
) -> Optional[dict[Optional[int], Any]]:
    """The block masks of ``model``'s forward pass of the embeddings ``x`` when FlexAttention runs it (see
    :func:`flex_masks`), else None: never after cached keys or with an explicit ``attention_bias`` or ALiBi, nor where
    flash-attn runs, nor in training with attention dropout (FlexAttention has none; the config refuses ``flex``
    with it)."""
    config = model.config
    if past or attention_bias is not None or config.alibi or (model.training and config.attention_dropout):
        return None
    if not flex_runs(config.attention_backend, x.device, model.flash_runs_documents(x, attention_mask)):
        return None
    key_mask = None if attention_mask is None else attention_mask.to(x.device).bool()
    return flex_masks(model.windows, x.shape[1], x.device, doc_ids, key_mask)


def flex_masks(
    windows: list[int],
    seq_len: int,
    device: torch.device,
    doc_ids: Optional[torch.Tensor],
    key_mask: Optional[torch.Tensor],
    compiled: Optional[bool] = None,
) -> dict[Optional[int], Any]:
    """The block masks of a forward pass, by window (None: the full-attention layers, only when documents or padding
    need a mask): causal, within ``window`` positions, within a document (``doc_ids`` (B, T)), and never to a padding
    key (``key_mask`` (B, T), true for real tokens). A batch's masks are built by a compiled ``create_block_mask``
    where the kernel is compiled (``compiled``, default: on a GPU), which never holds the (B, T, T) mask at once
    (compiled once per window and kind of mask, not per batch); eagerly elsewhere."""
    build = _mask_builder(device.type == "cuda" if compiled is None else compiled)
    batch = None
    if doc_ids is not None or key_mask is not None:
        batch = (doc_ids if doc_ids is not None else key_mask).shape[0]  # type: ignore[union-attr]

    def mask_for(window: Optional[int]) -> Any:
        if doc_ids is None and key_mask is None and window is not None:
            return _window_mask(window, seq_len, device)  # the same for every batch: built once

        def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            keep = q >= kv
            if window is not None:
                keep = keep & (q - kv < window)
            if doc_ids is not None:
                keep = keep & (doc_ids[b, q] == doc_ids[b, kv])
            if key_mask is not None:
                keep = keep & key_mask[b, kv]
            return keep

        return build(mask_mod, batch, None, seq_len, seq_len, device=device)

    masks: dict[Optional[int], Any] = {w: mask_for(w) for w in windows if w < seq_len}
    if doc_ids is not None or key_mask is not None:
        masks[None] = mask_for(None)
    return masks


@cache
def _mask_builder(compiled: bool) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask) if compiled else create_block_mask


@lru_cache(maxsize=32)
def _window_mask(window: int, seq_len: int, device: torch.device) -> Any:
    """The block mask of a causal window over ``seq_len`` positions, for every row of every batch: built on the first
    forward pass that needs it (evaluating the mask over all (T, T) positions) and reused by later ones."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (q - kv < window)

    return create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)


def is_block_mask(value: object) -> bool:
    """Whether ``value`` is a FlexAttention block mask (what :func:`flex_masks` builds)."""
    if value is None or isinstance(value, torch.Tensor):
        return False
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(value, BlockMask)


@cache
def _kernel(compiled: bool) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """q (B, H, T, hd), k/v (B, KV, T, hd) under ``block_mask`` -> (B, H, T, hd); grouped key/value heads as SDPA's
    query head h reads kv head h // (H / KV). Compiled on a GPU; eager elsewhere (forward only)."""
    with warnings.catch_warnings():  # the eager kernel's notice that it is unfused (the CPU's, for checks)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        kernel = _kernel(q.device.type == "cuda")
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
