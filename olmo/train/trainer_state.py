"""Where training is (:class:`TrainerState`): the step, the tokens trained on, the epoch and the data position in
it. One object owns it and everything that moves it goes through its methods: the trainer advances it a step at a
time and restores it from a checkpoint, the data feed moves it to the next epoch or past a skipped range."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TrainerState"]


@dataclass
class TrainerState:
    """Where training is. The data position is a global instance count, so it survives a change of world size or
    micro-batch size."""

    global_step: int = 0
    global_train_examples_seen_this_epoch: int = 0
    global_train_tokens_seen: int = 0
    epoch: int = 0

    def advance(self, instances: int, tokens: int) -> None:
        """One step trained on ``instances`` instances (the global batch) of ``tokens`` tokens."""
        self.global_step += 1
        self.global_train_examples_seen_this_epoch += instances
        self.global_train_tokens_seen += tokens

    def start_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` from its first instance (the next epoch, a new stage's data, ``--epoch``)."""
        self.epoch, self.global_train_examples_seen_this_epoch = epoch, 0

    def skip_to(self, instance: int) -> None:
        """Read on from instance ``instance`` of this epoch (past a skipped range, ``--fast_forward_batches``)."""
        self.global_train_examples_seen_this_epoch = instance

    def restore(self, saved: dict[str, Any]) -> None:
        """The position of a checkpoint's trainer state."""
        self.global_step = int(saved["global_step"])
        self.global_train_tokens_seen = int(saved["global_train_tokens_seen"])
        self.global_train_examples_seen_this_epoch = int(saved["global_train_examples_seen_this_epoch"])
        self.epoch = int(saved.get("epoch") or 0)
