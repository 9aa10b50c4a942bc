"""The training data as the loop reads it (:class:`DataFeed`): the current data segment's loader, its epochs, and
the ranges of batches a rollback took out (``skipped_batches.json``), which are jumped over. The position itself
is the trainer's :class:`~olmo.train.trainer_state.TrainerState` (a global instance count within the segment's epoch),
which the feed advances at the end of an epoch and past a skipped range."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..config import ModelConfig
from ..data import DataContext, FetchStats, IterableDataset
from ..distributed.layout import ParallelLayout
from .stability import StabilityMonitor
from .stages import Stage, StagePlan, build_stage_dataloader, order_dir_of

if TYPE_CHECKING:
    from .trainer_state import TrainerState

__all__ = ["DataFeed"]

log = logging.getLogger(__name__)


class DataFeed:
    """The batches of the current stage's data for the loop.

    :param model, data_context: what a stage's loader is built from (a stage with data of its own gets a new one).
    :param batch_size: ``global_train_batch_size``: instances of each step, over all ranks.
    :param save_folder: the run's folder, where each stage's data order lives.
    :param state: the trainer's position, read and advanced here.
    :param train_loader: the first stage's loader.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        state: TrainerState,
        stage_plan: StagePlan,
        stability: StabilityMonitor,
        train_loader: torch.utils.data.DataLoader,
        *,
        model: ModelConfig,
        data_context: DataContext,
        batch_size: int,
        save_folder: str,
    ):
        self.model_config, self.data_context = model, data_context
        self.batch_size, self.save_folder = batch_size, save_folder
        self.layout, self.state, self.stage_plan, self.stability = layout, state, stage_plan, stability
        self.loader = train_loader
        self.dataset: IterableDataset = train_loader.dataset  # type: ignore[assignment]
        self.segment = stage_plan.stages[0].segment  # train_loader is the first stage's data

    def use_segment(self, stage: Stage) -> None:
        """Train on the data of ``stage``'s segment (a new loader, at the start of its epoch 0)."""
        if stage.segment == self.segment:
            return
        log.info(
            "Stage %d trains on its own data (order in %s).",
            stage.index,
            order_dir_of(self.save_folder, stage),
        )
        self.loader = build_stage_dataloader(
            self.model_config,
            self.data_context,
            stage,
            self.layout.data_parallel_size,
            self.layout.data_parallel_rank,
        )
        self.dataset = self.loader.dataset  # type: ignore[assignment]
        self.segment = stage.segment

    def batches(self, stop_at: int) -> Iterator[dict[str, Any]]:
        """Device batches forever, moving to the next epoch (reshuffled) when one runs out, and over the ranges of
        batches a rollback took out (``skipped_batches.json``); remote instances are fetched ahead only as far as
        ``stop_at`` (the step this launch stops at)."""
        while True:
            s = self.state
            if self.jump_skipped_range():
                self.dataset.start_index = s.global_train_examples_seen_this_epoch
            remaining = (stop_at - s.global_step) * self.batch_size
            self.dataset.stop_index = s.global_train_examples_seen_this_epoch + remaining
            jumped = False
            for batch in self.loader:
                yield batch
                if self.stability.ranges and self.jump_skipped_range():
                    self.dataset.start_index, jumped = s.global_train_examples_seen_this_epoch, True
                    break  # the loader restarts after the range
            if jumped:
                continue
            self.state.start_epoch(self.state.epoch + 1)
            log.info("Epoch %d complete; starting epoch %d.", self.state.epoch - 1, self.state.epoch)
            self.dataset.reshuffle(self.state.epoch)

    def jump_skipped_range(self) -> bool:
        """Move the data position past a skipped range that starts here; return whether it moved."""
        s = self.state
        order_dir = self.stage_plan.at(s.global_step + 1).order_dir
        target = self.stability.skip_target(order_dir, s.epoch, s.global_train_examples_seen_this_epoch)
        if target is None:
            return False
        log.info(
            "Skipping instances %d-%d of epoch %d (a range a rollback took out; %s).",
            s.global_train_examples_seen_this_epoch,
            target - 1,
            s.epoch,
            "skipped_batches.json",
        )
        s.skip_to(target)
        return True

    def fetch_stats(self) -> Optional[FetchStats]:
        """What reading the current training data costs, when it is remote."""
        return getattr(self.dataset.dataset, "fetch_stats", None)

    def instances_of(self, step: int) -> Optional[list[int]]:
        """The instance indices of the global batch of a recent ``step`` (for logging a skipped step)."""
        found = self.stability.position_of(step)
        if found is None or found[1] != self.dataset.epoch:
            return None
        position = found[2]
        return [int(i) for i in self.dataset.global_indices()[position : position + self.batch_size]]
