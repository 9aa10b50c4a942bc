"""Sharded (DCP) loads that read each tensor's bytes straight into the tensor that receives them.

DCP's ``FileSystemReader`` rebuilds every stored tensor with ``torch.load`` into new memory, then copies the part
the loading rank needs into the live tensor: two passes over the bytes plus an allocation (fresh pages, zeroed by
the kernel) per tensor, which made sharded loads several times slower than our memory-mapped unsharded load
(RESEARCH_LOG 2026-11-21 and 2026-11-26). :class:`DirectFileSystemReader` first reads only the stored tensor's
header (``torch.load(map_location="meta")``, which records where the tensor's bytes start without reading them),
then ``readinto``\\ s the byte range the rank needs into the target tensor's own memory: one copy, no allocation.

That applies when the bytes are one contiguous range: a contiguous stored tensor of the target's dtype, cut (if at
all) along its first dimension only, which is how FSDP2 shards and reshards, into a contiguous CPU target.
Anything else (a stored view or transform, a cut along another dimension, a GPU target, an older torch without the
header offsets) goes through DCP's own reader, unchanged. The file format is DCP's: checkpoints written before this
reader existed load with it, and its checkpoints load with plain DCP.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, BinaryIO, Union, cast

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .safe_reads import SafeFileSystemReader

__all__ = ["DirectFileSystemReader"]


class _Window(io.RawIOBase):
    """The bytes ``[start, start + length)`` of an open file, as a seekable file of their own."""

    def __init__(self, file: BinaryIO, start: int, length: int):
        super().__init__()
        self._file, self._start, self._length, self._pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = _read_exactly(self._file, view[:n])
        self._pos += got
        return got


def _read_exactly(file: BinaryIO, view: memoryview) -> int:
    """Fill ``view`` from ``file`` (a short read is retried); the number of bytes read, less only at the end."""
    done = 0
    while done < len(view):
        got = file.readinto(view[done:])  # type: ignore[attr-defined]
        if not got:
            break
        done += got
    return done


class DirectFileSystemReader(SafeFileSystemReader):
    """DCP's file reader (with :class:`~olmo.checkpoint.safe_reads.SafeFileSystemReader`'s safe metadata load) that
    reads a tensor's bytes directly into its target where they form one contiguous range (module docstring)."""

    def __init__(self, path: Union[str, os.PathLike[str]]):
        super().__init__(path)
        self.direct_items = 0  # read straight into their targets (this reader's counts, for tests and benchmarks)
        self.fallback_items = 0  # handed to DCP's own reader

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        rest: list[ReadItem] = []
        for relative_path, items in per_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)  # one forward pass per file
            with open(Path(self.path) / relative_path, "rb", buffering=0) as file:
                rest += [item for item in items if not self._read_direct(file, item, planner)]
        self.direct_items += len(plan.items) - len(rest)
        self.fallback_items += len(rest)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_direct(self, file: BinaryIO, item: ReadItem, planner: LoadPlanner) -> bool:
        """Read ``item`` into its target and commit it; False (nothing done) when it needs DCP's own path."""
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        target = planner.resolve_tensor(item).detach()
        if target.device.type != "cpu" or target.dim() == 0 or not target.is_contiguous():
            return False
        window = cast(BinaryIO, _Window(file, info.offset, info.length))
        stored = torch.load(window, map_location="meta", weights_only=True)
        data_offset = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
        if (
            not isinstance(data_offset, int)
            or stored.dtype != target.dtype
            or not stored.is_contiguous()
            or tuple(target.shape) != tuple(item.lengths)
            or tuple(item.lengths[1:]) != tuple(stored.shape[1:])
            or any(item.storage_offsets[1:])
        ):
            return False
        itemsize = stored.element_size()
        row_bytes = stored[0].numel() * itemsize if stored.shape[0] else 0
        start = (
            info.offset + data_offset + stored.storage_offset() * itemsize + item.storage_offsets[0] * row_bytes
        )
        destination = memoryview(cast(Any, target.view(torch.uint8).view(-1).numpy()))
        file.seek(start)
        if _read_exactly(file, destination) != len(destination):
            raise OSError(f"{file.name}: the file ends inside the tensor {item.dest_index.fqn} (truncated)")
        planner.commit_tensor(item, target)
        return True
