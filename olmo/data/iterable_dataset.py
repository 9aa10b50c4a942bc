"""The training order: a seeded permutation per epoch, cut into global batches and split over ranks.

Global batch ``s`` of an epoch is entries ``[s*B, (s+1)*B)`` of that epoch's order (``B`` = global batch
size); rank ``r`` of ``W`` takes every W-th entry of it from offset ``r``. The position in the data is a
global instance count (``start_index``), so a run can resume with another world size and continue the same
order. The last partial global batch of an epoch is always dropped, so every optimizer step sees exactly
``B`` instances and the gradient scale never changes.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch.utils.data
from torch.utils.data import Dataset, get_worker_info

from ..config_sections import DataConfig
from ..exceptions import OLMoConfigurationError, OLMoDataError

__all__ = ["IterableDataset", "batches_per_epoch", "data_order_seed", "order_file_name", "rank_slice"]

log = logging.getLogger(__name__)


def data_order_seed(data: DataConfig, seed: int) -> int:
    """The seed of the data order: ``data.seed``, or the run's ``seed`` when that is None."""
    return data.seed if data.seed is not None else seed


def order_file_name(epoch: int) -> str:
    """The name of the file holding the order of ``epoch``: ``global_indices.npy`` for epoch 0, as in OLMo."""
    return "global_indices.npy" if epoch == 0 else f"global_indices_epoch{epoch}.npy"


def batches_per_epoch(num_instances: int, global_batch_size: int) -> int:
    """Global batches (optimizer steps) in an epoch of ``num_instances``; the last partial one is dropped."""
    return num_instances // global_batch_size


def rank_slice(start: int, stop: int, world_size: int, rank: int) -> slice:
    """The entries of an epoch's order from ``start`` up to ``stop`` that rank ``rank`` of ``world_size`` trains
    on: every ``world_size``-th from ``start + rank``. ``start`` is a global instance count, so whole global
    batches (a multiple of ``world_size``) have gone before it.
    """
    return slice(start + rank, stop, world_size)


