"""Attention inputs for :mod:`olmo.model`: the causal, padding, ALiBi, document and sliding-window masks folded
into one additive bias for PyTorch SDPA, the document spans that flash-attn's varlen kernel takes instead of a mask, and
:func:`describe_attention`, which reports the kernel that will run.

Document masking is the model side of OLMo's ``data.generate_doc_lengths``: a packed row of ``T`` tokens holds
several documents, ``doc_lens`` (B, max_docs) gives their lengths (zero-padded on the right, each row summing to
``T``), and a token attends only to earlier tokens of its own document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..exceptions import OLMoDataError
from .layers import alibi_bias

__all__ = [
    "DocumentSpans",
    "attention_bias",
    "check_doc_lens",
    "check_forward_inputs",
    "cumulative_document_lengths",
    "describe_attention",
    "document_ids",
    "document_spans",
    "flash_varlen_attention",
    "linear_attention_resets",
]


class DocumentSpans(NamedTuple):
    """The documents of a packed batch as flash-attn's varlen kernels take them: the batch is one flat stream of
    ``B * T`` tokens, cut into documents."""

    cu_seqlens: torch.Tensor
    """(n_docs + 1,) int32: 0, then the running total of the document lengths in row-major order."""
    max_seqlen: int
    """The length of the longest document (an upper bound also works, only slower)."""


def check_forward_inputs(
    config: ModelConfig,
    input_ids: torch.Tensor | None,
    input_embeddings: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    past_key_values: Sequence[Any] | None,
    past: int,
    doc_lens: torch.Tensor | None,
) -> None:
    """Refuse inputs the incremental-decoding arguments cannot combine with, naming the argument."""
    if (input_ids is None) == (input_embeddings is None):
        raise ValueError("OLMo.forward takes input_ids or input_embeddings: exactly one of them.")
    if past_key_values is None:
        return
    if len(past_key_values) != config.n_layers:
        raise ValueError(
            f"past_key_values has {len(past_key_values)} entries but the model has {config.n_layers} "
            f"blocks: pass the attn_key_values of an earlier call with use_cache=True."
        )
    if doc_lens is not None:
        raise ValueError("doc_lens cannot be combined with past_key_values: document masking is for training.")
    T = (input_ids if input_ids is not None else input_embeddings).shape[1]  # type: ignore[union-attr]
    if attention_mask is not None and attention_mask.shape[-1] != past + T:
        raise ValueError(
            f"attention_mask has {attention_mask.shape[-1]} positions but past_key_values hold {past} and "
            f"input_ids {T}: with a cache the mask covers every position, past and new ({past + T})."
        )


def check_doc_lens(doc_lens: torch.Tensor, input_shape: torch.Size, max_doc_lens: Sequence[int] | None) -> None:
    """Raise :class:`OLMoDataError` unless ``doc_lens`` describes every token of ``input_ids`` exactly once.

    One host sync (the checks of the values), so that bad lengths fail here rather than inside a kernel.

    :param doc_lens: (B, max_docs) document lengths, zero-padded on the right.
    :param input_shape: (B, T), the shape of ``input_ids``.
    :param max_doc_lens: When given, must be at least the longest document.
    """
    hint = "doc_lens must be (batch, max_docs) integer lengths whose nonzero entries sum to each row's length"
    B, T = input_shape
    if doc_lens.dim() != 2 or doc_lens.size(0) != B:
        raise OLMoDataError(f"{hint}; got shape {tuple(doc_lens.shape)} for input_ids of shape {(B, T)}.")
    if doc_lens.dtype.is_floating_point or doc_lens.dtype.is_complex or doc_lens.dtype == torch.bool:
        raise OLMoDataError(f"{hint}; got dtype {doc_lens.dtype}.")
    longest = int(max(max_doc_lens)) if max_doc_lens else T
    bad_rows = (doc_lens < 0).any(dim=1) | (doc_lens.sum(dim=1) != T) | (doc_lens > longest).any(dim=1)  # (B,)
    if bad_rows.any():
        row = int(bad_rows.nonzero()[0])
        limit = f" and at most max(max_doc_lens)={longest}" if max_doc_lens else ""
        raise OLMoDataError(
            f"{hint}{limit}; row {row} has lengths {doc_lens[row].tolist()} for {T} tokens "
            f"({int(bad_rows.sum())} of {B} rows are wrong)."
        )


def document_ids(doc_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, T) the index, within its row, of the document each position belongs to.

    :param doc_lens: (B, max_docs) lengths that passed :func:`check_doc_lens`.
    """
    ends = doc_lens.cumsum(dim=1)  # (B, max_docs) where each document stops (exclusive)
    positions = torch.arange(seq_len, device=doc_lens.device).repeat(doc_lens.size(0), 1)  # (B, T)
    # A position's document is the number of documents that end at or before it.
    return torch.searchsorted(ends, positions, right=True)  # (B, T)


