"""Retrying an operation that fails now and then (a network request, an upload) with exponentially growing waits.

What a caller decides: how many tries, the waits (:class:`Backoff`), which exceptions are worth another try, what
happens before each retry (a log line, a counter), and an event that stops the retries early (a process that is
shutting down). Everything else propagates at once, and so does the error of the last try.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, TypeVar, Union

__all__ = ["Backoff", "call_with_retries"]

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


@dataclass(frozen=True)
class Backoff:
    """The waits between tries: ``first_s`` before the second try, multiplied by ``factor`` before each later one,
    at most ``max_s``."""

    first_s: float
    """Seconds to wait after the first failed try."""
    factor: float = 2.0
    """How much longer each following wait is."""
    max_s: float = math.inf
    """The longest wait, in seconds."""
    jitter: bool = False
    """Wait a random time from the upper half of each wait instead (uniformly), so that processes that failed
    together (every rank, on one outage) do not all retry at the same moment."""

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1: the wait after the first failed try)."""
        delay = min(self.max_s, self.first_s * self.factor ** (retry - 1))
        return delay / 2 + random.uniform(0, delay / 2) if self.jitter else delay


def call_with_retries(
    attempt: Callable[[], T],
    *,
    attempts: int,
    backoff: Backoff,
    retry_on: Union[type[E], tuple[type[E], ...]],
    on_retry: Optional[Callable[[int, E, float], None]] = None,
    stop: Optional[threading.Event] = None,
) -> T:
    """Call ``attempt`` until it returns, at most ``attempts`` times, and return what it returned. After a failed
    try ``n`` that raised one of ``retry_on``, ``on_retry(n, error, delay)`` is called and the next try waits
    ``backoff.delay(n)`` seconds. An exception not in ``retry_on`` propagates at once; so does the exception of
    the last try.

    :param attempts: tries in all (at least 1).
    :param on_retry: called before each wait, with the try that failed (counting from 1), its exception and the
        wait in seconds: log it, count it. An exception it raises propagates and ends the retries.
    :param stop: once set, no further try is made (the last error propagates); a wait ends early when it is set.
    """
    assert attempts >= 1, f"attempts={attempts}: at least one try"
    for n in range(1, attempts + 1):
        try:
            return attempt()
        except retry_on as error:
            if n == attempts or (stop is not None and stop.is_set()):
                raise
            delay = backoff.delay(n)
            if on_retry is not None:
                on_retry(n, error, delay)
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                raise
    raise AssertionError("unreachable: the last try returns or raises")