class IterableDataset(torch.utils.data.IterableDataset):
    """Yields this rank's instances of an epoch, in the global order, as ``dict(**dataset[i], index=i)``.

    The epoch's order is also written by rank 0 to ``{work_dir}/global_indices.npy`` (epoch 0) or
    ``global_indices_epoch{E}.npy`` as a raw uint32 memmap without a header, so users can inspect which
    instances made up any batch. Every rank computes the same order in memory, so no rank waits for the file.

    Use it in a DataLoader whose ``batch_size`` is :attr:`device_batch_size`: DataLoader workers take whole
    device batches round-robin, so the batches come out in the same order for any ``num_workers``. Set
    :attr:`start_index` before creating the iterator; with ``persistent_workers`` a change made later does
    not reach the worker processes.

    :param dataset: a map-style dataset of N instances (N < 2**32) returning dicts.
    :param global_batch_size: instances per optimizer step over all ranks (``global_train_batch_size``).
    :param seed: the data-order seed; epoch ``E`` is shuffled with ``seed + E``.
    :param epoch: the epoch whose order to use.
    :param start_index: global instances of this epoch already consumed (a resume position).
    :param world_size: number of data-parallel ranks.
    :param rank: this process's rank.
    :param work_dir: where rank 0 writes the order files; None writes nothing.
    :param overwrite: replace an order file that holds a different order instead of raising.
    :param shuffle: permute the instances; otherwise the order is ``0..N-1``.
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch_size: int,
        *,
        seed: int,
        epoch: int = 0,
        start_index: int = 0,
        world_size: int = 1,
        rank: int = 0,
        work_dir: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
        shuffle: bool = True,
    ):
        assert 0 <= rank < world_size, f"rank {rank} is not in [0, {world_size})"
        if global_batch_size <= 0 or global_batch_size % world_size != 0:
            raise OLMoConfigurationError(
                f"global_train_batch_size={global_batch_size} must be a positive multiple of the world size "
                f"({world_size}); change --global_train_batch_size or the number of processes."
            )
        self.dataset = dataset
        self.num_instances = len(dataset)  # type: ignore[arg-type]
        assert self.num_instances < 2**32, "global indices are stored as uint32"
        if self.num_instances < global_batch_size:
            raise OLMoDataError(
                f"The training data holds {self.num_instances} instances, fewer than one global batch of "
                f"global_train_batch_size={global_batch_size}. Add token files to data.paths, or lower "
                f"--global_train_batch_size or --model.max_sequence_length."
            )
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = epoch
        self.start_index = start_index
        self.world_size = world_size
        self.rank = rank
        self.work_dir = None if work_dir is None else Path(work_dir)
        self.overwrite = overwrite
        self.shuffle = shuffle
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order); recomputed, not pickled
        self._write_order_file()

    def __getstate__(self) -> dict[str, Any]:
        # Workers recompute the (deterministic) order rather than receive a copy of a possibly huge array.
        state = self.__dict__.copy()
        state["_order"] = None
        return state

    @property
    def total_size(self) -> int:
        """Entries of the epoch's order used for training: whole global batches only."""
        return self.batches_per_epoch * self.global_batch_size

    @property
    def batches_per_epoch(self) -> int:
        """Global batches (optimizer steps) per epoch; the last partial global batch is dropped."""
        return batches_per_epoch(self.num_instances, self.global_batch_size)

    @property
    def device_batch_size(self) -> int:
        """Instances this rank contributes to each global batch."""
        return self.global_batch_size // self.world_size

    def order_file(self, epoch: int | None = None) -> Path | None:
        """The file holding the order of ``epoch`` (default: the current one), or None without a work_dir."""
        if self.work_dir is None:
            return None
        epoch = self.epoch if epoch is None else epoch
        return self.work_dir / order_file_name(epoch)

    def global_indices(self) -> np.ndarray:
        """The whole order of the current epoch (N uint32 instance indices)."""
        if self._order is None or self._order[0] != self.epoch:
            order = np.arange(self.num_instances, dtype=np.uint32)
            if self.shuffle:
                np.random.Generator(np.random.PCG64(self.seed + self.epoch)).shuffle(order)
            self._order = (self.epoch, order)
        return self._order[1]

    def reshuffle(self, epoch: int) -> None:
        """Move to ``epoch``: start from its first instance and (rank 0) write its order file."""
        self.epoch = epoch
        self.start_index = 0
        self._write_order_file()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = self.global_indices()
        rank_indices = order[rank_slice(self.start_index, self.total_size, self.world_size, self.rank)]
        for i in self._this_worker(rank_indices):
            yield dict(**self.dataset[i], index=int(i))

    def _this_worker(self, rank_indices: np.ndarray) -> Iterator[np.uint32]:
        worker = get_worker_info()
        if worker is None:
            yield from rank_indices
            return
        size = self.device_batch_size
        n_batches = -(-len(rank_indices) // size)
        for b in range(worker.id, n_batches, worker.num_workers):
            yield from rank_indices[b * size : (b + 1) * size]

    def _write_order_file(self) -> None:
        path = self.order_file()
        if self.rank != 0 or path is None:
            return
        order = self.global_indices()
        if path.exists():
            if _file_holds(path, order):
                log.info("Reusing the data order in %s (it matches this run's).", path)
                return
            if not self.overwrite:
                raise OLMoDataError(
                    f"'{path}' holds a different data order than this run computes ({self.num_instances} "
                    f"instances, seed {self.seed}, epoch {self.epoch}): the data files, "
                    f"model.max_sequence_length or the seed changed since it was written. Use a new "
                    f"save_folder, or pass --save_overwrite to replace it."
                )
            log.warning("Replacing the data order in %s (--save_overwrite).", path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write next to the target and rename, so a reader never sees a partly written order.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            out = np.memmap(tmp, dtype=np.uint32, mode="w+", shape=order.shape)
            out[:] = order
            out.flush()
            del out
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        log.info("Wrote the data order of epoch %d (%d instances) to %s.", self.epoch, len(order), path)


def _file_holds(path: Path, order: np.ndarray) -> bool:
    if path.stat().st_size != order.nbytes:
        return False
    return bool(np.array_equal(np.memmap(path, dtype=np.uint32, mode="r"), order))
