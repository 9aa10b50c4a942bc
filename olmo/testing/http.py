"""A real HTTP file server on 127.0.0.1 for tests and benchmarks of remote data (``http://`` token files).

:class:`FileServer` serves the files under a folder over HTTP/1.1 with keep-alive, as a CDN or nginx would:
``HEAD`` answers with ``Content-Length``, ``ETag`` and ``Last-Modified``; ``GET`` honours one ``Range:
bytes=a-b`` (``206`` with ``Content-Range``), or ignores it when made with ``ranges=False`` (``200`` and the
whole file, like ``python -m http.server``). The ETag is derived from the file's size and modification time,
so rewriting a file changes it.

For benchmarks it can add a fixed ``latency`` before every answer; for fault tests, :meth:`FileServer.inject`
queues faults that the next matching ``GET`` requests suffer (a 5xx status, a connection reset, a body cut
short, a stall past the client's timeout), and :attr:`FileServer.log` records every request with the bytes of
body it sent, so a test can count exactly what crossed the wire.
"""

from __future__ import annotations

import base64
import email.utils
import http.server
import os
import re
import socket
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union
from urllib.parse import unquote, urlsplit

__all__ = ["FAULTS", "FileServer", "Request", "touch_later"]

FAULTS = ("500", "503", "429", "reset", "short", "stall", "ignore-range")
"""What :meth:`FileServer.inject` can do to a request: answer with that status; close the connection without an
answer; send the headers and half the body, then close; wait ``stall_seconds`` before answering; answer a range
request with the whole file (``200``)."""

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a client opens dozens of connections at once; the default backlog of 5 drops some

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up (as a client refusing a whole file does) is not an error of the server."""
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


@dataclass
class Request:
    """One request the server received."""

    method: str
    path: str
    range: Optional[str]
    status: int
    body_bytes: int
    """Bytes of body sent (0 for HEAD and for refused requests)."""
    fault: Optional[str] = None


@dataclass
class _Fault:
    kind: str
    path: Optional[str]
    remaining: int


class FileServer:
    """Serves ``root`` at ``http://127.0.0.1:PORT/``; use as a context manager, or call :meth:`start`/:meth:`stop`.

    :param root: the folder whose files are served (``url("a/b.npy")`` is ``root/a/b.npy``).
    :param latency: seconds added before every answer (a distant server).
    :param ranges: honour ``Range`` headers; False answers every ``GET`` with the whole file.
    :param stall_seconds: how long the ``stall`` fault waits before answering.
    :param auth: ``(user, password)``: answer 401 to every request without them as HTTP Basic credentials.
    :param validators: send ``ETag`` and ``Last-Modified``; False serves files as a server that sends neither.
    """

    def __init__(
        self,
        root: Union[str, Path],
        *,
        latency: float = 0.0,
        ranges: bool = True,
        stall_seconds: float = 5.0,
        auth: Optional[tuple[str, str]] = None,
        validators: bool = True,
    ):
        self.root = Path(root).resolve()
        self.latency = latency
        self.ranges = ranges
        self.stall_seconds = stall_seconds
        self.validators = validators
        self.authorization = None
        if auth is not None:
            self.authorization = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode("ascii")
        self.hang_range: Optional[tuple[int, int]] = None
        """Bytes ``[a, b)`` of every file: a ``GET`` whose range overlaps them waits ``stall_seconds`` before its
        answer (a server that hangs on one part of a file, e.g. the instance one rank reads)."""
        self.log: list[Request] = []
        self.faults_served: Counter[str] = Counter()
        """How many requests suffered each fault so far (counted when the fault begins)."""
        self._faults: deque[_Fault] = deque()
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _handler_class(self))
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def url(self, relative: str = "") -> str:
        """The URL of ``root/relative``."""
        return f"http://127.0.0.1:{self.port}/{relative.lstrip('/')}"

    def start(self) -> FileServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="file-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def inject(self, kind: str, count: int = 1, path: Optional[str] = None) -> None:
        """Make the next ``count`` ``GET`` requests (for ``path`` only, a path relative to ``root``, when given)
        suffer ``kind`` (one of :data:`FAULTS`); ``count=-1`` makes it permanent until :meth:`clear_faults`."""
        assert kind in FAULTS, f"unknown fault {kind!r}; one of {FAULTS}"
        with self._lock:
            self._faults.append(_Fault(kind, None if path is None else "/" + path.lstrip("/"), count))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    def body_bytes(self, method: str = "GET") -> int:
        """Bytes of body sent so far for requests of ``method``."""
        with self._lock:
            return sum(r.body_bytes for r in self.log if r.method == method)

    def _take_fault(self, path: str) -> Optional[str]:
        with self._lock:
            for fault in self._faults:
                if fault.path is None or fault.path == path:
                    if fault.remaining > 0:
                        fault.remaining -= 1
                    if fault.remaining == 0:
                        self._faults.remove(fault)
                    self.faults_served[fault.kind] += 1
                    return fault.kind
        return None

    def _record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)


def _handler_class(server: FileServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections
        # Headers and body go out in separate writes; with Nagle's algorithm the body would wait for the
        # client's delayed ACK of the headers (~40 ms a request), which no real server adds.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read FileServer.log instead
            pass

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        def _answer(self, head: bool) -> None:
            if server.latency:
                time.sleep(server.latency)
            path = unquote(urlsplit(self.path).path)
            range_header = self.headers.get("Range")
            record = Request(self.command, path, range_header, 0, 0)
            server._record(record)  # logged before the answer goes out, completed as it does
            try:
                if server.authorization is not None and self.headers.get("Authorization") != server.authorization:
                    return self._status(401, record)
                file = (server.root / path.lstrip("/")).resolve()
                if server.root not in file.parents or not file.is_file():
                    return self._status(404, record)
                fault = None if head else server._take_fault(path)
                record.fault = fault
                if fault in ("500", "503", "429"):
                    return self._status(int(fault), record)
                if fault == "reset":
                    self._reset()
                    return
                if fault == "stall" or (not head and _overlaps(range_header, server.hang_range)):
                    time.sleep(server.stall_seconds)
                stat = file.stat()
                size = stat.st_size
                start, stop = 0, size
                partial = False
                if range_header is not None and server.ranges and fault != "ignore-range" and not head:
                    match = _RANGE.match(range_header.strip())
                    if match is None:
                        return self._status(400, record)
                    start = int(match.group(1))
                    stop = min(size, int(match.group(2)) + 1) if match.group(2) else size
                    if start >= size or stop <= start:
                        record.status = 416
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    partial = True
                record.status = 206 if partial else 200
                self.send_response(record.status)
                self.send_header("Content-Length", str(stop - start))
                if server.validators:
                    self.send_header("ETag", f'"{size:x}-{stat.st_mtime_ns:x}"')
                    self.send_header("Last-Modified", email.utils.formatdate(stat.st_mtime, usegmt=True))
                if server.ranges:
                    self.send_header("Accept-Ranges", "bytes")
                if partial:
                    self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
                self.end_headers()
                if head:
                    return
                with open(file, "rb") as f:
                    f.seek(start)
                    body = f.read(stop - start)
                if fault == "short":
                    body = body[: len(body) // 2]
                record.body_bytes = len(body)
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a 200 it refused)
                    pass
                if fault == "short":  # end the connection cleanly (FIN) with the body incomplete
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_WR)
            except OSError:  # the client went away
                pass

        def _status(self, status: int, record: Request) -> None:
            record.status = status
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _reset(self) -> None:
            """Drop the connection at once (RST), without an answer or the rest of one."""
            self.close_connection = True
            try:
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                self.connection.close()
            except OSError:
                pass

    return Handler


def _overlaps(range_header: Optional[str], hang: Optional[tuple[int, int]]) -> bool:
    """Whether the bytes a ``Range`` header asks for (all of the file without one) overlap ``[hang)``."""
    if hang is None:
        return False
    match = _RANGE.match((range_header or "bytes=0-").strip())
    if match is None:
        return False
    start = int(match.group(1))
    stop = int(match.group(2)) + 1 if match.group(2) else 2**63
    return start < hang[1] and hang[0] < stop


def touch_later(path: Union[str, Path]) -> None:
    """Give ``path`` a newer modification time (a new ETag) without changing its bytes."""
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m olmo.testing.http FOLDER [--latency S] [--no-ranges]``: serve FOLDER until killed, printing the
    port first (benchmarks run the server in its own process, so that it does not share the loader's CPU time)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added before every answer")
    parser.add_argument("--no-ranges", action="store_true", help="ignore Range headers")
    args = parser.parse_args(argv)
    server = FileServer(args.folder, latency=args.latency, ranges=not args.no_ranges)
    print(server.port, flush=True)
    server._server.serve_forever(0.05)


if __name__ == "__main__":
    main()
