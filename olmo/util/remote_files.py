"""Whole-file downloads from ``http(s)://`` URLs (a remote ``load_path``, a config, a tokenizer), through cached-path,
with timeouts.

cached-path's own HTTP client sends its requests without a timeout, so a server that accepts the connection and
never answers holds the run forever. :class:`TimedHttpClient` is a cached-path scheme client (registered with
``cached_path.add_scheme_client``) whose requests wait at most :func:`remote_timeout` seconds to connect and the
same between two pieces of an answer: a slow download of a large file goes on as long as bytes keep coming, a
silent server fails after that time. ``OLMO_REMOTE_TIMEOUT`` (seconds, default 60) changes it.
"""

from __future__ import annotations

import io
import os
from typing import Any, Optional

from ..exceptions import OLMoCliError

__all__ = [
    "REMOTE_TIMEOUT_ENV",
    "RemoteTimeoutError",
    "RemoteAccessDenied",
    "denied_status",
    "remote_timeout",
    "install_timed_http_client",
    "is_timeout",
]

REMOTE_TIMEOUT_ENV = "OLMO_REMOTE_TIMEOUT"
DEFAULT_REMOTE_TIMEOUT = 60.0
_installed = False


class RemoteTimeoutError(OLMoCliError):
    """A download whose server did not answer within :func:`remote_timeout` (not a missing file)."""


class RemoteAccessDenied(OLMoCliError):
    """A download the server refused (HTTP 401 or 403): the file may well be there (not a missing file)."""


def denied_status(error: BaseException) -> Optional[int]:
    """401 or 403 when ``error`` is a download the server refused, else None."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    return status if status in (401, 403) else None


def remote_timeout() -> float:
    """Seconds a download waits to connect, and between two pieces of an answer (``OLMO_REMOTE_TIMEOUT``)."""
    text = os.environ.get(REMOTE_TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_REMOTE_TIMEOUT
    except ValueError:
        value = DEFAULT_REMOTE_TIMEOUT
    return value if 0 < value < float("inf") else DEFAULT_REMOTE_TIMEOUT


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a request that timed out."""
    import requests

    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, (requests.exceptions.Timeout, TimeoutError)):
            return True
        if isinstance(seen, requests.exceptions.ConnectionError) and "timed out" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def install_timed_http_client() -> None:
    """Make cached-path download ``http(s)://`` files with :class:`TimedHttpClient` (once per process)."""
    global _installed
    if _installed:
        return
    from cached_path import add_scheme_client
    from cached_path.schemes.http import HttpClient

    class TimedHttpClient(HttpClient):  # type: ignore[misc]
        """cached-path's HTTP client, with a timeout on every request (see the module)."""

        def _session(self) -> Any:
            import requests

            session = requests.Session()
            session.headers.update(self.headers)
            return session

        _head_response: Any

        @property
        def head_response(self) -> Any:
            if self._head_response is None:
                with self._session() as session:
                    timeout = remote_timeout()
                    response = session.head(self.resource, allow_redirects=True, timeout=(timeout, timeout))
                self.validate_response(response)
                self._head_response = response
            return self._head_response

        def get_resource(self, temp_file: io.BufferedWriter) -> None:
            with self._session() as session:
                timeout = remote_timeout()
                response = session.get(self.resource, stream=True, timeout=(timeout, timeout))
                self.validate_response(response)
                for chunk in response.iter_content(chunk_size=1 << 20):
                    temp_file.write(chunk)

    add_scheme_client(TimedHttpClient)
    _installed = True
