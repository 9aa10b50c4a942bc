"""The readers of remote token files, one per scheme: ``http(s)://`` (urllib3, kept-alive pools), ``s3://``,
``r2://`` and ``weka://`` (boto3, S3 API) and ``gs://`` (google-cloud-storage), and :func:`remote_reader`, which
picks one for a URL. What they share (retries, byte-range checks, version checks, the errors) is
:class:`olmo.data.remote.RemoteReader`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import astuple
from typing import Any, NoReturn, Optional, TypeVar
from urllib.parse import urlsplit

from ..config.data_sections import RemoteDataConfig
from ..exceptions import OLMoDataError
from ..util import redact_url, split_remote
from ..util.object_store import credentials_help, endpoint_problem
from ..util.secrets import redact_text, url_credentials
from .remote import (
    CONTENT_RANGE,
    FileChanged,
    RemoteFile,
    RemoteReader,
    RemoteUnreachable,
    TransientFault,
    network_fault,
)

__all__ = ["remote_reader"]

T = TypeVar("T")


def _missing(url: str) -> NoReturn:
    raise OLMoDataError(
        f"'{redact_url(url)}' does not exist (the server answered 404). Check the URL in the config, or run the data "
        f"preparation script that writes it."
    ) from None


def _denied(url: str, scheme: str, detail: str) -> NoReturn:
    if scheme in ("http", "https"):
        host = urlsplit(url).hostname or ""
        sent = (
            "the URL's user:password@ part"
            if url_credentials(url)
            else f"the netrc entry for {host}"
            if _netrc_credentials(host)
            else "none"
        )
        where = (
            f" Credentials sent: {sent}. For http(s):// data, give them in ~/.netrc (or the file NETRC names) as a line "
            f"'machine {host} login USER password PASSWORD' (sent as HTTP Basic); keep them out of "
            f"the config."
        )
    else:
        where = f" {credentials_help(scheme)}."
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
        from urllib.request import proxy_bypass

        scheme = split_remote(url)[0]
        if scheme in self._proxies and not proxy_bypass(urlsplit(url).hostname or ""):
            return self._proxies[scheme]
        return self._pools[scheme]

    def _request(self, method: str, url: str, headers: dict[str, str]) -> Any:
        authorization = http_authorization(url)
        if authorization is not None:
            # urllib3 drops it on a redirect to another host (Retry.remove_headers_on_redirect).
            headers = {**headers, "Authorization": authorization}
        try:
            return self._pool(url).request(method, url, headers=headers, preload_content=False)
        except self._urllib3.exceptions.MaxRetryError as e:  # a redirect loop, or the connection failed
            raise network_fault(e.reason or e, url) from None
        except self._urllib3.exceptions.HTTPError as e:
            raise network_fault(e, url) from None

    def _check_status(self, url: str, status: int) -> None:
        if status == 404 or status == 410:
            _missing(url)
        if status in (401, 403):
            _denied(url, split_remote(url)[0], f"HTTP {status}")
        if status == 429 or status >= 500:
            raise TransientFault(f"HTTP {status}")
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
                raise FileChanged(f"HTTP {response.status} for bytes {start}-{stop - 1}")
            self._check_status(file.url, response.status)
            if response.status != 206:
                raise OLMoDataError(
                    f"'{redact_url(file.url)}': unexpected answer HTTP {response.status} to a range request."
                )
            _check_content_range(response.headers.get("Content-Range"), file, start, stop)
            version = _version(response.headers)
            if file.version is not None and version is not None and version != file.version:
                raise FileChanged(f"version {file.version} then, {version} now")
            try:
                return response.read()
            except self._urllib3.exceptions.HTTPError as e:  # reset or cut short while reading the body
                raise network_fault(e, file.url) from None
        finally:
            _finish(response)


def http_authorization(url: str) -> Optional[str]:
    """The ``Authorization`` header for an ``http(s)://`` URL: HTTP Basic with the URL's own ``user:password@`` (or
    ``token@``) as curl and requests send it, else with the host's entry in ``~/.netrc`` (or the file ``NETRC`` names),
    else None. The URL's credentials are masked wherever the trainer writes or prints it; the netrc file keeps
    them out of the config altogether."""
    import base64

    credentials = url_credentials(url)
    if credentials is None:
        credentials = _netrc_credentials(urlsplit(url).hostname or "")
    if credentials is None:
        return None
    token = base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode()).decode("ascii")
    return f"Basic {token}"


def _netrc_credentials(host: str) -> Optional[tuple[str, str]]:
    import netrc

    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    if not host or not os.path.isfile(path):
        return None
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError) as e:
        raise OLMoDataError(
            f"The netrc file '{path}' cannot be read ({type(e).__name__}: {redact_text(str(e))}); it holds the "
            f"credentials for http(s):// data. Fix it, or point NETRC at another file."
        ) from None
    if entry is None:
        return None
    login, _, password = entry
    return login or "", password or ""


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
    match = CONTENT_RANGE.match(header or "")
    if match is None:
        raise TransientFault(f"the answer has no valid Content-Range header ({header!r})")
    first, last, total = int(match.group(1)), int(match.group(2)), match.group(3)
    if total != "*" and int(total) != file.size:
        raise FileChanged(f"{file.size} bytes then, {total} now")
    if (first, last) != (start, stop - 1):
        raise TransientFault(f"the server sent bytes {first}-{last} for a request of {start}-{stop - 1}")


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
                raise FileChanged(code) from None
            if status in (401, 403) or code in (
                "AccessDenied",
                "403",
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
            ):
                _denied(url, self.scheme, code or f"HTTP {status}")
            if status == 429 or status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError"):
                raise TransientFault(f"{code or 'HTTP'} {status}".strip()) from None
            raise OLMoDataError(
                f"'{redact_url(url)}' could not be read: {code} {error.get('Message', '')}".strip()
            ) from None
        except (errors.BotoCoreError, OSError) as e:  # endpoint unreachable, connection reset, timeouts
            raise network_fault(e, url) from None

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
            raise network_fault(e, file.url) from None


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
            raise FileChanged("its generation changed") from None
        except exceptions.RequestRangeNotSatisfiable:
            raise FileChanged("the range is past its end") from None
        except (exceptions.Forbidden, exceptions.Unauthorized) as e:
            _denied(url, "gs", str(e.code))
        except (exceptions.TooManyRequests, exceptions.ServerError, TransportError) as e:
            raise network_fault(e, url) from None
        except exceptions.GoogleAPICallError as e:
            raise OLMoDataError(f"'{redact_url(url)}' could not be read: {e}") from None
        except OSError as e:  # requests' connection errors and timeouts
            raise network_fault(e, url) from None

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
