"""The cache of incremental decoding for models with linear-attention layers: beside an attention layer's keys and
values (:data:`~olmo.model.attention_mixer.KeysValues`), a linear-attention layer keeps its
:class:`RecurrentState`, whose size does not grow with the sequence; and the document starts where those layers
begin afresh (:func:`recurrent_resets`), which is how they take a padded batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Union

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .attention import linear_attention_resets
from .attention_mixer import KeysValues

__all__ = ["RecurrentState", "LayerCache", "cached_length", "recurrent_resets", "conv_window"]


class RecurrentState(NamedTuple):
    """What a linear-attention layer needs to continue a sequence: (batch first, so that beam search reorders it
    with the hypotheses like the keys and values)."""

    conv: torch.Tensor
    """(B, K - 1, channels) the short convolution's last K - 1 inputs (q, k and v projections stacked, before the
    convolution), zeros for positions before the sequence's (or the document's) start."""
    state: torch.Tensor
    """(B, value_heads, key_head_dim, value_head_dim) the delta rule's state, in fp32 or wider."""
    length: int
    """Positions seen so far (padding included), as the keys of an attention layer count them."""


LayerCache = Union[KeysValues, RecurrentState]
"""One block's cache: its keys and values (attention) or its :class:`RecurrentState` (linear attention)."""


def cached_length(cache: Sequence[LayerCache] | None) -> int:
    """Positions held by ``cache`` (an ``attn_key_values`` of :meth:`olmo.model.OLMo.forward`), 0 for none."""
    if not cache:
        return 0
    first = cache[0]
    return first.length if isinstance(first, RecurrentState) else first[0].size(-2)


def conv_window(x: torch.Tensor, resets: torch.Tensor | None, size: int) -> torch.Tensor:
    """The last ``size`` positions of the (B, L, D) convolution inputs ``x`` (zeros where ``x`` is shorter), with
    every position before the latest document start of ``resets`` ((B, L) bool) zeroed: the window the next
    position's convolution sees."""
    window = F.pad(x[:, -size:] if size else x[:, :0], (0, 0, max(size - x.shape[1], 0), 0))  # (B, size, D)
    if resets is None or size == 0:
        return window
    starts = F.pad(resets[:, -size:], (max(size - resets.shape[1], 0), 0))  # (B, size)
    later = starts.flip(1).to(torch.int32).cumsum(1).flip(1) - starts.to(torch.int32)  # starts after each position
    return window * (later == 0).unsqueeze(-1)


def recurrent_resets(
    config: ModelConfig,
    attention_mask: torch.Tensor | None,
    doc_lens: torch.Tensor | None,
    attention_bias: torch.Tensor | None,
    past: int,
    seq_len: int,
) -> torch.Tensor | None:
    """(B, T) bool, True where the linear-attention layers start afresh among the T new positions: each document's
    first token (``doc_lens``) and each prompt's first real token after left padding (``attention_mask``, which
    covers the ``past`` cached positions too), so that padding never reaches their state; None when there is none
    (always for a model without linear-attention layers).

    :raises ValueError: for a mask with padding between real tokens (pad on the left or the right only), or for an
        ``attention_bias``, which these layers cannot take.
    """
    if not config.has_linear_attention:
        return None
    if attention_bias is not None:
        raise ValueError(
            "attention_bias is not implemented for linear_attention layers (model.layer_types): their recurrence "
            "has no keys to mask. Pass an attention_mask (left padding) or doc_lens instead."
        )
    resets = linear_attention_resets(doc_lens, seq_len)
    if attention_mask is None:
        return resets
    real = attention_mask.bool()  # (B, past + T)
    starts = real & ~F.pad(real[:, :-1], (1, 0), value=False)  # a real token after padding, or in column 0
    if bool((starts.sum(dim=1) > 1).any()):
        raise ValueError(
            "attention_mask has padding between real tokens, which linear_attention layers (model.layer_types) "
            "cannot skip: their state would restart there. Pad each row on the left (generation) or the right."
        )
    starts = starts[:, past:]
    return starts if resets is None else starts | resets
