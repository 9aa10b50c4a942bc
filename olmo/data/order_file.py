"""An epoch's order on disk: built once, by one process, and memory-mapped by every rank and DataLoader worker.

The file (``global_indices.npy``, a raw uint32 memmap as in OLMo) holds exactly the permutation that
``np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(np.arange(N, dtype=np.uint32))`` gives, OLMo's own.
It is built once, by one process, in shared memory, and written to the file; every reader maps the file (its
pages belong to the page cache, shared by every process of a node) instead of holding a private copy: at OLMo-2
scale (976M instances) the order is 3.9 GB, and a copy per rank would be 31 GB on an 8-GPU node.

Next to it, ``global_indices.npy.json`` records what the file holds (instances, seed, epoch, shuffled or not)
and a checksum of 64 evenly spread 4 KiB blocks; it is written after the file, so its presence commits it. A
relaunch compares the record and the sampled checksum (reading 256 KiB) instead of recomputing the permutation
(~52 s at OLMo-2 scale on a 2-core machine). An order file without a record (written before this existed) is
verified once by building the order anew next to it and comparing, then recorded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Optional

import numpy as np

from ..util import atomic_file, write_result_file

__all__ = ["OrderSpec", "build_order", "order_in_memory", "read_order_record", "verify_order_file"]

log = logging.getLogger(__name__)

_FILL_CHUNK = 2**24
"""Entries filled or written per step while building an order (bounds the temporary arrays)."""
_SAMPLE_BLOCKS, _SAMPLE_ENTRIES = 64, 1024


@dataclass(frozen=True)
class OrderSpec:
    """What determines an epoch's order."""

    num_instances: int
    seed: int
    epoch: int
    shuffle: bool = True
    pairs: bool = False
    """Shuffle pairs of instances (``2i``, ``2i + 1``) as units (DPO's chosen and rejected answers): the order is
    the permutation of ``N / 2`` pairs that the same generator gives, each pair's two instances side by side."""

    def record(self) -> dict[str, Any]:
        """What the order file's record holds of the spec (``pairs`` only when set: records written before it
        existed stay valid)."""
        fields = asdict(self)
        if not self.pairs:
            del fields["pairs"]
        return fields


def order_in_memory(spec: OrderSpec) -> np.ndarray:
    """The order as an array in this process's memory (for orders that are not written to a file)."""
    if spec.pairs:
        first = np.arange(0, spec.num_instances - spec.num_instances % 2, 2, dtype=np.uint32)
        _shuffle_in_place(first, spec)
        return np.stack([first, first + 1], axis=1).reshape(-1)
    order = np.arange(spec.num_instances, dtype=np.uint32)
    _shuffle_in_place(order, spec)
    return order


def _shuffle_in_place(order: np.ndarray, spec: OrderSpec) -> None:
    if spec.shuffle:
        # numpy shuffles a plain ndarray in place in C; an ndarray subclass (np.memmap) would take its generic
        # path, one Python-level swap at a time. A plain view of the same memory gives the same permutation.
        np.random.Generator(np.random.PCG64(spec.seed + spec.epoch)).shuffle(order.view(np.ndarray))


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _sample_checksum(order: np.ndarray) -> int:
    """crc32 of 64 evenly spread blocks of 1,024 entries (all of them for a short order)."""
    n = len(order)
    crc = 0
    if n <= _SAMPLE_BLOCKS * _SAMPLE_ENTRIES:
        return zlib.crc32(np.ascontiguousarray(order[:n]).tobytes())
    for b in range(_SAMPLE_BLOCKS):
        start = b * (n - _SAMPLE_ENTRIES) // (_SAMPLE_BLOCKS - 1)
        crc = zlib.crc32(np.ascontiguousarray(order[start : start + _SAMPLE_ENTRIES]).tobytes(), crc)
    return crc


def read_order_record(path: Path) -> Optional[dict]:
    """The record next to the order file ``path``, or None when there is none (or it cannot be read)."""
    try:
        return json.loads(_record_path(path).read_text())
    except (OSError, ValueError):
        return None


def _write_record(path: Path, spec: OrderSpec, checksum: int) -> None:
    record = {**spec.record(), "bytes": spec.num_instances * 4, "sample_crc32": checksum, "numpy": np.__version__}
    write_result_file(_record_path(path), json.dumps(record, indent=1) + "\n")


def verify_order_file(path: Path, spec: OrderSpec) -> bool:
    """Whether the order file ``path`` holds the order of ``spec``: by its record and a sampled checksum, or, for a
    file without a record, by building the order anew next to it and comparing (the record is then written)."""
    if not path.is_file() or path.stat().st_size != spec.num_instances * 4:
        return False
    record = read_order_record(path)
    mapped = np.memmap(path, dtype=np.uint32, mode="r") if spec.num_instances else np.empty(0, np.uint32)
    if record is not None:
        held = {k: v for k, v in record.items() if k in asdict(spec)}
        return held == spec.record() and record.get("sample_crc32") == _sample_checksum(mapped)
    log.info("%s has no record of what it holds; building the order anew once to compare.", path)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".global_indices.", suffix=".tmp") as fresh:
        _write_order(fresh, spec)
        fresh.flush()
        expected = np.memmap(fresh.name, dtype=np.uint32, mode="r")
        equal = all(
            np.array_equal(mapped[s : s + _FILL_CHUNK], expected[s : s + _FILL_CHUNK])
            for s in range(0, spec.num_instances, _FILL_CHUNK)
        )
        del expected
    if equal:
        _write_record(path, spec, _sample_checksum(mapped))
    return equal


def build_order(path: Path, spec: OrderSpec) -> None:
    """Write the order of ``spec`` to ``path`` (through a temporary file and a rename), then its record."""
    with atomic_file(path) as out:
        _write_order(out, spec)
    _write_record(path, spec, _sample_checksum(np.memmap(path, dtype=np.uint32, mode="r")))


def _write_order(out: IO[bytes], spec: OrderSpec) -> None:
    """Write the order of ``spec`` to ``out``.

    The permutation is built in a shared-memory buffer (``memfd``: page-cache memory that is never written back,
    not the process's anonymous memory), then written to the file in one sequential pass. Shuffling in the file's
    own mapping instead is ~14x slower (739 s instead of ~55 s at OLMo-2 scale, RESEARCH_LOG 2026-11-25): the
    kernel keeps writing back pages that the next random swap dirties again.
    """
    if not spec.num_instances:
        return
    if spec.pairs:  # preference data: small (a pair is two conversations), built in memory
        out.write(order_in_memory(spec).tobytes())
        return
    with _shared_buffer(spec.num_instances * 4) as buffer:
        order = np.frombuffer(buffer, dtype=np.uint32)
        for start in range(0, spec.num_instances, _FILL_CHUNK):
            stop = min(start + _FILL_CHUNK, spec.num_instances)
            order[start:stop] = np.arange(start, stop, dtype=np.uint32)
        _shuffle_in_place(order, spec)
        del order  # the buffer cannot be released while an array views it
        view = memoryview(buffer)
        for start in range(0, len(view), _FILL_CHUNK * 4):
            out.write(view[start : start + _FILL_CHUNK * 4])
        view.release()


@contextlib.contextmanager
def _shared_buffer(nbytes: int) -> Iterator[Any]:
    """A writable buffer of ``nbytes`` in shared memory (anonymous memory where ``memfd_create`` is missing)."""
    if not hasattr(os, "memfd_create"):
        yield bytearray(nbytes)
        return
    fd = os.memfd_create("olmo-global-indices")
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as buffer:
            yield buffer
    finally:
        os.close(fd)
