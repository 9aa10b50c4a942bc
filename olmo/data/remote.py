"""Token files read in place, by byte range: ``http(s)://``, ``s3://``, ``r2://``, ``weka://`` and ``gs://``.

Nothing is downloaded whole. A remote file costs one metadata request for its size and version (HEAD,
``head_object``, blob metadata), one small range read of its start for an npy header (only the first time a
run sees it: :class:`MetadataCache`), and then one range read of exactly the bytes of each instance it
supplies (tokens; the label mask's bytes from the mask file). The clients are urllib3 (HTTP), boto3 (the S3
API; endpoints and credentials as :mod:`olmo.util.object_store` reads them) and google-cloud-storage. Each loader
process makes its own clients, keeps ``data.remote.max_concurrency`` connections open for reuse, and fetches
ahead of use (:func:`olmo.data.read_ahead.read_ahead`).

Every request is checked and retried as a careful downloader would:

* A transient failure (5xx or 429, connection refused or reset, timeout, a body shorter than asked for) is
  retried with exponential backoff and jitter, up to ``data.remote.max_attempts`` tries in all.
* A permanent failure (no such file, access denied, missing credentials, a server that ignores ``Range`` and
  would send whole files) or the last failed try raises :class:`OLMoDataError` naming the URL, the byte range and
  the cause. Training never sees bytes that were not checked: each body's length must match the range asked for.
* A file's version (ETag; generation on GCS; Last-Modified when a server sends no ETag) and size are recorded
  when the run first reads it. Every later answer must carry the same ones (S3 and GCS are asked to enforce it:
  ``If-Match``, ``ifGenerationMatch``), so a file replaced while a run uses it is an error, never silently other
  data.

Counters of what was fetched (:class:`FetchStats`) live in shared memory, so DataLoader workers add to the same
totals the trainer logs as ``throughput/data_bytes_fetched``.
"""

from __future__ import annotations

import abc
import json
import logging
import multiprocessing
import multiprocessing.context
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional, TypeVar
from urllib.parse import urlsplit

import numpy as np

from ..config.data_sections import RemoteDataConfig
from ..exceptions import OLMoDataError
from ..util import REMOTE_DATA_SCHEMES, Backoff, atomic_write, call_with_retries, redact_url, split_remote
from ..util.secrets import redact_text

