"""What a train module sees of the trainer that drives it (:class:`StepHost`), and the shape of the batches its
evaluation takes (:class:`EvalBatchSpec`); re-exported by :mod:`olmo.train.train_module`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..distributed.collectives import DistEnv
from ..distributed.layout import ParallelLayout
from .metrics import ReduceType

__all__ = ["EvalBatchSpec", "StepHost"]


@dataclass(frozen=True)
class EvalBatchSpec:
    """The batches :meth:`TrainModule.eval_batch` takes on each rank."""

    rank_batch_size: int
    """Instances per call, at most."""
    max_sequence_length: Optional[int] = None
    """Tokens per instance, at most (None: no limit of the module's own)."""


class StepHost(Protocol):
    """What a train module may read of, and hand to, the trainer that drives it (:class:`olmo.train.Trainer`
    implements it): the run's process group and layout, where the run is, and three ways to report back. Nothing
    else of the trainer is the module's business."""

    env: DistEnv
    layout: ParallelLayout
    """How the ranks are arranged: what each reads, its context-parallel group, the meshes."""
    max_steps: int
    """The run's length in optimizer steps (all stages)."""

    @property
    def evaluator_batches(self) -> EvalBatchSpec:
        """The largest batch the run's evaluators make (``device_eval_batch_size``, each evaluator's own) of up to
        ``model.max_sequence_length`` tokens."""

    @property
    def global_step(self) -> int:
        """The step being trained, counted from 1 (between steps: the last one trained)."""

    @property
    def tokens_seen(self) -> int:
        """Tokens trained on in the run, all ranks, including the step being trained."""

    @property
    def restored_path(self) -> Optional[str]:
        """The checkpoint this launch restored, if any."""

    def add_step_metrics(
        self,
        learning_rate: float,
        ce_sum: torch.Tensor,
        z_sum: torch.Tensor,
        n_labels: torch.Tensor,
        grad_norm: torch.Tensor,
        extra: dict[str, tuple[torch.Tensor, ReduceType]],
        applied: Optional[torch.Tensor],
    ) -> None:
        """Queue the step's metrics (device values), read back at the next collection."""

    def count_filtered(self, step: int, count: torch.Tensor) -> None:
        """Instances of the global batch of ``step`` that the instance filter dropped (a device count)."""

    def local_work(self) -> contextlib.AbstractContextManager[None]:
        """A block of this rank's own work, timed to find a slow rank (``stability.stragglers``)."""
