"""Token files written by ``np.save``: their npy header (read from a local file or from the first bytes of a remote
one), and where a file's items lie (:class:`Layout`), for :class:`olmo.data.memmap_dataset.MemMapDataset`."""

from __future__ import annotations

import struct
from typing import BinaryIO, NamedTuple

import numpy as np
from numpy.lib import format as npy_format

__all__ = [
    "NpyHeader",
    "Layout",
    "npy_header_bytes",
    "read_npy_header",
    "NPY_MAGIC",
    "PROBE_BYTES",
    "MAX_NPY_HEADER_BYTES",
]

NPY_MAGIC = b"\x93NUMPY"
NPY_HEADER_READERS = {(1, 0): npy_format.read_array_header_1_0, (2, 0): npy_format.read_array_header_2_0}
PROBE_BYTES = 1024
"""Bytes read from the start of a remote file the first time a run sees it, for its npy header (if any)."""
MAX_NPY_HEADER_BYTES = 65536
"""The largest npy header read from a remote file (numpy itself refuses headers over 10,000 bytes by default)."""


class NpyHeader(NamedTuple):
    """The header of a file written by ``np.save``."""

    size: int
    """Bytes before the first item."""
    shape: tuple[int, ...]
    fortran_order: bool
    dtype: np.dtype


class Layout(NamedTuple):
    header_bytes: int
    """Bytes before the first item: 0 for a headerless memmap."""
    n_items: int


def npy_header_bytes(start: bytes) -> int:
    """The size of the npy header that ``start`` (at least the file's first 12 bytes) begins."""
    if start[6:7] == b"\x01":
        return 10 + struct.unpack("<H", start[8:10])[0]
    return 12 + struct.unpack("<I", start[8:12])[0]


def read_npy_header(f: BinaryIO) -> NpyHeader | None:
    """The npy header that the file ``f`` (open at its start) begins with, or None when it has none.

    :raises ValueError: when the file starts with the npy magic but its header cannot be parsed.
    """
    if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
        return None
    f.seek(0)
    version = npy_format.read_magic(f)
    reader = NPY_HEADER_READERS.get(version)
    if reader is None:
        raise ValueError(f"npy format version {version[0]}.{version[1]} is not supported (1.0 and 2.0 are)")
    shape, fortran_order, dtype = reader(f)
    return NpyHeader(f.tell(), tuple(shape), bool(fortran_order), np.dtype(dtype))