__all__ = [
    "FetchStats",
    "METADATA_CACHE_NAME",
    "MetadataCache",
    "RemoteArray",
    "RemoteFile",
    "RemoteReader",
    "RemoteUnreachable",
    "is_remote",
    "raise_changed",
    "FileChanged",
    "TransientFault",
    "CONTENT_RANGE",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def is_remote(path: str) -> bool:
    """Whether ``path`` is a URL that is read by byte range (``file://`` and plain paths are local)."""
    return split_remote(path)[0] in REMOTE_DATA_SCHEMES


@dataclass(frozen=True)
class RemoteFile:
    """What a metadata request says about a remote file."""

    url: str
    size: int
    """Bytes."""
    version: Optional[str]
    """ETag (HTTP, S3), generation (GCS), or ``Last-Modified`` (HTTP without ETag); None when the server sends
    neither, and then only the size is compared."""


class RemoteUnreachable(OLMoDataError):
    """A remote file could not be reached at all (retries exhausted, no credentials): later files would most
    likely fail the same way, so checks stop at the first one."""


class TransientFault(Exception):
    """A failure worth another try (the server or the network may recover).

    :param timeout: the server (or the path to it) did not answer within ``data.remote.timeout_seconds``.
    """

    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


class HostUnresolved(RemoteUnreachable):
    """The URL's host name does not resolve (no network, no DNS, or a misspelled host): not worth a retry."""


TIMEOUTS_BEFORE_GIVING_UP = 2
"""Attempts in a row that time out before a file counts as unreachable: a server that accepts connections and never
answers costs ``2 * data.remote.timeout_seconds``, not ``max_attempts`` times that."""


def _exception_chain(error: BaseException) -> list[BaseException]:
    """``error`` and what it wraps: causes, contexts, and the errors that urllib3 (``reason``) and botocore
    (``kwargs["error"]``) hold."""
    seen: list[BaseException] = []
    todo: list[Any] = [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or any(e is s for s in seen):
            continue
        seen.append(e)
        kwargs = getattr(e, "kwargs", None)
        todo += [e.__cause__, e.__context__, getattr(e, "reason", None)]
        todo += [kwargs.get("error")] if isinstance(kwargs, dict) else []
    return seen


def network_fault(error: BaseException, url: str) -> TransientFault:
    """The :class:`TransientFault` for a client library's network error (to raise); a host name that does not
    resolve raises :class:`HostUnresolved` instead."""
    import socket

    chain = _exception_chain(error)
    if any(isinstance(e, socket.gaierror) or "NameResolution" in type(e).__name__ for e in chain):
        kwargs = [getattr(e, "kwargs", None) or {} for e in chain]
        endpoints = [k["endpoint_url"] for k in kwargs if isinstance(k, dict) and "endpoint_url" in k]
        if endpoints:  # an object store's endpoint (botocore), not the bucket
            where = f"the endpoint '{redact_url(str(endpoints[0]))}' used for '{redact_url(url)}'"
        else:
            where = f"'{redact_url(url)}'"
        host = urlsplit(str(endpoints[0]) if endpoints else url).hostname or split_remote(url)[1]
        raise HostUnresolved(
            f"Cannot resolve the host name '{host}' of {where}: this machine has no network or no DNS, "
            f"or the host is misspelled (not retried). Check the URL. Offline, train on local copies "
            f"(--data.paths=[...], and --data.label_mask_paths=[...] if the config has masks) and leave out "
            f"evaluators whose data is remote (--evaluators=[] drops them all), as for the official configs, whose "
            f"data and evaluation sets are URLs."
        ) from None
    timeout = any(isinstance(e, TimeoutError) or "Timeout" in type(e).__name__ for e in chain)
    return TransientFault(f"{type(error).__name__}: {redact_text(str(error))}", timeout=timeout)


class FileChanged(Exception):
    """The file is not the one the run recorded (another version or size)."""


class FetchStats:
    """What this dataset's remote reads cost, summed over the training process and its DataLoader workers
    (shared memory, passed to the workers with the dataset)."""

    FIELDS = ("bytes", "probe_bytes", "requests", "metadata_requests", "retries")
    """Body bytes received (all of them; ``probe_bytes`` of them read npy headers), range requests, metadata
    requests, and retries after transient failures."""

    def __init__(self) -> None:
        self._values = multiprocessing.Array("q", len(self.FIELDS))

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory can only be handed to a process being started (a DataLoader worker); any other copy
        # (pickling the dataset for something else) counts on its own.
        if multiprocessing.context.get_spawning_popen() is not None:
            return {"values": self._values}
        return {"values": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._values = (
            state["values"] if state["values"] is not None else multiprocessing.Array("q", len(self.FIELDS))
        )

    def add(self, **counts: int) -> None:
        with self._values.get_lock():
            for name, value in counts.items():
                self._values[self.FIELDS.index(name)] += value

    def snapshot(self) -> dict[str, int]:
        with self._values.get_lock():
            return dict(zip(self.FIELDS, self._values[:]))


class RemoteReader(abc.ABC):
    """Range reads and metadata requests for one scheme in one process (its clients are shared by threads).

    :meth:`stat` and :meth:`read` retry transient failures and raise :class:`OLMoDataError` for the rest.
    """

    def __init__(self, options: RemoteDataConfig):
        self.options = options

    @abc.abstractmethod
    def _stat(self, url: str) -> RemoteFile:
        """One metadata request."""

    @abc.abstractmethod
    def _read(self, file: RemoteFile, start: int, stop: int) -> bytes:
        """One range request for bytes ``[start, stop)``, checked against ``file``'s size and version."""

    def stat(self, url: str, stats: Optional[FetchStats] = None) -> RemoteFile:
        file = self._retrying(lambda: self._stat(url), url, None, stats)
        if stats is not None:
            stats.add(metadata_requests=1)
        return file

    def read(
        self, file: RemoteFile, start: int, stop: int, stats: Optional[FetchStats] = None, probe: bool = False
    ) -> bytes:
        """Bytes ``[start, stop)`` of ``file``, exactly ``stop - start`` of them (``probe``: counted as a header
        read)."""
        if stop <= start:
            return b""

        def attempt() -> bytes:
            body = self._read(file, start, stop)
            if len(body) != stop - start:
                raise TransientFault(f"the server sent {len(body)} bytes for a range of {stop - start}")
            return body

        body = self._retrying(attempt, file.url, (start, stop), stats)
        if stats is not None:
            stats.add(bytes=len(body), requests=1, probe_bytes=len(body) if probe else 0)
        return body

    def _retrying(
        self,
        attempt: Callable[[], T],
        url: str,
        byte_range: Optional[tuple[int, int]],
        stats: Optional[FetchStats] = None,
    ) -> T:
        what = "the size of" if byte_range is None else f"bytes {byte_range[0]}-{byte_range[1] - 1} of"
        attempts, timeouts = self.options.max_attempts, 0

        def before_retry(n: int, e: TransientFault, delay: float) -> None:
            nonlocal timeouts
            timeouts = timeouts + 1 if e.timeout else 0
            if timeouts >= TIMEOUTS_BEFORE_GIVING_UP:
                raise RemoteUnreachable(
                    f"The server of '{redact_url(url)}' accepted the connection but did not answer {timeouts} "
                    f"requests in a row within data.remote.timeout_seconds={self.options.timeout_seconds:g} s "
                    f"({e}). Check that it is up and serving. If it is only slow, raise data.remote.timeout_seconds; "
                    f"then relaunch (with --try_load_latest_save if the run has checkpoints)."
                ) from None
            log.warning(
                "Reading %s '%s' failed (attempt %d of %d: %s); retrying in %.1f s.",
                what,
                redact_url(url),
                n,
                attempts,
                e,
                delay,
            )
            if stats is not None:
                stats.add(retries=1)

        # Jitter: ranks that failed together spread out.
        backoff = Backoff(self.options.backoff_seconds, max_s=self.options.max_backoff_seconds, jitter=True)
        try:
            return call_with_retries(
                attempt, attempts=attempts, backoff=backoff, retry_on=TransientFault, on_retry=before_retry
            )
        except FileChanged as e:
            raise_changed(url, str(e))
        except TransientFault as e:  # the last try's
            raise RemoteUnreachable(
                f"Could not read {what} '{redact_url(url)}' after {attempts} attempts; the last one failed "
                f"with: {e}. Check that the server is up and reachable from this machine. For a flaky "
                f"connection, raise data.remote.max_attempts or data.remote.timeout_seconds; then resume "
                f"with --try_load_latest_save (the last committed checkpoint is intact)."
            ) from None


def raise_changed(url: str, detail: str) -> NoReturn:
    raise OLMoDataError(
        f"'{redact_url(url)}' changed since this run first read it ({detail}), so its instances are no longer the "
        f"ones the run's data order numbers. Restore the original file, or train on the new one in a new run "
        f"(another save_folder, or --save_overwrite). Instances already trained on are listed in "
        f"save_folder/data-indices."
    ) from None


class RemoteArray:
    """A read-only 1-D array of ``dtype`` items stored in a remote file from byte ``offset`` on: slicing it
    reads exactly the bytes of the slice (one range request), as slicing a memmap reads its pages."""

    def __init__(
        self, reader: RemoteReader, file: RemoteFile, offset: int, n_items: int, dtype: np.dtype, stats: FetchStats
    ):
        self.reader, self.file, self.offset = reader, file, offset
        self.dtype = np.dtype(dtype)
        self.shape = (n_items,)
        self.stats = stats

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: slice) -> np.ndarray:
        assert isinstance(index, slice), "a RemoteArray is read by slices (one range request each)"
        start, stop, step = index.indices(len(self))
        assert step == 1, "a RemoteArray is read by contiguous slices"
        stop = max(start, stop)
        size = self.dtype.itemsize
        body = self.reader.read(self.file, self.offset + start * size, self.offset + stop * size, self.stats)
        return np.frombuffer(body, dtype=self.dtype)


CACHE_FORMAT = 1
METADATA_CACHE_NAME = "remote_files.json"
"""The run's record of its remote files, in ``save_folder/train_data/``."""


@dataclass
class CachedFile:
    """What a run recorded about a remote file the first time it read it."""

    size: int
    version: Optional[str]
    header: Optional[dict[str, Any]]
    """The npy header (``size``, ``shape``, ``fortran_order``, ``dtype``), or None for a headerless file."""


class MetadataCache:
    """``save_folder/train_data/remote_files.json``: each remote file's size, version and npy header, as the run
    first found them. A relaunch checks each file with one metadata request against it (a changed file is an
    error) and skips the header reads. Rank 0 writes it (atomically) after the save folder is claimed.

    :param path: the file; None keeps the records in memory only.
    :param read: start from what the file holds; False starts empty (and :meth:`save` replaces the file).
    """

    def __init__(self, path: Optional[Path], read: bool = True):
        self.path = path
        self.files: dict[str, CachedFile] = {}
        if read and path is not None and path.is_file():
            try:
                raw = json.loads(path.read_text())
                assert raw["format"] == CACHE_FORMAT
                self.files = {url: CachedFile(**entry) for url, entry in raw["files"].items()}
            except (ValueError, KeyError, TypeError, AssertionError) as e:
                log.warning("Ignoring %s: it cannot be read (%s); every remote file is probed again.", path, e)

    def get(self, url: str) -> Optional[CachedFile]:
        """The record of ``url``, if any."""
        return self.files.get(redact_text(url))

    def save(self, files: Iterable[tuple[str, CachedFile]]) -> None:
        """Add ``files`` to the records and write them (to :attr:`path`, through a temporary file). Records are keyed
        by the URL with its credentials masked (:func:`~olmo.util.secrets.redact_text`): no secret reaches the file."""
        self.files.update((redact_text(url), entry) for url, entry in files)
        if self.path is None:
            return
        payload = {
            "format": CACHE_FORMAT,
            "files": {url: asdict(entry) for url, entry in sorted(self.files.items())},
        }
        atomic_write(self.path, json.dumps(payload, indent=1) + "\n")
