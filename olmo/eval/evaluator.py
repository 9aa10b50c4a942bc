"""What every evaluator shares: the :class:`Evaluator` interface (eval mode, ``no_grad``, autocast, the
previous training mode restored), how a rank picks its share of the data, and forward passes kept in
step across ranks."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..collectives import all_reduce

__all__ = ["Evaluator", "rank_order", "forward_in_lockstep"]


class Evaluator(abc.ABC):
    """Computes the metrics of one ``evaluators`` entry of the config.

    Every rank calls :meth:`evaluate` with the same model; each scores its own share of the data and the
    results are summed over ranks, so every rank returns the same metrics.

    :param label: ``EvaluatorConfig.label``.
    :param batch_size: instances per forward pass (``device_eval_batch_size``).
    :param subset_num_batches: forward passes per rank; -1 (or any value below 1) evaluates everything.
    :param world_size: number of ranks sharing the work.
    :param rank: this process's rank.
    :param seed: seed of the fixed order in which instances are dealt to ranks (see :func:`rank_order`).
    """

    def __init__(
        self,
        label: str,
        *,
        batch_size: int,
        subset_num_batches: int = -1,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
    ):
        assert batch_size > 0 and 0 <= rank < world_size, (batch_size, rank, world_size)
        self.label = label
        self.batch_size = batch_size
        self.subset_num_batches = subset_num_batches
        self.world_size = world_size
        self.rank = rank
        self.seed = seed

    def evaluate(
        self, model: nn.Module, device: torch.device, autocast_dtype: Optional[torch.dtype] = None
    ) -> dict[str, float]:
        """Evaluate ``model`` and return ``{metric name: value}`` (the same on every rank).

        Runs in ``model.eval()`` mode under ``torch.no_grad()`` and, if ``autocast_dtype`` is given, under
        autocast to that dtype; the model's previous training mode is restored afterwards. Every rank must
        call this (it all-reduces, and with FSDP every forward pass is a collective).
        """
        was_training = model.training
        model.eval()
        try:
            with (
                torch.no_grad(),
                torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
            ):
                return self._evaluate(model, device)
        finally:
            model.train(was_training)

    @property
    def max_instances(self) -> Optional[int]:
        """Instances this rank may score (None: all of its share)."""
        return self.subset_num_batches * self.batch_size if self.subset_num_batches > 0 else None

    @abc.abstractmethod
    def _evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Score this rank's share, reduce over ranks, and return the metrics."""


def rank_order(n: int, seed: int, world_size: int, rank: int) -> list[int]:
    """Rank ``rank``'s share of ``n`` items: entries ``rank, rank + W, ...`` of a seeded permutation.

    The shares are disjoint and cover every item. The permutation is the same at every evaluation, so a
    subset (``subset_num_batches``) is the same sample every time and, unlike the first batches in file
    order, draws from every file and label.
    """
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[rank::world_size].tolist()


def forward_in_lockstep(
    model: nn.Module, batches: Iterable[dict[str, Any]], num_batches: int, device: torch.device
) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """Yield ``(batch, logits)`` for each of this rank's ``num_batches`` batches.

    Ranks can hold different numbers of batches. With FSDP every forward pass gathers parameters from
    all ranks, so a rank that stopped early would leave the others waiting forever: a rank that runs out
    makes one-token dummy passes until every rank has made as many passes as the busiest one.
    """
    steps = torch.tensor(num_batches, device=device)
    all_reduce(steps, dist.ReduceOp.MAX)
    it = iter(batches)
    for step in range(int(steps)):
        if step < num_batches:
            batch = next(it)
            mask = batch.get("attention_mask")
            logits = model(
                batch["input_ids"].to(device), attention_mask=None if mask is None else mask.to(device)
            ).logits  # (B, T, embedding_size)
            assert logits is not None  # only a fused loss leaves them out
            yield batch, logits
        else:
            model(torch.zeros((1, 1), dtype=torch.long, device=device))
