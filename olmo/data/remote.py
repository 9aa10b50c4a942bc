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
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional, TypeVar

import numpy as np

from ..config.data_sections import RemoteDataConfig
from ..exceptions import OLMoDataError
from ..util import REMOTE_DATA_SCHEMES, redact_url, split_remote
from ..util.object_store import credentials_help, endpoint_problem

__all__ = [
    "FetchStats",
    "METADATA_CACHE_NAME",
    "MetadataCache",
    "RemoteArray",
    "RemoteFile",
    "RemoteReader",
    "RemoteUnreachable",
    "is_remote",
    "remote_reader",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


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


class _Transient(Exception):
    """A failure worth another try (the server or the network may recover)."""


class _Changed(Exception):
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
                raise _Transient(f"the server sent {len(body)} bytes for a range of {stop - start}")
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
        attempts = self.options.max_attempts
        for n in range(1, attempts + 1):
            try:
                return attempt()
            except _Changed as e:
                _changed(url, str(e))
            except _Transient as e:
                if n == attempts:
                    raise RemoteUnreachable(
                        f"Could not read {what} '{redact_url(url)}' after {attempts} attempts; the last one failed "
                        f"with: {e}. Check that the server is up and reachable from this machine. For a flaky "
                        f"connection, raise data.remote.max_attempts or data.remote.timeout_seconds; then resume "
                        f"with --try_load_latest_save (the last committed checkpoint is intact)."
                    ) from None
                delay = min(self.options.max_backoff_seconds, self.options.backoff_seconds * 2 ** (n - 1))
                delay = delay / 2 + random.uniform(0, delay / 2)  # jitter: ranks that failed together spread out
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
                time.sleep(delay)
        raise AssertionError("unreachable")


def _changed(url: str, detail: str) -> NoReturn:
    raise OLMoDataError(
        f"'{redact_url(url)}' changed since this run first read it ({detail}), so its instances are no longer the "
        f"ones the run's data order numbers. Restore the original file, or train on the new one in a new run "
        f"(another save_folder, or --save_overwrite). Instances already trained on are listed in "
        f"save_folder/data-indices."
    ) from None


def _missing(url: str) -> NoReturn:
    raise OLMoDataError(
        f"'{redact_url(url)}' does not exist (the server answered 404). Check the URL in the config, or run the data "
        f"preparation script that writes it."
    ) from None


def _denied(url: str, scheme: str, detail: str) -> NoReturn:
    where = "" if scheme in ("http", "https") else f" {credentials_help(scheme)}."
    raise OLMoDataError(
        f"Access to '{redact_url(url)}' was denied ({detail}). Check that the credentials this process uses may read "
        f"it.{where}"
    ) from None


def _no_credentials(url: str, scheme: str, error: BaseException) -> NoReturn:
    raise RemoteUnreachable(
        f"No credentials to read '{redact_url(url)}' ({type(error).__name__}): {credentials_help(scheme)}. Set them "
        f"in the environment of every training process (secrets are never read from the config)."
    ) from None


class _HttpReader(RemoteReader):
    """``http(s)://`` through one urllib3 pool per host (thread-safe, keep-alive); honours ``HTTP(S)_PROXY``."""

    def __init__(self, options: RemoteDataConfig):
        from urllib.request import getproxies

        import urllib3

        super().__init__(options)
        self._urllib3 = urllib3
        timeout = urllib3.Timeout(connect=options.timeout_seconds, read=options.timeout_seconds)
        # Retries are ours (with backoff, and a check of every body); urllib3 only follows redirects.
        retries = urllib3.Retry(total=None, connect=0, read=0, other=0, status=0, redirect=5)
        kwargs: dict[str, Any] = {"maxsize": options.max_concurrency, "timeout": timeout, "retries": retries}
        proxies = getproxies()
        self._pools = {scheme: urllib3.PoolManager(**kwargs) for scheme in ("http", "https")}
        self._proxies: dict[str, Any] = {
            scheme: urllib3.ProxyManager(proxies[scheme], **kwargs)
            for scheme in ("http", "https")
            if scheme in proxies
        }

    def _pool(self, url: str) -> Any:
        from urllib.parse import urlsplit
        from urllib.request import proxy_bypass

        scheme = split_remote(url)[0]
        if scheme in self._proxies and not proxy_bypass(urlsplit(url).hostname or ""):
            return self._proxies[scheme]
        return self._pools[scheme]

    def _request(self, method: str, url: str, headers: dict[str, str]) -> Any:
        try:
            return self._pool(url).request(method, url, headers=headers, preload_content=False)
        except self._urllib3.exceptions.MaxRetryError as e:  # a redirect loop, or the connection failed
            raise _Transient(f"{type(e.reason).__name__}: {e.reason}") from None
        except self._urllib3.exceptions.HTTPError as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None

    def _check_status(self, url: str, status: int) -> None:
        if status == 404 or status == 410:
            _missing(url)
        if status in (401, 403):
            _denied(url, split_remote(url)[0], f"HTTP {status}")
        if status == 429 or status >= 500:
            raise _Transient(f"HTTP {status}")
        if status >= 400:
            raise OLMoDataError(f"'{redact_url(url)}' could not be read: the server answered HTTP {status}.")

    def _stat(self, url: str) -> RemoteFile:
        response = self._request("HEAD", url, {"Accept-Encoding": "identity"})
        try:
            self._check_status(url, response.status)
            length = response.headers.get("Content-Length")
            if length is None:
                raise OLMoDataError(
                    f"'{redact_url(url)}': the server does not say how large the file is (no Content-Length in its "
                    f"answer to HEAD), so its instances cannot be counted. Serve it from a server that does (any "
                    f"static file server, S3, GCS), or list a local copy."
                )
            return RemoteFile(url, int(length), _version(response.headers))
        finally:
            _finish(response)

    def _read(self, file: RemoteFile, start: int, stop: int) -> bytes:
        headers = {"Range": f"bytes={start}-{stop - 1}", "Accept-Encoding": "identity"}
        response = self._request("GET", file.url, headers)
        try:
            if response.status == 200:
                response.close()  # never read the body: it is the whole file
                raise OLMoDataError(
                    f"The server of '{redact_url(file.url)}' ignores byte ranges (it answered a request for bytes "
                    f"{start}-{stop - 1} with the whole file, HTTP 200), so every instance would cost a download of "
                    f"the file. Serve the files from a server that supports Range requests (nginx, Apache, S3, GCS, "
                    f"a CDN), or download them and list the local copies in the config."
                )
            if response.status in (412, 416):
                raise _Changed(f"HTTP {response.status} for bytes {start}-{stop - 1}")
            self._check_status(file.url, response.status)
            if response.status != 206:
                raise OLMoDataError(
                    f"'{redact_url(file.url)}': unexpected answer HTTP {response.status} to a range request."
                )
            _check_content_range(response.headers.get("Content-Range"), file, start, stop)
            version = _version(response.headers)
            if file.version is not None and version is not None and version != file.version:
                raise _Changed(f"version {file.version} then, {version} now")
            try:
                return response.read()
            except self._urllib3.exceptions.HTTPError as e:  # reset or cut short while reading the body
                raise _Transient(f"{type(e).__name__}: {e}") from None
        finally:
            _finish(response)


def _finish(response: Any) -> None:
    """Hand the connection back for reuse once the answer is read to its end (an error's body is short), or
    drop it when it cannot be (closed, broken)."""
    try:
        if not response.closed:
            response.drain_conn()
        response.release_conn()
    except Exception:  # a broken connection: urllib3 opens a new one next time
        response.close()


def _version(headers: Any) -> Optional[str]:
    etag = headers.get("ETag")
    if etag:
        return str(etag)
    modified = headers.get("Last-Modified")
    return f"Last-Modified: {modified}" if modified else None


def _check_content_range(header: Optional[str], file: RemoteFile, start: int, stop: int) -> None:
    match = _CONTENT_RANGE.match(header or "")
    if match is None:
        raise _Transient(f"the answer has no valid Content-Range header ({header!r})")
    first, last, total = int(match.group(1)), int(match.group(2)), match.group(3)
    if total != "*" and int(total) != file.size:
        raise _Changed(f"{file.size} bytes then, {total} now")
    if (first, last) != (start, stop - 1):
        raise _Transient(f"the server sent bytes {first}-{last} for a request of {start}-{stop - 1}")


class _S3Reader(RemoteReader):
    """``s3://``, ``r2://`` and ``weka://`` through one boto3 client (clients are thread-safe)."""

    def __init__(self, options: RemoteDataConfig, scheme: str):
        from botocore import exceptions

        from ..util.object_store import s3_client

        super().__init__(options)
        self.scheme = scheme
        self._errors = exceptions
        try:
            self.client = s3_client(
                scheme,
                max_attempts=1,
                max_pool_connections=options.max_concurrency,
                timeout=options.timeout_seconds,
            )
        except exceptions.ProfileNotFound as e:
            raise RemoteUnreachable(f"Cannot read {scheme}:// data: {e}. {credentials_help(scheme)}.") from None

    def _call(self, url: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        errors = self._errors
        _, bucket, key = split_remote(url)
        try:
            return method(Bucket=bucket, Key=key, **kwargs)
        except (errors.NoCredentialsError, errors.PartialCredentialsError) as e:
            _no_credentials(url, self.scheme, e)
        except errors.ClientError as e:
            error = e.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
                _missing(url)
            if code in ("PreconditionFailed", "InvalidRange", "412", "416"):
                raise _Changed(code) from None
            if status in (401, 403) or code in (
                "AccessDenied",
                "403",
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
            ):
                _denied(url, self.scheme, code or f"HTTP {status}")
            if status == 429 or status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError"):
                raise _Transient(f"{code or 'HTTP'} {status}".strip()) from None
            raise OLMoDataError(
                f"'{redact_url(url)}' could not be read: {code} {error.get('Message', '')}".strip()
            ) from None
        except (errors.BotoCoreError, OSError) as e:  # endpoint unreachable, connection reset, timeouts
            raise _Transient(f"{type(e).__name__}: {e}") from None

    def _stat(self, url: str) -> RemoteFile:
        head = self._call(url, self.client.head_object)
        return RemoteFile(url, int(head["ContentLength"]), head.get("ETag"))

    def _read(self, file: RemoteFile, start: int, stop: int) -> bytes:
        kwargs: dict[str, Any] = {"Range": f"bytes={start}-{stop - 1}"}
        if file.version is not None:
            kwargs["IfMatch"] = file.version
        response = self._call(file.url, self.client.get_object, **kwargs)
        _check_content_range(response.get("ContentRange"), file, start, stop)
        try:
            return response["Body"].read()
        except (self._errors.BotoCoreError, OSError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None


class _GcsReader(RemoteReader):
    """``gs://`` through google-cloud-storage, one client per thread (its clients are not documented as
    thread-safe)."""

    def __init__(self, options: RemoteDataConfig):
        super().__init__(options)
        self._local = threading.local()

    def _bucket(self, name: str) -> Any:
        from ..util.object_store import gcs_client

        buckets = getattr(self._local, "buckets", None)
        if buckets is None:
            buckets = self._local.buckets = {}
            self._local.client = gcs_client()
        if name not in buckets:
            buckets[name] = self._local.client.bucket(name)
        return buckets[name]

    def _call(self, url: str, call: Callable[[Any], T]) -> T:
        from google.api_core import exceptions
        from google.auth.exceptions import DefaultCredentialsError, TransportError

        _, bucket, key = split_remote(url)
        try:
            return call(self._bucket(bucket).blob(key))
        except DefaultCredentialsError as e:
            _no_credentials(url, "gs", e)
        except exceptions.NotFound:
            _missing(url)
        except exceptions.PreconditionFailed:
            raise _Changed("its generation changed") from None
        except exceptions.RequestRangeNotSatisfiable:
            raise _Changed("the range is past its end") from None
        except (exceptions.Forbidden, exceptions.Unauthorized) as e:
            _denied(url, "gs", str(e.code))
        except (exceptions.TooManyRequests, exceptions.ServerError, TransportError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None
        except exceptions.GoogleAPICallError as e:
            raise OLMoDataError(f"'{redact_url(url)}' could not be read: {e}") from None
        except OSError as e:  # requests' connection errors and timeouts
            raise _Transient(f"{type(e).__name__}: {e}") from None

    def _stat(self, url: str) -> RemoteFile:
        def metadata(blob: Any) -> RemoteFile:
            blob.reload(timeout=self.options.timeout_seconds, retry=None)
            return RemoteFile(url, int(blob.size), None if blob.generation is None else str(blob.generation))

        return self._call(url, metadata)

    def _read(self, file: RemoteFile, start: int, stop: int) -> bytes:
        generation = None if file.version is None else int(file.version)
        return self._call(
            file.url,
            lambda blob: blob.download_as_bytes(
                start=start,
                end=stop - 1,
                if_generation_match=generation,
                checksum=None,  # a range has no whole-object checksum; lengths are checked instead
                timeout=self.options.timeout_seconds,
                retry=None,
            ),
        )


_readers: dict[tuple[Any, ...], RemoteReader] = {}
_READER_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "S3_PROFILE",
    "R2_ENDPOINT_URL",
    "R2_PROFILE",
    "R2_ACCESS_KEY_ID",
    "WEKA_ENDPOINT_URL",
    "WEKA_PROFILE",
    "WEKA_ACCESS_KEY_ID",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
)
"""The environment a reader's clients are made from: a reader is made anew when one of them changes."""
_readers_lock = threading.Lock()


def remote_reader(url: str, options: RemoteDataConfig) -> RemoteReader:
    """This process's reader for ``url``'s scheme (made once per process and environment: a forked DataLoader worker
    makes its own connections instead of sharing its parent's sockets).

    :raises OLMoDataError: when the scheme needs an endpoint that the environment does not name.
    """
    scheme = split_remote(url)[0]
    problem = endpoint_problem(scheme)
    if problem is not None:
        raise RemoteUnreachable(f"Cannot read '{redact_url(url)}': {problem}.")
    family = "http" if scheme in ("http", "https") else scheme
    key = (os.getpid(), family, astuple(options), tuple(os.environ.get(v) for v in _READER_ENV))
    with _readers_lock:
        if key not in _readers:
            if family == "http":
                _readers[key] = _HttpReader(options)
            elif family == "gs":
                _readers[key] = _GcsReader(options)
            else:
                _readers[key] = _S3Reader(options, scheme)
        return _readers[key]


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

    def save(self, files: Iterable[tuple[str, CachedFile]]) -> None:
        """Add ``files`` to the records and write them (to :attr:`path`, through a temporary file)."""
        self.files.update(files)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        payload = {
            "format": CACHE_FORMAT,
            "files": {url: asdict(entry) for url, entry in sorted(self.files.items())},
        }
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        os.replace(tmp, self.path)
