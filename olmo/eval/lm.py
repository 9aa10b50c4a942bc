"""Language-model evaluation: cross entropy and perplexity over token memmaps, per dataset label."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ..data import DataCollator, InstanceStream, MemMapDataset
from ..distributed.collectives import all_reduce
from .evaluator import EvalTarget, Evaluator, forward_in_lockstep, rank_order

__all__ = ["LMEvaluator"]

log = logging.getLogger(__name__)


class LMEvaluator(Evaluator):
    """Cross entropy and perplexity of next-token prediction over memmap instances.

    Returns ``eval/{label}/CrossEntropyLoss`` and ``eval/{label}/Perplexity`` for every dataset label
    (the keys of ``data.datasets``, or the evaluator label for ``data.paths``) that has scored tokens.

    The cross entropy is token-weighted over the whole set: every rank sums its per-token losses and
    counts its scored tokens per label, both sums are all-reduced, and only then divided. This differs
    from OLMo, which averages per-instance mean losses (a torchmetrics ``MeanMetric``); the two agree
    when every instance has the same number of scored tokens (no label or attention masks) and differ
    otherwise, where OLMo gives short instances the weight of long ones.

    :param dataset: the instances, with ``metadata`` (``build_memmap_dataset(..., include_instance_metadata=True)``).
    :param dataset_labels: every label the instances' ``metadata["label"]`` can hold; instances without
        one count under ``label``. Default: ``[label]``.
    :param num_workers: DataLoader worker processes (``data.num_workers``).
    :param collator: pads batches (``data.pad_direction``, ``model.pad_token_id``).

    The other parameters are those of :class:`Evaluator`.
    """

    def __init__(
        self,
        label: str,
        dataset: MemMapDataset,
        *,
        dataset_labels: Optional[Sequence[str]] = None,
        batch_size: int,
        subset_num_batches: int = -1,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        num_workers: int = 0,
        collator: Optional[DataCollator] = None,
    ):
        super().__init__(
            label,
            batch_size=batch_size,
            subset_num_batches=subset_num_batches,
            world_size=world_size,
            rank=rank,
            seed=seed,
        )
        self.dataset = dataset
        self.dataset_labels = list(dataset_labels or [label])
        self.num_workers = num_workers
        self.collator = collator or DataCollator()

    def instance_indices(self) -> list[int]:
        """The dataset indices this rank scores, in order (its share, cut to ``subset_num_batches``)."""
        return rank_order(len(self.dataset), self.seed, self.world_size, self.rank)[: self.max_instances]

    def _evaluate(self, target: EvalTarget, device: torch.device) -> dict[str, float]:
        loader = DataLoader(
            InstanceStream(self.dataset, self.instance_indices(), self.batch_size),  # remote files: fetched ahead
            batch_size=self.batch_size,
            collate_fn=self.collator,
            num_workers=self.num_workers,
        )
        row_of = {name: i for i, name in enumerate(self.dataset_labels)}
        totals = torch.zeros(len(row_of), 2, dtype=torch.float64, device=device)  # (loss sum, tokens) per label
        for batch, logits in forward_in_lockstep(target, loader, len(loader), device, self.label):
            loss_sum, n_tokens = _instance_losses(batch, logits)  # (B,), (B,)
            rows = torch.tensor(
                [row_of[_label_of(batch, i, self.label)] for i in range(len(loss_sum))], device=device
            )
            totals.index_add_(0, rows, torch.stack([loss_sum, n_tokens], dim=1).double())
        all_reduce(totals)
        metrics: dict[str, float] = {}
        for name, (loss_sum, n_tokens) in zip(self.dataset_labels, totals.tolist()):
            if n_tokens == 0:
                log.warning("Evaluator %r scored no tokens of %r; raise subset_num_batches.", self.label, name)
                continue
            ce = loss_sum / n_tokens
            metrics[f"eval/{name}/CrossEntropyLoss"] = ce
            metrics[f"eval/{name}/Perplexity"] = math.exp(ce)
        return metrics


def _label_of(batch: dict[str, Any], i: int, default: str) -> str:
    metadata = batch.get("metadata")
    return default if metadata is None else metadata[i].get("label", default)


def _instance_losses(batch: dict[str, Any], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per instance: the sum of next-token cross entropies and the number of scored targets.

    Targets are the inputs shifted by one; those whose position is masked out by ``label_mask`` or
    ``attention_mask`` are not scored.
    """
    input_ids = batch["input_ids"].to(logits.device)
    targets = input_ids[:, 1:]  # (B, T-1)
    scored = torch.ones_like(targets, dtype=torch.bool)
    for key in ("label_mask", "attention_mask"):
        if key in batch:
            scored &= batch[key][:, 1:].to(logits.device).bool()
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    ce = ce.view_as(targets) * scored  # (B, T-1)
    return ce.sum(dim=1), scored.sum(dim=1)