def linear_attention_resets(doc_lens: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """(B, T) bool, True at each document's first token (``doc_lens``, checked), where the linear-attention layers
    reset their state; None without documents (an ``attention_mask`` adds its own starts:
    :func:`olmo.model.recurrent_cache.recurrent_resets`)."""
    if doc_lens is None:
        return None
    doc_ids = document_ids(doc_lens, seq_len)  # (B, T)
    return F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=True)


def cumulative_document_lengths(doc_lens: torch.Tensor) -> torch.Tensor:
    """(n_docs + 1,) int32 ``cu_seqlens`` of (B, max_docs) zero-padded lengths: 0, then the running total of the
    nonzero lengths row by row, as the documents lie in the flattened batch."""
    lengths = doc_lens[doc_lens != 0]  # (n_docs,)
    return F.pad(lengths.cumsum(dim=0, dtype=torch.int32), (1, 0))


def document_spans(doc_lens: torch.Tensor, max_doc_lens: Sequence[int] | None) -> DocumentSpans:
    """The :class:`DocumentSpans` of lengths that passed :func:`check_doc_lens`; ``max(max_doc_lens)`` is the
    longest document when given (saves a host sync), else it is computed."""
    max_seqlen = int(max(max_doc_lens)) if max_doc_lens else int(doc_lens.max())
    return DocumentSpans(cumulative_document_lengths(doc_lens), max_seqlen)


def attention_bias(
    config: ModelConfig,
    seq_len: int,
    device: torch.device,
    attention_mask: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    past_length: int = 0,
    bias: torch.Tensor | None = None,
    window: int | None = None,
    masks: dict[int | None, Any] | None = None,
) -> Any:
    """Additive fp32 bias with the causal mask folded in, broadcastable to (B, H, T, past_length + T); None when
    plain causal attention is all that is needed (SDPA then runs with ``is_causal=True`` and no mask at all, or,
    for one query after cached keys, with no mask and no causality). With FlexAttention's block ``masks``
    (:func:`olmo.model.flex_attention.flex_inputs`), the full-attention layers' mask among them (None: causal).

    :param attention_mask: (B, past_length + T), 1 for real tokens and 0 for padding keys, which are hidden from
        every query.
    :param doc_ids: (B, T) from :func:`document_ids`: a query sees only keys of its own document.
    :param past_length: Keys already cached before these ``seq_len`` queries (incremental decoding): the queries
        sit at positions ``past_length ..``, and see every cached key.
    :param bias: OLMo's ``attention_bias``, (B or 1, 1 or H, >= L, >= L) for L = past_length + T, which replaces
        the causal mask: bool or int8 (true: may attend) or an additive float bias.
    :param window: A sliding window: the query at position ``i`` sees only the keys at ``i - window + 1 .. i``
        (``window`` keys, itself included; :mod:`olmo.config.attention_sections`).
    """
    if masks is not None:
        return masks.get(None)
    total = past_length + seq_len
    plain = attention_mask is None and doc_ids is None and bias is None and not config.alibi and window is None
    if plain and (past_length == 0 or seq_len == 1):
        return None
    if bias is not None:
        bias = bias[:, :, past_length:total, :total]  # the queries' rows
        if bias.dtype in (torch.bool, torch.int8, torch.uint8):
            allowed, additive = bias.bool(), torch.zeros((), device=device)
        else:
            allowed, additive = torch.ones((), dtype=torch.bool, device=device), bias.float()
    else:
        causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()[past_length:]  # (T, L)
        allowed, additive = causal[None, None], torch.zeros((), device=device)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]  # (B, 1, T, L)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])  # (B, 1, T, T)
    if window is not None:
        queries = torch.arange(past_length, total, device=device)[:, None]  # (T, 1)
        allowed = allowed & (torch.arange(total, device=device)[None, :] > queries - window)  # (T, L)
    if config.alibi:
        additive = additive + alibi_bias(config.n_heads, total, config.alibi_bias_max, device)[:, :, past_length:]
    return torch.where(allowed, additive, torch.finfo(torch.float).min)


