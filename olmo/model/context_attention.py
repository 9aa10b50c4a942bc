"""The model's side of context parallelism (:mod:`olmo.distributed.context_parallel`): a rank holds two chunks of each
instance's tokens (one early, one late) and attends from each to the prefix of the sequence that ends with it.

:func:`context_parallel_inputs` gives, for each window size of the model, a :class:`ContextAttention` (the chunks,
their masks) and the RoPE tables of this rank's positions; a block's attention calls
:meth:`ContextAttention.attend` with its q, k and v. Plain causal attention needs no mask: each chunk attends to its
prefix with a causal mask aligned to the last key (``torch.nn.attention.bias.causal_lower_right``, which CUDA's
kernels apply without building it); documents, windows and padding build one mask per chunk, once per forward pass
and shared by the layers (as plain causal attention does on a CPU, where SDPA would build one per call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import ModelConfig
from .attention import check_doc_lens, document_ids
from .layers import RotaryTables

__all__ = ["ContextAttention", "ContextParallel", "context_parallel_inputs"]


class ContextParallel(Protocol):
    """What the model needs of context parallelism (:class:`olmo.distributed.context_parallel.ContextParallel`):
    ``degree`` ranks each hold a share of every instance's tokens."""

    degree: int

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(seq_len / degree,) the positions in the instance of this rank's tokens, in its order."""
        ...

    def chunks(self, seq_len: int) -> list[tuple[int, int]]:
        """This rank's chunks of an instance of ``seq_len`` tokens: (first local row, first position), in order."""
        ...

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``t`` along ``dim``, in the instance's order (autograd: gradients go back to their rank)."""
        ...


class _RopeTables(Protocol):
    def __call__(
        self, seq_len: int, device: torch.device, past: int = 0, scaled: bool = False
    ) -> RotaryTables: ...


SDPA = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]
"""``(q, k, v, mask) -> (B, Tq, H, hd)``: a block's attention kernel; ``mask`` an additive bias in q's dtype or a
``torch.nn.attention.bias.CausalBias``."""


@dataclass(frozen=True, eq=False)
class ContextAttention:
    """One window size's attention for this rank's chunks."""

    cp: ContextParallel
    chunks: tuple[tuple[int, int, int], ...]
    """Per chunk: its first local row, its length, and how many keys (from position 0) it attends to."""
    masks: tuple[torch.Tensor | None, ...]
    """Per chunk: an additive bias (B or 1, 1, length, keys) in q's dtype, or None for plain causal attention."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa: SDPA) -> torch.Tensor:
        """q (B, H, Tq, hd) of this rank's tokens, k/v (B, KV, Tq, hd) -> (B, Tq, H, hd), gathering every rank's
        keys and values."""
        k, v = self.cp.gather(k, dim=2), self.cp.gather(v, dim=2)  # (B, KV, T, hd), the instance's order
        out = []
        for (start, length, keys), mask in zip(self.chunks, self.masks):
            bias = _causal_lower_right(length, keys) if mask is None else mask
            out.append(sdpa(q[:, :, start : start + length], k[:, :, :keys], v[:, :, :keys], bias))
        return torch.cat(out, dim=1)


def context_parallel_inputs(
    config: ModelConfig,
    cp: ContextParallel,
    shape: tuple[int, int],
    device: torch.device,
    attention_mask: torch.Tensor | None,
    doc_lens: torch.Tensor | None,
    max_doc_lens: Sequence[int] | None,
    windows: Sequence[int],
    rope_tables: _RopeTables | None,
    dtype: torch.dtype,
) -> dict[int | None, tuple[ContextAttention, RotaryTables | None]]:
    """For this rank's ``shape`` = (B, T / degree) tokens, each window size's (:class:`ContextAttention`, RoPE tables
    of this rank's positions), keyed like ``OLMo.forward``'s attention inputs (None: the full-attention layers).

    Masks are built from positions in the instance: causal, within the window, within the document (``doc_lens`` and
    ``attention_mask`` cover the whole instance, (B, T)), in ``dtype`` (q's; every layer uses them without a copy).
    """
    B, T = shape[0], shape[1] * cp.degree
    chunk = shape[1] // len(cp.chunks(T))
    spans = tuple((row, chunk, first + chunk) for row, first in cp.chunks(T))
    ids = None
    if doc_lens is not None:
        doc_lens = doc_lens.to(device)
        check_doc_lens(doc_lens, torch.Size((B, T)), max_doc_lens)
        ids = document_ids(doc_lens, T)  # (B, T)

    def masks(window: int | None) -> tuple[torch.Tensor | None, ...]:
        if window is not None and window >= T:
            window = None  # the window hides nothing at this length
        if ids is None and attention_mask is None and window is None and device.type == "cuda":
            return (None,) * len(
                spans
            )  # causal_lower_right: CUDA's kernels need no mask (elsewhere SDPA builds one per call)
        out = []
        for _row, length, keys in spans:
            queries = torch.arange(keys - length, keys, device=device)  # this chunk's positions
            key_pos = torch.arange(keys, device=device)
            allowed = (key_pos[None, :] <= queries[:, None])[None, None]  # (1, 1, length, keys)
            if window is not None:
                allowed = allowed & (key_pos[None, :] > queries[:, None] - window)
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, None, :keys]
            if ids is not None:
                allowed = allowed & (ids[:, None, keys - length : keys, None] == ids[:, None, None, :keys])
            out.append(torch.where(allowed, torch.zeros((), device=device, dtype=dtype), torch.finfo(dtype).min))
        return tuple(out)

    positions = cp.positions(T, device)

    def rope(scaled: bool) -> RotaryTables | None:
        if rope_tables is None:
            return None
        cos, sin = rope_tables(T, device, scaled=scaled)
        return cos[positions], sin[positions]

    inputs: dict[int | None, tuple[ContextAttention, RotaryTables | None]] = {
        None: (ContextAttention(cp, spans, masks(None)), rope(config.rope_scaling is not None))
    }
    for window in windows:
        inputs[window] = (ContextAttention(cp, spans, masks(window)), rope(False))
    return inputs


def _causal_lower_right(queries: int, keys: int) -> Any:
    """``torch.nn.attention.bias.causal_lower_right``, imported when first needed: that module loads torch's compiler
    (see :mod:`olmo.model.compile_guards`)."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(queries, keys)
