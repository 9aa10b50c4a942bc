"""Turn a list of instances into a batch of tensors, and check a batch's token ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import CustomDatasetCollatorConfig, PaddingDirection, TrainConfig
from ..exceptions import OLMoConfigurationError, OLMoDataError

__all__ = ["DataCollator", "CustomDatasetDataCollator", "PaddingDirection", "check_token_ids"]


@dataclass
class DataCollator:
    """Stack instances into a batch, padding each to the longest ``input_ids`` in it.

    ``input_ids`` are padded with ``pad_token_id``, ``label_mask`` with False and ``attention_mask`` with 0,
    on the side ``pad_direction`` names; an instance may also be a bare sequence of token ids. An ``attention_bias``
    (T, T) is padded on both axes (with False, or the lowest float) into a (B, 1, L, L) tensor. ``index`` becomes a long tensor, ``instance_mask`` a bool tensor and
    ``metadata`` a list. ``doc_lens`` become a long tensor (B, most documents in an instance), padded with 0,
    and ``max_doc_lens`` lists each instance's longest document (ints, as in OLMo, so that the model sizes its
    kernels without reading a device tensor back). Memmap instances all have the same length, so pretraining
    batches need no padding.

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

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        items = [item if isinstance(item, dict) else {"input_ids": item} for item in items]
        max_len = max(len(item["input_ids"]) for item in items)
        batch: dict[str, Any] = {"input_ids": self._stack(items, "input_ids", self.pad_token_id, max_len)}
        for key, pad_value in (("label_mask", False), ("attention_mask", 0)):
            if key in items[0]:
                batch[key] = self._stack(items, key, pad_value, max_len)
        if items[0].get("attention_bias") is not None:
            batch["attention_bias"] = torch.stack(
                [self._pad_bias(item["attention_bias"], max_len) for item in items]
            )
        if "index" in items[0]:
            batch["index"] = torch.tensor([int(item["index"]) for item in items], dtype=torch.long)
        if "source_id" in items[0]:  # a mixture's source of each instance (per-source losses)
            batch["source_id"] = torch.tensor([int(item["source_id"]) for item in items], dtype=torch.long)
        if "instance_mask" in items[0]:
            batch["instance_mask"] = torch.tensor(
                [bool(item["instance_mask"]) for item in items], dtype=torch.bool
            )
        if "doc_lens" in items[0]:
            doc_lens = [self._with_padding(item, max_len) for item in items]
            batch["doc_lens"] = torch.nn.utils.rnn.pad_sequence(doc_lens, batch_first=True, padding_value=0)
            batch["max_doc_lens"] = [int(lens.max()) for lens in doc_lens]
        if "metadata" in items[0]:
            batch["metadata"] = [item["metadata"] for item in items]
        return batch

    def _with_padding(self, item: dict[str, Any], max_len: int) -> torch.Tensor:
        """An instance's document lengths, with the padding it gets here as one more document (on the padded
        side), so the lengths still sum to the padded length."""
        lens = torch.as_tensor(item["doc_lens"], dtype=torch.long)
        pad = max_len - len(item["input_ids"])
        if pad == 0:
            return lens
        filler = torch.tensor([pad], dtype=torch.long)
        return torch.cat([lens, filler] if self.pad_direction == "right" else [filler, lens])

    def _pad_bias(self, bias: Any, max_len: int) -> torch.Tensor:
        """A (T, T) or (1, T, T) attention bias padded to (1, max_len, max_len) on the padded side."""
        bias = torch.as_tensor(bias)
        if bias.dim() == 2:
            bias = bias.unsqueeze(0)
        pad = max_len - bias.size(-1)
        if pad == 0:
            return bias
        value: Any = False if bias.dtype == torch.bool else torch.finfo(bias.dtype).min
        sides = (0, pad, 0, pad) if self.pad_direction == "right" else (pad, 0, pad, 0)
        return torch.nn.functional.pad(bias, sides, value=value)

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


@dataclass
class CustomDatasetDataCollator(DataCollator):
    """A :class:`DataCollator` for items whose fields have other names (OLMo's ``CustomDatasetDataCollator``):
    ``collate_config`` maps each to the name the model takes (``input_id_field`` -> ``input_ids``, ...)."""

    collate_config: CustomDatasetCollatorConfig = field(default_factory=CustomDatasetCollatorConfig)

    _TARGETS = {
        "input_id_field": "input_ids",
        "attention_mask_field": "attention_mask",
        "attention_bias_field": "attention_bias",
        "label_mask_field": "label_mask",
        "index_field": "index",
        "instance_mask_field": "instance_mask",
        "doc_lens_field": "doc_lens",
        "metadata_field": "metadata",
    }

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        renamed = []
        for item in items:
            if not isinstance(item, dict):
                renamed.append(item)
                continue
            out = {}
            for attribute, target in self._TARGETS.items():
                source = getattr(self.collate_config, attribute)
                if source is not None and source in item:
                    out[target] = item[source]
            renamed.append(out)
        return super().__call__(renamed)


def check_token_ids(batch: dict[str, Any], vocab_size: int, step: int) -> None:
    """Raise :class:`OLMoDataError` naming the instance when a token id of ``batch`` is outside the vocabulary."""
    ids = batch["input_ids"]
    if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
        bad_row = int(((ids >= vocab_size) | (ids < 0)).any(dim=1).nonzero()[0])
        index = int(batch["index"][bad_row]) if "index" in batch else -1
        raise OLMoDataError(
            f"Instance {index} at step {step} holds token id {int(ids[bad_row].max())}, outside "
            f"[0, model.vocab_size={vocab_size}). The data was tokenized with another tokenizer or "
            f"data.memmap_dtype is wrong; re-tokenize or fix the config."
        )
