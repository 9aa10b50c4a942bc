"""Context parallelism (``context_parallel.degree``): each instance's tokens split over the ranks of a group, keys
and values all-gathered in every attention layer (OLMo-core's "llama3" scheme), composed with FSDP2 over every rank.

The layout, for ``W`` ranks and degree ``D`` (``D`` divides ``W``; ``2 * D`` divides the sequence length ``T``):

- **Groups**: the ``cp`` dimension of the layout's data mesh (:attr:`olmo.distributed.layout.ParallelLayout.context_parallel`):
  ``D`` consecutive ranks (``T`` apart with tensor parallelism of degree ``T``) read the same instances.
- **Tokens**: the sequence is cut into ``2 * D`` chunks of ``T / (2 D)`` tokens; place ``j`` holds chunks ``j`` and
  ``2 D - 1 - j`` (:meth:`ContextParallel.positions`), so under the causal mask every rank does the same work.
  Inputs and labels are cut in the train module (:meth:`ContextParallel.shard`), before the labels are counted,
  so the loss normalization (``sum(CE) * W / n_labels``, :mod:`olmo.train.train_module`) already covers the whole
  sequence and FSDP's average over all ``W`` ranks gives the full gradient.
- **Attention**: each rank computes q, k and v of its own tokens (RoPE at their positions in the instance), then
  gathers every rank's k and v in the instance's order (:meth:`ContextParallel.gather`; its backward sums the
  gradients back to their rank), and each of its chunks attends to the prefix of the sequence that ends with it:
  causal aligned to the last key, and within the document (``doc_lens`` of the whole instance) and the window
  (:mod:`olmo.model.context_attention`).
- **Parameters** are what FSDP makes them without context parallelism: a checkpoint does not depend on ``D``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..model.compile_guards import eager_in_compiled
from .collectives import all_gather_dim0, reduce_scatter_dim0

__all__ = ["ContextParallel", "load_balanced_positions"]


def load_balanced_positions(seq_len: int, degree: int, rank: int) -> torch.Tensor:
    """(seq_len / degree,) the positions of the tokens place ``rank`` of a group holds: chunks ``rank`` and
    ``2 * degree - 1 - rank`` of ``2 * degree``."""
    chunk = seq_len // (2 * degree)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    last = torch.arange((2 * degree - 1 - rank) * chunk, (2 * degree - rank) * chunk)
    return torch.cat([first, last])


@dataclass(eq=False)
class ContextParallel:
    """What the model and the train module need to know of context parallelism."""

    degree: int
    rank: int
    """This rank's place in its group."""
    group: dist.ProcessGroup | None
    """The ``degree`` ranks sharing the instances (None only for degree 1, in tests)."""
    _positions: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(seq_len / degree,) positions, in the instance of ``seq_len`` tokens, of this rank's tokens (cached per
        length and device)."""
        key = (seq_len, device)
        if key not in self._positions:
            self._positions[key] = load_balanced_positions(seq_len, self.degree, self.rank).to(device)
        return self._positions[key]

    def chunks(self, seq_len: int) -> list[tuple[int, int]]:
        """This rank's two chunks: (first local row, first position in the instance) of each, in local order."""
        chunk = seq_len // (2 * self.degree)
        return [(0, self.rank * chunk), (chunk, (2 * self.degree - 1 - self.rank) * chunk)]

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``t``, whose dimension ``dim`` is the whole sequence."""
        return t.index_select(dim, self.positions(t.size(dim), t.device))

    @eager_in_compiled  # a collective: left to eager mode inside a compiled block
    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``t`` (its tokens along ``dim`` >= 0) as the whole instance, in the instance's order; the
        backward pass sends each rank the summed gradient of its own part."""
        if self.degree == 1 or self.group is None:
            return t
        stacked = _GatherParts.apply(t, self)  # (degree, *t.shape): place j holds chunks j and 2 degree - 1 - j
        early, late = stacked.chunk(2, dim=dim + 1)
        # One copy: chunks 0 .. degree - 1 are the places' early halves, the rest their late halves in reverse.
        parts = [early[j] for j in range(self.degree)] + [late[j] for j in reversed(range(self.degree))]
        return torch.cat(parts, dim=dim)


class _GatherParts(torch.autograd.Function):
    """Forward: every rank's tensor, stacked in rank order. Backward: the gradients of this rank's part summed over
    the ranks (a reduce-scatter on NCCL; on gloo, which has none, an all-reduce of which each rank keeps its part)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        out = t.new_empty((cp.degree * t.shape[0], *t.shape[1:]))
        all_gather_dim0(out, t.contiguous(), group=cp.group)
        return out.view(cp.degree, *t.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        cp: ContextParallel = ctx.cp
        grad = grad.contiguous()
        if dist.get_backend(cp.group) == dist.Backend.NCCL:
            mine = grad.new_empty(grad.shape[1:])
            reduce_scatter_dim0(mine, grad.flatten(0, 1), group=cp.group)
            return mine, None
        dist.all_reduce(grad, group=cp.group)
        return grad[cp.rank], None
