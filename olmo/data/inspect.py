"""The instances of one global batch of a data order, as ``scripts/inspect_batch.py`` shows them: the token file and
offset of each, its mixture source, the dolma documents it holds, whether ``data.instance_filter`` drops it, its
label tokens and the start of its text.

Which batch of which epoch a training step read (stages, batches that rollbacks skipped) is the trainer's record;
``olmo.cli.inspect_batch`` works it out and hands the batch to :func:`read_batch` here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from ..config import DataConfig
from ..exceptions import OLMoCliError, OLMoDataError
from .instance_filter import is_repetitive
from .iterable_dataset import (
    IterableDataset,
    order_file_name,
    rank_entries,
    read_instances,
)
from .memmap_dataset import MemMapDataset
from .provenance import instance_documents

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

__all__ = ["BatchRow", "BatchSettings", "load_order", "read_batch", "launch_world_size"]

log = logging.getLogger(__name__)


@dataclass
class BatchRow:
    """One instance of a global batch."""

    position: int
    """Position in the global batch; rank ``position % W`` of ``W`` trained on it."""
    index: int
    """Global instance index (an entry of the epoch's order file)."""
    path: str
    offset: int
    """Token offset of the instance in ``path``."""
    label_tokens: Optional[int] = None
    text: Optional[str] = None
    source: Optional[str] = None
    """The mixture source or ``data.datasets`` label of the instance's file."""
    documents: Optional[list[dict[str, object]]] = None
    """The documents in the instance (``{id, start, end}``, token spans within it) from dolma's metadata beside
    the token file; None when there is none."""
    filtered: bool = False
    """Dropped from the loss by ``data.instance_filter``."""
    paired: bool = False
    """The data are DPO pairs (``dpo.enabled``): the instance is pair ``index // 2``'s chosen answer (even index) or
    rejected one (odd), and ranks train whole pairs."""

    def rank(self, world_size: int) -> int:
        """The rank of ``world_size`` that trained the instance."""
        return (self.position // 2 if self.paired else self.position) % world_size

    @property
    def pair(self) -> Optional[str]:
        """``"pair 12 chosen"``, or None outside DPO."""
        return f"pair {self.index // 2} {'rejected' if self.index % 2 else 'chosen'}" if self.paired else None

    def as_json(self, world_size: Optional[int]) -> dict[str, object]:
        """The row as ``inspect_batch.py --json`` prints it; ``rank`` is of ``world_size`` ranks (None: unknown)."""
        return {
            "position": self.position,
            "rank": None if world_size is None else self.rank(world_size),
            "index": self.index,
            **(
                {"pair": self.index // 2, "answer": "rejected" if self.index % 2 else "chosen"}
                if self.paired
                else {}
            ),
            "source": self.source,
            "file": self.path,
            "token_offset": self.offset,
            "documents": self.documents or [],
            "document_metadata": self.documents is not None,
            "filtered": self.filtered,
            "label_tokens": self.label_tokens,
        }


@dataclass(frozen=True)
class BatchSettings:
    """What reading a run's batches takes from its config."""

    global_train_batch_size: int
    pairs: bool
    """``dpo.enabled``: the data are preference pairs, dealt to ranks whole."""
    max_sequence_length: int
    """``model.max_sequence_length``: the tokens of one instance."""


def load_order(
    path: Path, explicit: bool, epoch: int, run: BatchSettings, dataset: MemMapDataset, seed: int
) -> np.ndarray:
    """The order of ``epoch``: read from ``path`` or, if the trainer's file is absent, recomputed as the trainer
    does with ``seed`` (the data's order seed, :func:`olmo.data.data_order_seed`).

    :param explicit: ``path`` was given with ``--order-file``, so it must exist.
    :raises OLMoDataError: for a file whose size does not fit the config's data.
    """
    n = len(dataset)
    if not path.is_file():
        if explicit:
            raise OLMoCliError(
                f"--order-file '{path}' does not exist. Pass the run's train_data/{order_file_name(epoch)}."
            )
        log.warning(
            "'%s' does not exist; recomputing epoch %d's order from the seed as the trainer does.", path, epoch
        )
        return IterableDataset(
            dataset, run.global_train_batch_size, seed=seed, epoch=epoch, pairs=run.pairs
        ).global_indices()
    size = path.stat().st_size
    if size != 4 * n:
        raise OLMoDataError(
            f"Order file '{path}' holds {size / 4:g} uint32 entries, but the config's data has {n} instances "
            f"of {run.max_sequence_length} tokens. The config is not the one this order was made for: "
            f"pass the run's config.yaml (and --data.paths=[...] if only the file locations changed)."
        )
    log.info("Reading the order of epoch %d from %s.", epoch, path)
    return np.memmap(path, mode="r", dtype=np.uint32)


def read_batch(
    run: BatchSettings,
    data: DataConfig,
    dataset: MemMapDataset,
    order: np.ndarray,
    order_path: Path,
    batch: int,
    step: int,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    tokenizer: Optional[Tokenizer] = None,
    max_chars: int = 200,
    provenance: bool = False,
) -> list[BatchRow]:
    """The instances of global batch ``batch`` (from 0) of an epoch's ``order`` (only rank ``rank``'s of
    ``world_size`` if given), which training step ``step`` trained on.

    Instances are read (remote ones concurrently, and only those of the batch) only for what needs their tokens:
    ``tokenizer`` (their text, cut to ``max_chars``), a label mask, or ``provenance`` with an instance filter.

    :param data: the data section ``dataset`` was built from (a stage's, in a staged run).
    :param order_path: where ``order`` was read from, for the error about an entry out of range.
    :param provenance: add each instance's documents and whether the instance filter drops it.
    """
    batch_size = run.global_train_batch_size
    positions: Sequence[int] = range(batch_size)
    if rank is not None:
        assert world_size is not None and batch_size % world_size == 0 and 0 <= rank < world_size
        # Whole pairs per rank with dpo, else every world_size-th instance.
        entries_of_rank = rank_entries(np.arange(batch_size), 0, batch_size, world_size, rank, run.pairs)
        positions = [int(p) for p in entries_of_rank]
    # Read exactly as users do (olmo/data/__init__.py): a slice of the order, uint32 indices as they are.
    entries = order[batch * batch_size : (batch + 1) * batch_size]
    _check_entries(entries, len(dataset), order_path, batch * batch_size, step)
    instance_filter = data.instance_filter
    masked = data.label_mask_paths is not None or any(
        s.label_mask_paths is not None for s in (data.mixture.sources if data.mixture else [])
    )
    wanted = tokenizer is not None or masked or (provenance and instance_filter is not None)
    instances = read_instances(dataset, (int(entries[p]) for p in positions)) if wanted else iter(())
    rows = []
    for position in positions:
        index = entries[position]
        path_of, offset = dataset.instance_location(index)
        row = BatchRow(position, int(index), path_of, offset, source=dataset.instance_source(index))
        row.paired = run.pairs
        if provenance:
            row.documents = instance_documents(path_of, offset, run.max_sequence_length)
        if wanted:
            instance = next(instances)
            if "label_mask" in instance:
                row.label_tokens = int(instance["label_mask"].sum())
            if instance_filter is not None:
                row.filtered = is_repetitive(instance["input_ids"].numpy(), instance_filter)
            if tokenizer is not None:
                text = tokenizer.decode(instance["input_ids"].tolist()).replace("\n", "\\n")
                row.text = text if len(text) <= max_chars else text[:max_chars] + "…"
        rows.append(row)
    return rows


def _check_entries(entries: np.ndarray, num_instances: int, path: Path, first: int, step: int) -> None:
    """Refuse order entries that name no instance of the data (a damaged file, or one made for other data).

    :raises OLMoDataError: naming the file, the first bad value and its position.
    """
    bad = np.flatnonzero(entries >= num_instances)
    if bad.size == 0:
        return
    p = int(bad[0])
    raise OLMoDataError(
        f"Order file '{path}' holds {int(entries[p])} at entry {first + p:,} (position {p} of step {step}'s batch; "
        f"{bad.size} of the batch's {len(entries)} entries are out of range), but the config's data has only "
        f"{num_instances:,} instances (0 to {num_instances - 1:,}): the file is damaged. Restore an intact copy, or "
        f"delete it (and its .json record beside it): a run folder's missing order is recomputed from the seed "
        f"exactly as the trainer made it."
    )


def launch_world_size(run_dir: Path) -> Optional[int]:
    """The ranks of a run's last launch, from its ``data-indices/rank{R}.tsv.gz`` files; None when unknown (or
    ``run_dir`` is not a folder)."""
    folder = run_dir / "data-indices" if run_dir.is_dir() else None
    ranks = len(list(folder.glob("rank*.tsv.gz"))) if folder is not None and folder.is_dir() else 0
    return ranks or None
