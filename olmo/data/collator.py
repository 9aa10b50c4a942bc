"""Turn a list of instances into a batch of tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import TrainConfig
from ..exceptions import OLMoConfigurationError

__all__ = ["DataCollator"]


@dataclass
class DataCollator:
    """Stack instances into a batch, padding each to the longest ``input_ids`` in it.

    ``input_ids`` are padded with ``pad_token_id``, ``label_mask`` with False and ``attention_mask`` with 0,
    on the side ``pad_direction`` names. ``index`` becomes a long tensor and ``metadata`` a list. Memmap
    instances all have the same length, so pretraining batches need no padding.

    :param pad_direction: ``"right"`` or ``"left"`` (``data.pad_direction``).
    :param pad_token_id: the token id used to pad ``input_ids`` (``model.pad_token_id``).
    """

    pad_direction: str = "right"
    pad_token_id: int = 1

    def __post_init__(self) -> None:
        if self.pad_direction not in ("right", "left"):
            raise OLMoConfigurationError(
                f"data.pad_direction={self.pad_direction!r} is not a padding side; use 'right' or 'left'."
            )

    @classmethod
    def from_train_config(cls, train_config: TrainConfig) -> DataCollator:
        """The collator for ``train_config``: its ``data.pad_direction`` and ``model.pad_token_id`` (OLMo's API)."""
        return cls(pad_direction=train_config.data.pad_direction, pad_token_id=train_config.model.pad_token_id)

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        max_len = max(len(item["input_ids"]) for item in items)
        batch: dict[str, Any] = {"input_ids": self._stack(items, "input_ids", self.pad_token_id, max_len)}
        for key, pad_value in (("label_mask", False), ("attention_mask", 0)):
            if key in items[0]:
                batch[key] = self._stack(items, key, pad_value, max_len)
        if "index" in items[0]:
            batch["index"] = torch.tensor([int(item["index"]) for item in items], dtype=torch.long)
        if "metadata" in items[0]:
            batch["metadata"] = [item["metadata"] for item in items]
        return batch

    def _stack(self, items: list[dict[str, Any]], key: str, pad_value: int | bool, max_len: int) -> torch.Tensor:
        rows = [torch.as_tensor(item[key]) for item in items]
        if all(len(row) == max_len for row in rows):  # pretraining: nothing to pad, stack directly
            stacked = torch.stack(rows)
            return stacked.long() if key == "input_ids" else stacked
        padded = []
        for row in rows:
            if key == "input_ids":
                row = row.long()
            filler = torch.full((max_len - len(row),), pad_value, dtype=row.dtype)
            padded.append(torch.cat([row, filler] if self.pad_direction == "right" else [filler, row]))
        return torch.stack(padded)