def flash_varlen_attention(
    varlen_func: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: DocumentSpans,
    dropout_p: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each document with flash-attn's ``flash_attn_varlen_func``: q (B, H, T, hd),
    k/v (B, KV, T, hd) -> (B, T, H, hd). The kernel takes GQA as it is (query head h reads kv head h // (H / KV)).
    ``window``: each query sees only its last ``window`` keys (itself included)."""
    B, H, T, hd = q.shape
    extra = {} if window is None else {"window_size": (window - 1, 0)}
    y = varlen_func(
        q.transpose(1, 2).reshape(B * T, H, hd),  # (B*T, H, hd): the rows laid end to end
        k.transpose(1, 2).reshape(B * T, -1, hd),  # (B*T, KV, hd)
        v.transpose(1, 2).reshape(B * T, -1, hd),  # (B*T, KV, hd)
        spans.cu_seqlens,
        spans.cu_seqlens,
        spans.max_seqlen,
        spans.max_seqlen,
        dropout_p=dropout_p,
        causal=True,
        **extra,
    )  # (B*T, H, hd)
    return y.view(B, T, H, hd)


def describe_attention(
    config: ModelConfig, device: torch.device, dtype: torch.dtype | None, has_bias: bool, doc_masking: bool = False
) -> dict[str, Any]:
    """Which attention kernel a forward pass will run (mirrors ``olmo.model.attention_mixer._flash_usable``):
    flash-attn, or PyTorch SDPA and the kernel SDPA picks for this shape (asked of torch's private chooser).

    :param dtype: The autocast dtype, None for fp32.
    :param has_bias: Whether batches carry an attention mask or ALiBi bias.
    :param doc_masking: Whether batches carry ``doc_lens``: flash-attn's varlen kernel, or SDPA with a mask.
    """
    try:
        import flash_attn

        flash_version: str | None = flash_attn.__version__
    except ImportError:
        flash_version = None
    flash_runs = bool(
        config.flash_attention and flash_version and device.type == "cuda" and dtype is not None and not has_bias
    )
    flash_kernel = "flash_attn_varlen_func" if doc_masking else "flash_attn_func"
    head_dim = config.d_model // config.n_heads
    sdpa = None
    if not flash_runs:
        masked = has_bias or doc_masking
        shape = (1, config.n_heads, config.max_sequence_length, head_dim)  # (B, H, T, hd)
        q = torch.zeros(shape, device=device, dtype=dtype or torch.float32, requires_grad=True)
        bias = torch.zeros(1, 1, q.size(2), q.size(2), device=device, dtype=q.dtype) if masked else None
        try:
            choice = torch._fused_sdp_choice(q, q, q, bias, config.attention_dropout, not masked)
            sdpa = torch.nn.attention.SDPBackend(choice).name
        except Exception as e:  # a private API: report rather than fail
            sdpa = f"unknown ({type(e).__name__})"
    out = {
        "model.flash_attention": config.flash_attention,
        "flash_attn_version": flash_version,
        "backend": f"flash_attn.{flash_kernel}" if flash_runs else "torch SDPA",
        "sdpa_kernel": sdpa,
        "head_dim": head_dim,
    }
    from .flex_attention import flex_runs

    windows = [w for w in config.layer_windows() if w is not None and w < config.max_sequence_length]
    flex = flex_runs(config.attention_backend, device, flash_runs) and not config.alibi
    if flex and (windows or has_bias or doc_masking):
        out["masked_kernel"] = "FlexAttention (block-sparse)"
    if windows:
        # Windowed layers: flash-attn's window_size, FlexAttention skipping the blocks outside the window, or SDPA
        # with the window in its mask (all keys computed).
        out["windowed_layers"] = len(windows)
        out["window_kernel"] = (
            "flash-attn window_size" if flash_runs else "FlexAttention" if flex else "SDPA with a window mask"
        )
    return out
