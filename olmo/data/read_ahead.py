"""Fetching ahead of use: the training order is known in advance, so a loader can ask for the next instances
while the model trains on the current ones.

:func:`read_ahead` yields ``get(item)`` for each item in order while up to ``window`` later items are already
being fetched on the process's :func:`fetch_pool`, a pool of daemon threads: unlike ``ThreadPoolExecutor``'s
threads, a fetch stuck in its retries never holds up the exit of a process that is stopping.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["DaemonPool", "fetch_pool", "read_ahead"]

T = TypeVar("T")
R = TypeVar("R")


class DaemonPool:
    """``size`` daemon threads (started at the first call) that run submitted calls.

    :param size: the most calls that run at once.
    """

    def __init__(self, size: int, name: str = "olmo-fetch"):
        assert size >= 1, "a pool needs at least one thread"
        self.size, self.name = size, name
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        with self._lock:
            if not self._started:
                for i in range(self.size):
                    threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True).start()
                self._started = True
        future: Future[R] = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits on the future
                    future.set_exception(e)


_pools: dict[tuple[int, int], DaemonPool] = {}
_pools_lock = threading.Lock()


def fetch_pool(size: int) -> DaemonPool:
    """This process's pool of ``size`` fetch threads (a forked DataLoader worker gets its own)."""
    key = (os.getpid(), size)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = DaemonPool(size)
        return _pools[key]


def read_ahead(get: Callable[[T], R], items: Iterable[T], window: int, pool: DaemonPool) -> Iterator[R]:
    """``get(item)`` for each of ``items``, in order, with up to ``window`` items fetched ahead on ``pool``.

    An item's exception is raised when its turn comes; closing the iterator cancels what has not started.
    """
    pending: deque[Future[R]] = deque()
    it = iter(items)
    try:
        for item in it:
            pending.append(pool.submit(get, item))
            if len(pending) >= window:
                break
        while pending:
            result = pending.popleft().result()
            for item in it:
                pending.append(pool.submit(get, item))
                break
            yield result
    finally:
        for future in pending:
            future.cancel()
