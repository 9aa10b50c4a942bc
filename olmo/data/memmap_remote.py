"""How :class:`olmo.data.memmap_dataset.MemMapDataset` learns the layout of remote token files: one metadata request
each (all at once, on ``data.remote.max_concurrency`` threads), their npy header from one small range read, and the
run's record of both (``train_data/remote_files.json``), which a relaunch checks instead of reading again."""

from __future__ import annotations

import io
import logging
import struct
import threading
from pathlib import Path
from typing import Optional

import numpy as np

from ..config.data_sections import RemoteDataConfig
from ..exceptions import OLMoDataError
from ..util import redact_url
from .npy_files import (
    MAX_NPY_HEADER_BYTES,
    NPY_MAGIC,
    PROBE_BYTES,
    Layout,
    NpyHeader,
    npy_header_bytes,
    read_npy_header,
)
from .read_ahead import fetch_pool
from .remote import CachedFile, FetchStats, MetadataCache, RemoteFile, RemoteUnreachable, is_remote
from .remote_backends import remote_reader

__all__ = ["RemoteFileAccess"]

log = logging.getLogger(__name__)
_unversioned_warned = False


def _warn_unversioned(url: str) -> None:
    """Once per process: the server sends neither ETag nor Last-Modified, so a file rewritten with the same size
    would go unnoticed."""
    global _unversioned_warned
    if not _unversioned_warned:
        _unversioned_warned = True
        log.warning(
            "The server of '%s' (and perhaps of other remote files of this run) sends neither ETag nor Last-Modified, "
            "so a file replaced by another of the same size since this run first read it cannot be noticed: only its "
            "size is checked. Serve the data from a server that sends either (nginx, Apache, S3, GCS, any CDN), or "
            "never rewrite a file that a run reads.",
            redact_url(url),
        )


class RemoteFileAccess:
    """The remote half of a dataset's file access (a base of ``MemMapDataset``, whose attributes it uses)."""

    paths: list[str]
    label_mask_paths: Optional[list[str]]
    dtype: np.dtype
    remote: RemoteDataConfig
    fetch_stats: Optional[FetchStats]
    _layouts: dict[tuple[str, bool], Layout]
    _remote_files: dict[str, RemoteFile]
    _probe_errors: dict[tuple[str, bool], OLMoDataError]
    _mask_heads: dict[str, bytes]
    _recorded_masks: set[str]
    _cache_path: Optional[Path]
    _reuse_cache: bool
    _cache: Optional[MetadataCache]

    @property
    def has_remote_files(self) -> bool:
        raise NotImplementedError

    def _layout(self, path: str, is_mask: bool) -> Layout:
        raise NotImplementedError

    def _instance_bounds(self) -> np.ndarray:
        raise NotImplementedError

    def _remote_start(
        self, path: str, kind: str, key: str, keep_head: bool = False
    ) -> tuple[int, NpyHeader | None]:
        """A remote file's size and npy header: from the run's record after one metadata request, or, the first
        time, from a metadata request and a small range read of its start (kept with ``keep_head``: a label mask's
        first entries usually show a True, so checking it needs no other read)."""
        reader = remote_reader(path, self.remote)
        file = reader.stat(path, self.fetch_stats)
        cached = self._metadata_cache().get(path)
        if cached is not None and cached.version is None and file.version is None:
            _warn_unversioned(path)
        if cached is not None:
            if cached.size != file.size or (
                None not in (cached.version, file.version) and cached.version != file.version
            ):
                then, now = (cached.size, cached.version), (file.size, file.version)
                raise OLMoDataError(
                    f"{kind} '{redact_url(path)}' (an entry of {key}) changed since this run first read it (size and "
                    f"version {then} then, {now} now; recorded in {self._cache_path}), so its instances are no longer "
                    f"the ones the run's data order numbers. Restore the original file; or, to train on the new one "
                    f"from here, delete that record (instances already trained on are listed in "
                    f"save_folder/data-indices)."
                )
            self._remote_files[path] = file
            if keep_head:  # a mask the run's first launch checked (with the others, it labelled some tokens)
                self._recorded_masks.add(path)
            header = cached.header
            return file.size, None if header is None else NpyHeader(
                header["size"], tuple(header["shape"]), header["fortran_order"], np.dtype(header["dtype"])
            )
        self._remote_files[path] = file
        start = reader.read(file, 0, min(file.size, PROBE_BYTES), self.fetch_stats, probe=True)
        if keep_head:
            self._mask_heads[path] = start
        if not start.startswith(NPY_MAGIC):
            return file.size, None
        try:
            needed = npy_header_bytes(start) if len(start) >= 12 else len(start) + 1
            if needed > MAX_NPY_HEADER_BYTES:
                raise ValueError(f"it claims {needed} bytes, more than any array's header needs")
            if needed > len(start) and needed <= file.size:
                start = reader.read(file, 0, needed, self.fetch_stats, probe=True)
            return file.size, read_npy_header(io.BytesIO(start))
        except (ValueError, struct.error) as e:
            raise OLMoDataError(
                f"{kind} '{redact_url(path)}' (an entry of {key}) starts like an npy file (written by np.save) but "
                f"its header cannot be read: {e}. Re-save it with np.save, or write the array headerless with "
                f"ndarray.tofile."
            ) from None

    def _metadata_cache(self) -> MetadataCache:
        if self._cache is None:
            self._cache = MetadataCache(self._cache_path, read=self._reuse_cache)
        return self._cache

    def _probe_remote(self) -> None:
        """Find the layout of every remote file at once, on ``data.remote.max_concurrency`` threads. A file that
        fails keeps its error for the sequential checks to report in order; once one cannot be reached at all, the
        rest are not tried (they would most likely wait out the same retries)."""
        todo = [
            (path, is_mask)
            for paths, is_mask in ((self.paths, False), (self.label_mask_paths or [], True))
            for path in paths
            if is_remote(path) and (path, is_mask) not in self._layouts
        ]
        todo = list(dict.fromkeys(todo))
        if not todo:
            return
        unreachable = threading.Event()

        def probe(item: tuple[str, bool]) -> None:
            if unreachable.is_set():
                return
            try:
                self._layout(*item)
            except OLMoDataError as e:
                self._probe_errors[item] = e
                if isinstance(e, RemoteUnreachable):
                    unreachable.set()

        pool = fetch_pool(self.remote.max_concurrency)
        for future in [pool.submit(probe, item) for item in todo]:
            future.result()
        found = sum(item in self._layouts for item in todo)  # not those skipped once a host proved unreachable
        if found:
            log.info("Found the sizes of %d of %d remote files.", found, len(todo))

    def remote_records(self) -> dict[str, CachedFile]:
        """What this dataset found out about its remote files (for :meth:`save_remote_records`)."""
        self._instance_bounds()
        records = {}
        for (path, is_mask), layout in self._layouts.items():
            file = self._remote_files.get(path)
            if file is None:
                continue
            header = None
            if layout.header_bytes:
                dtype = np.dtype(np.bool_) if is_mask else self.dtype
                header = {
                    "size": layout.header_bytes,
                    "shape": [layout.n_items],
                    "fortran_order": False,
                    "dtype": dtype.str,
                }
            records[path] = CachedFile(file.size, file.version, header)
        return records

    def save_remote_records(self) -> None:
        """Add this dataset's remote files to the run's record (``metadata_cache``); call it on one rank, after
        the save folder has been claimed."""
        if self.has_remote_files and self._cache_path is not None:
            self._metadata_cache().save(self.remote_records().items())
