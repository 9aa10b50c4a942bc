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
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import groupby
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data
from torch.utils.data import Dataset

from ..config.data_sections import DataConfig
from ..distributed.collectives import all_reduce
from ..exceptions import OLMoConfigurationError, OLMoDataError
from ..util import env_rank, env_world_size
from .order_file import OrderSpec, build_order, order_in_memory, verify_order_file

__all__ = [
    "InstanceStream",
    "IterableDataset",
    "batches_per_epoch",
    "data_order_seed",
    "order_file_name",
    "rank_entries",
    "rank_slice",
    "read_instances",
    "worker_share",
]

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


def rank_entries(
    order: np.ndarray, start: int, stop: int, world_size: int, rank: int, pairs: bool = False
) -> np.ndarray:
    """The entries of ``order[start:stop]`` that rank ``rank`` of ``world_size`` trains on: :func:`rank_slice`'s, or
    with ``pairs`` every ``world_size``-th *pair* of entries from pair ``rank`` (a DPO pair stays on one rank, its
    two instances side by side)."""
    if not pairs:
        return order[rank_slice(start, stop, world_size, rank)]
    return order[start:stop].reshape(-1, 2)[rank::world_size].reshape(-1)


def worker_share(indices: Sequence[Any] | np.ndarray, batch_size: int) -> Iterator[tuple[int, Any]]:
    """``(position, entry)`` for the entries of ``indices`` that this DataLoader worker loads: whole batches of
    ``batch_size``, round-robin over the workers (all of them outside a worker), so that the batches come out in
    the same order for any number of workers."""
    worker = torch.utils.data.get_worker_info()  # looked up at the call: tests may replace it
    if worker is None:
        yield from enumerate(indices)
        return
    n_batches = -(-len(indices) // batch_size)
    for b in range(worker.id, n_batches, worker.num_workers):
        start = b * batch_size
        yield from enumerate(indices[start : start + batch_size], start)


def read_instances(
    dataset: Dataset, indices: Iterable[int], fetch_ahead: bool = True, with_index: bool = False
) -> Iterator[dict[str, Any]]:
    """``dataset[i]`` (with ``index=i`` added when ``with_index``) for each of ``indices`` in order; fetched ahead
    when the dataset can (:meth:`MemMapDataset.read_ahead`) and ``fetch_ahead``."""
    extra: Callable[[int], dict[str, Any]] = (lambda i: {"index": i}) if with_index else (lambda i: {})
    read_ahead = getattr(dataset, "read_ahead", None)
    if read_ahead is not None and fetch_ahead:
        yield from read_ahead(indices, extra)
    else:
        for i in indices:
            item = dataset[i]
            yield {**(item if isinstance(item, dict) else {"input_ids": item}), **extra(i)}


class InstanceStream(torch.utils.data.IterableDataset):
    """The instances ``indices`` of ``dataset``, in order, fetched ahead where the dataset can (remote files). In a
    DataLoader with workers, each worker loads whole batches of ``batch_size`` in turn, so batches come out as a
    map-style loader over the same indices would give them."""

    def __init__(self, dataset: Dataset, indices: Sequence[int], batch_size: int):
        self.dataset, self.indices, self.batch_size = dataset, indices, batch_size

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return read_instances(self.dataset, (int(i) for _, i in worker_share(self.indices, self.batch_size)))


class IterableDataset(torch.utils.data.IterableDataset):
    """Yields this rank's instances of an epoch, in the global order, as ``dict(**dataset[i], index=i)``.

    The epoch's order is written once, by one process (global rank 0), to ``{work_dir}/global_indices.npy`` (epoch 0) or
    ``global_indices_epoch{E}.npy`` as a raw uint32 memmap without a header (so users can inspect which instances
    made up any batch), and memory-mapped by every rank and DataLoader worker (:mod:`olmo.data.order_file`): a
    relaunch reuses the file after a cheap check instead of recomputing the permutation. Under a process group
    (``world_size`` data-parallel ranks, each perhaps several processes under context or tensor parallelism),
    every other process waits for that file. A rank that finds no matching file (no
    ``work_dir``, no process group to wait in, or a ``save_folder`` that its node does not share) computes the order
    in its own memory.

    With remote token files, a rank's instances are fetched ahead of use (:meth:`MemMapDataset.read_ahead`), never
    past :attr:`stop_index`.

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
    :param work_dir: where the order files are written (by global rank 0); None writes nothing.
    :param overwrite: replace an order file that holds a different order instead of raising.
    :param shuffle: permute the instances; otherwise the order is ``0..N-1``.
    :param max_examples: OLMo's: train on the first ``max_examples`` entries of the order only.
    :param pairs: instances ``2i`` and ``2i + 1`` are a pair (DPO's chosen and rejected answers): the order shuffles
        pairs, keeps each pair's two instances side by side, and deals whole pairs to the ranks. ``N`` must be even.
    :param drop_last: OLMo's: None (the trainer's rule) uses whole global batches of the order and drops the rest;
        True uses the largest multiple of ``world_size`` entries; False pads the order to a multiple of
        ``world_size`` with its first entries, as OLMo does.

    Items of ``dataset`` may also be sequences of token ids (they come out as ``{"input_ids": item}``), and
    ``world_size`` and ``rank`` default to the launch's, as in OLMo.
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch_size: int,
        *,
        seed: int = 0,
        epoch: int = 0,
        start_index: int = 0,
        world_size: Optional[int] = None,
        rank: Optional[int] = None,
        work_dir: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
        shuffle: bool = True,
        max_examples: Optional[int] = None,
        drop_last: Optional[bool] = None,
        fs_local_rank: Optional[int] = None,
        num_threads: Optional[int] = None,
        pairs: bool = False,
    ):
        del fs_local_rank, num_threads  # OLMo's: the order file is written by one process, without threads
        world_size = env_world_size() if world_size is None else world_size
        rank = env_rank() if rank is None else rank
        assert 0 <= rank < world_size, f"rank {rank} is not in [0, {world_size})"
        if global_batch_size <= 0 or global_batch_size % world_size != 0:
            raise OLMoConfigurationError(
                f"global_train_batch_size={global_batch_size} must be a positive multiple of the world size "
                f"({world_size}); change --global_train_batch_size or the number of processes."
            )
        self.dataset = dataset
        self.num_instances = len(dataset)  # type: ignore[arg-type]
        if self.num_instances >= 2**32:
            raise OLMoDataError(
                f"The training data holds {self.num_instances:,} instances, more than the 2^32 - 1 that the data order "
                f"(global_indices.npy, uint32 as in OLMo) can number. Raise model.max_sequence_length, or split the "
                f"corpus into stages (stages: [...]) of fewer instances each."
            )
        if self.num_instances < global_batch_size:
            raise OLMoDataError(
                f"The training data holds {self.num_instances} instances, fewer than one global batch of "
                f"global_train_batch_size={global_batch_size}. Add token files to data.paths, or lower "
                f"--global_train_batch_size or --model.max_sequence_length."
            )
        if pairs and (self.num_instances % 2 or global_batch_size % (2 * world_size)):
            raise OLMoDataError(
                f"dpo.enabled=true trains pairs (instances 2i and 2i+1, as scripts/prepare_preference_data.py writes "
                f"them), but the training data holds {self.num_instances} instances and global_train_batch_size="
                f"{global_batch_size} over {world_size} rank(s): both the instance count and the batch per rank must "
                f"be even. Point data.paths and data.label_mask_paths at the preference data's input_ids.npy and "
                f"label_mask.npy, unchanged."
            )
        self.pairs = pairs
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = epoch
        self.start_index = start_index
        self.world_size = world_size
        self.rank = rank
        self.work_dir = None if work_dir is None else Path(work_dir)
        self.overwrite = overwrite
        self.shuffle = shuffle
        self.max_examples = max_examples
        self.drop_last = drop_last
        self.stop_index: Optional[int] = None
        """Global instances of this epoch after which nothing more is read (the run's last step); None: the
        epoch's end. Instances are fetched ahead only up to it."""
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order); not pickled: workers map the file
        self._order_file_ready = False  # whether order_file() holds this epoch's order
        self._prepare_order_file()

    def __getstate__(self) -> dict[str, Any]:
        # Workers memory-map the order file (or recompute the order) rather than receive a copy of a possibly
        # huge array.
        state = self.__dict__.copy()
        state["_order"] = None
        return state

    @property
    def total_size(self) -> int:
        """Entries of the epoch's order used for training: whole global batches only (with an explicit
        ``drop_last``, OLMo's rule: a multiple of ``world_size``, cut or padded)."""
        if self.drop_last is None:
            return self.batches_per_epoch * self.global_batch_size
        n, w = self.num_instances, self.world_size
        return n // w * w if self.drop_last else -(-n // w) * w

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
        """The whole order of the current epoch (N uint32 instance indices): the order file, memory-mapped, or an
        array in memory when there is no file."""
        if self._order is None or self._order[0] != self.epoch:
            spec = self._spec()
            path = self.order_file()
            if path is not None and (self._order_file_ready or verify_order_file(path, spec)):
                self._order_file_ready = True
                order: np.ndarray = np.memmap(path, dtype=np.uint32, mode="r")
            else:
                if path is not None and self._in_process_group():
                    log.warning(
                        "Rank %d does not see the data order that global rank 0 wrote to %s (is save_folder on a file "
                        "system that every node shares?); computing it in this process's memory (%.1f GB).",
                        dist.get_rank(),
                        path,
                        spec.num_instances * 4 / 1e9,
                    )
                order = order_in_memory(spec)
            self._order = (self.epoch, order)
        return self._order[1]

    def reshuffle(self, epoch: int) -> None:
        """Move to ``epoch``: start from its first instance and (global rank 0) write its order file."""
        self.epoch = epoch
        self.start_index = 0
        self.stop_index = None
        self._prepare_order_file()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order, stop = self.global_indices(), self.total_size
        if self.drop_last is not None or self.max_examples is not None:
            order = self._olmo_order(order)
            stop = len(order)
        # A plain view: iterating an np.memmap runs its Python __getitem__ for every entry.
        rank_indices = rank_entries(order, self.start_index, stop, self.world_size, self.rank, self.pairs)
        rank_indices = rank_indices.view(np.ndarray)
        # This rank's entries before stop_index may be fetched ahead; later ones (never trained on, unless the
        # run is extended) are only read when asked for.
        ahead = len(rank_indices)
        if self.stop_index is not None:
            unit = 2 if self.pairs else 1  # entries dealt to a rank at a time
            span = (self.stop_index - self.start_index) // unit - self.rank
            ahead = unit * max(0, -(-span // self.world_size))
        shares = groupby(worker_share(rank_indices, self.device_batch_size), key=lambda item: item[0] < ahead)
        for fetch_ahead, items in shares:
            yield from read_instances(self.dataset, (int(i) for _, i in items), fetch_ahead, with_index=True)

    def _olmo_order(self, order: np.ndarray) -> np.ndarray:
        """The entries OLMo's rules use: ``total_size`` of them (padded with the first ones when the order is
        shorter), then at most ``max_examples``."""
        total = self.total_size
        entries = np.asarray(order[:total])
        if total > len(entries):
            entries = np.concatenate([entries, np.asarray(order[: total - len(entries)])])
        return entries if self.max_examples is None else entries[: self.max_examples]

    def _spec(self) -> OrderSpec:
        return OrderSpec(self.num_instances, self.seed, self.epoch, self.shuffle, self.pairs)

    def _prepare_order_file(self) -> None:
        """Rank 0 makes sure the order file holds this epoch's order (reusing a matching one); the other ranks of
        a process group wait for it."""
        self._order, self._order_file_ready = None, False
        path = self.order_file()
        if path is None:
            return
        ok, writer = True, self._writes_order()
        if writer:
            try:
                self._write_order_file(path)
            except BaseException:
                ok = False
                self._agree(ok)
                raise
        if not self._agree(ok):
            raise OLMoDataError(
                f"Rank 0 could not write the data order to {path}; its error message says why (fix that and relaunch)."
            )
        self._order_file_ready = writer

    def _in_process_group(self) -> bool:
        """Whether this process's peers in the process group read the order file too: the group holds the
        ``world_size`` data-parallel ranks, each once or, with context or tensor parallelism, several times over."""
        if not dist.is_initialized():
            return False
        group = dist.get_world_size()
        return group > 1 and group % self.world_size == 0

    def _writes_order(self) -> bool:
        """Whether this process writes the order file: one process in all, global rank 0 of the process group (the
        context- and tensor-parallel peers of data rank 0 read the same order, and wait for it as the others do);
        data rank 0 without a group. A node that does not share ``save_folder`` computes the order in memory
        (:meth:`global_indices`)."""
        return dist.get_rank() == 0 if self._in_process_group() else self.rank == 0

    def _agree(self, ok: bool) -> bool:
        """Whether rank 0 succeeded, as every rank of the process group learns it (True without a group)."""
        if not self._in_process_group():
            return ok
        return bool(all_reduce(torch.tensor([0.0 if ok else 1.0]), dist.ReduceOp.MAX).item() == 0)

    def _write_order_file(self, path: Path) -> None:
        spec = self._spec()
        if path.exists():
            if verify_order_file(path, spec):
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
        build_order(path, spec)
        log.info("Wrote the data order of epoch %d (%d instances) to %s.", self.epoch, self.num_instances, path)
