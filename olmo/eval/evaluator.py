"""What every evaluator shares: the :class:`Evaluator` interface (eval mode, ``no_grad``, the previous training
mode restored), how a rank picks its share of the data, forward passes kept in step across ranks, and the
:class:`EvalRunner` that runs the evaluators on the trainer's schedule.

Evaluators run forward passes through an :class:`EvalTarget`'s ``eval_batch``: in training that is the
:class:`~olmo.train.train_module.TrainModule` (so a custom train module decides how it is evaluated); for a bare model
(``scripts/eval.py``, tests) :class:`ModelEval` is the target.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Protocol, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.collectives import all_reduce
from ..exceptions import OLMoConfigurationError
from ..model.loss import per_token_cross_entropy
from ..util.progress import ProgressLog
from ..util.rng import rng_preserved

__all__ = ["Evaluator", "EvalTarget", "ModelEval", "EvalRunner", "rank_order", "forward_in_lockstep"]

log = logging.getLogger(__name__)


class EvalTarget(Protocol):
    """What evaluators run: a ``model`` (put in eval mode while they run) and ``eval_batch(batch)``, the logits
    (B, T, V) of a batch's ``input_ids`` (and ``attention_mask``), under ``no_grad``. A TrainModule is one."""

    model: nn.Module

    def eval_batch(self, batch: dict[str, Any], labels: Optional[torch.Tensor] = None) -> torch.Tensor: ...


class ModelEval:
    """The :class:`EvalTarget` of a bare model: its forward pass on ``device``, under autocast to
    ``autocast_dtype`` when given."""

    def __init__(self, model: nn.Module, device: torch.device, autocast_dtype: Optional[torch.dtype] = None):
        self.model, self.device, self.autocast_dtype = model, device, autocast_dtype

    def eval_batch(self, batch: dict[str, Any], labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits (B, T, V), or with ``labels`` the per-token cross entropy (B, T; 0 where a label is -100)."""
        device, dtype, mask = self.device, self.autocast_dtype, batch.get("attention_mask")
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = self.model(
                batch["input_ids"].to(device), attention_mask=None if mask is None else mask.to(device)
            ).logits
        return logits if labels is None else per_token_cross_entropy(logits, labels.to(device))


def as_eval_target(
    target: Union[nn.Module, EvalTarget], device: torch.device, autocast_dtype: Optional[torch.dtype] = None
) -> EvalTarget:
    """``target`` itself, or a bare model wrapped in :class:`ModelEval`."""
    if isinstance(target, nn.Module):
        return ModelEval(target, device, autocast_dtype)
    assert autocast_dtype is None, "a train module evaluates under its own autocast"
    return target


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
        self.records: dict[str, Any] = {}
        """Results that are not numbers, from the last :meth:`evaluate` (``{key: JSON value}``)."""

    def evaluate(
        self,
        target: Union[nn.Module, EvalTarget],
        device: torch.device,
        autocast_dtype: Optional[torch.dtype] = None,
    ) -> dict[str, float]:
        """Evaluate ``target`` (a train module, or a bare model run under autocast to ``autocast_dtype`` when
        given) and return ``{metric name: value}`` (the same on every rank).

        Runs with the model in eval mode under ``torch.no_grad()``; its previous training mode is restored
        afterwards. Every rank must call this (it all-reduces, and with FSDP every forward pass is a collective).
        """
        target = as_eval_target(target, device, autocast_dtype)
        was_training = target.model.training
        target.model.eval()
        try:
            with torch.no_grad():
                return self._evaluate(target, device)
        finally:
            target.model.train(was_training)

    @property
    def max_instances(self) -> Optional[int]:
        """Instances this rank may score (None: all of its share)."""
        return self.subset_num_batches * self.batch_size if self.subset_num_batches > 0 else None

    @abc.abstractmethod
    def _evaluate(self, target: EvalTarget, device: torch.device) -> dict[str, float]:
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
    target: EvalTarget, batches: Iterable[dict[str, Any]], num_batches: int, device: torch.device, label: str = ""
) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """Yield ``(batch, logits)`` for each of this rank's ``num_batches`` batches, logging the progress of a long
    evaluation (``label``) every 30 seconds.

    Ranks can hold different numbers of batches. With FSDP every forward pass gathers parameters from
    all ranks, so a rank that stopped early would leave the others waiting forever: a rank that runs out
    makes one-token dummy passes until every rank has made as many passes as the busiest one.
    """
    steps = torch.tensor(num_batches, device=device)
    all_reduce(steps, dist.ReduceOp.MAX)
    it = iter(batches)
    progress = ProgressLog(f"Evaluating {label or 'batches'}", int(steps), "batches", log)
    for step in range(int(steps)):
        progress.update(step)
        if step < num_batches:
            batch = next(it)
            logits = target.eval_batch(batch)  # (B, T, embedding_size)
            assert logits is not None  # only a fused loss leaves them out
            yield batch, logits
        else:
            target.eval_batch({"input_ids": torch.zeros((1, 1), dtype=torch.long, device=device)})
    progress.update(int(steps))


class EvalRunner:
    """Runs the evaluators every ``interval`` steps and at the last step (all ranks together), through the train
    module's ``eval_batch``; each ``eval/...`` metric plus ``eval/seconds``."""

    def __init__(self, evaluators: Sequence[Evaluator], interval: int):
        self.evaluators, self.interval = list(evaluators), interval
        self.records: dict[str, Any] = {}
        """What the last :meth:`run`'s evaluators produced besides numbers (e.g. generated texts)."""

    def check_batch_size(self, rank_batch_size: int) -> None:
        """Refuse an evaluator whose batches are larger than the train module's ``eval_batch_spec`` allows."""
        for i, evaluator in enumerate(self.evaluators):
            if evaluator.batch_size > rank_batch_size:
                raise OLMoConfigurationError(
                    f"evaluators[{i}] ({evaluator.label!r}) makes batches of {evaluator.batch_size} instances, but "
                    f"the train module's eval_batch takes at most {rank_batch_size} (its eval_batch_spec). Set "
                    f"evaluators[{i}].device_eval_batch_size (or device_eval_batch_size) to {rank_batch_size} or less."
                )

    def due(self, step: int, last_step: int, force: bool = False) -> bool:
        """Whether to evaluate after ``step`` (``force``: now, e.g. right after a restore with ``eval_on_load``)."""
        return bool(self.evaluators) and (force or step % self.interval == 0 or step >= last_step)

    def run(self, train_module: Any, device: torch.device) -> dict[str, float]:
        """Every evaluator's metrics; the train module's gradients are freed first, to make room. Every RNG is put
        back afterwards, so evaluating never changes the training run's random draws (dropout)."""
        start, metrics = time.perf_counter(), {}
        train_module.zero_grads()
        self.records = {}
        with rng_preserved():
            for evaluator in self.evaluators:
                metrics.update(evaluator.evaluate(train_module, device))
                self.records.update(evaluator.records)
        metrics["eval/seconds"] = time.perf_counter() - start
        return metrics
