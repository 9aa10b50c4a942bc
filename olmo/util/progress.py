"""Progress of long work as log lines (which a log file keeps, unlike a terminal's progress bar): how far, the time
since the start, and an estimate of the time left from the rate so far."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Optional

__all__ = ["ProgressLog", "format_duration", "estimate_left"]


def format_duration(seconds: float) -> str:
    """``0:04:05``, ``12:00:00``, ``3d 01:02:03`` (whole seconds)."""
    total = max(0, int(round(seconds)))
    days, rest = divmod(total, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}" if days else clock


def estimate_left(done: float, total: float, seconds: float) -> Optional[float]:
    """Seconds left at the rate of ``done`` units in ``seconds``; None before any unit is done."""
    if done <= 0 or seconds <= 0:
        return None
    return max(0.0, (total - done) * seconds / done)


class ProgressLog:
    """Logs ``WHAT: 120/400 batches (30%), 0:01:02 elapsed, ~0:02:25 left`` at most every ``every_s`` seconds, and
    once at the end when the work took that long. Work that ends sooner logs nothing."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        logger: logging.Logger,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what, self.total, self.unit, self.log, self.every_s, self.clock = (
            what,
            total,
            unit,
            logger,
            every_s,
            clock,
        )
        self.start = self.last = clock()

    def update(self, done: int) -> None:
        now = self.clock()
        finished = done >= self.total
        if now - self.last < self.every_s and not (finished and now - self.start >= self.every_s):
            return
        self.last = now
        elapsed = now - self.start
        share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
        left = estimate_left(done, self.total, elapsed)
        tail = "" if finished or left is None else f", ~{format_duration(left)} left"
        self.log.info(
            "%s: %d/%d %s%s, %s elapsed%s",
            self.what,
            done,
            self.total,
            self.unit,
            share,
            format_duration(elapsed),
            tail,
        )
