"""The hang watchdog (``stability.watchdog``): a thread per rank that ends the rank when one phase of a step
(``data_wait``, ``forward_backward``, ``optimizer``, ``checkpoint``, ``evaluation``, ``upload_wait``) lasts longer
than its limit.

Before exiting it writes ``save_folder/hang-rank{R}.txt``: which phase, which step, for how long, then the Python
stack of every thread of the process (``faulthandler``, which works while the main thread is blocked in C code,
e.g. in a collective or a socket read). The other ranks see that file appear (the save folder is shared) and write
their own stacks the same way within a second, so a hang leaves every rank's stacks, not only the stuck one's. The
rank then exits with :data:`EXIT_CODE_HANG` without waiting for anything (a collective it might wait in is the
thing that hangs); torchrun then ends the other ranks, or restarts the job with ``--max-restarts``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from ..config.stability_sections import WATCHDOG_PHASES, WatchdogConfig
from .callback import Callback

__all__ = ["Watchdog", "WatchdogCallback", "EXIT_CODE_HANG", "HANG_FILE"]

log = logging.getLogger(__name__)

EXIT_CODE_HANG = 76
"""The exit code of a rank the watchdog ended (75 is a requested stop, :data:`olmo.train.stop.EXIT_CODE_STOPPED`)."""
HANG_FILE = "hang-rank{rank}.txt"


class Watchdog:
    """Times the phase the rank is in; a no-op unless ``cfg.enabled``.

    :param save_folder: where ``hang-rank{R}.txt`` goes (shared by the ranks).
    :param rank: this process's rank.
    :param world_size: how many ranks' stack files a rank that fires waits for (a few seconds at most) before it
        exits, since its exit can end a rank that is still blocked in a collective before that rank writes its own.
    """

    def __init__(self, cfg: WatchdogConfig, save_folder: str, rank: int, world_size: int = 1):
        self.enabled, self.rank, self.folder, self.world_size = cfg.enabled, rank, Path(save_folder), world_size
        self.limits = {phase: float(getattr(cfg, phase)) for phase in WATCHDOG_PHASES}
        self._phase: Optional[str] = None
        self._step = 0
        self._since = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._started = time.time()
        self.poll_seconds = min(1.0, min(self.limits.values()) / 10)

    def start(self) -> None:
        """Start watching (call once; the thread is a daemon and stops with :meth:`close`)."""
        if not self.enabled or self._thread is not None:
            return
        self._started = time.time()
        self._thread = threading.Thread(target=self._watch, name="olmo-watchdog", daemon=True)
        self._thread.start()
        log.info(
            "Watchdog on: limits %s s; a rank over one writes %s and exits with %d.",
            ", ".join(f"{k} {v:g}" for k, v in self.limits.items()),
            self.folder / HANG_FILE.format(rank=self.rank),
            EXIT_CODE_HANG,
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def enter(self, phase: str, step: int) -> None:
        """The rank is now in ``phase`` of ``step`` (its clock starts now)."""
        if self.enabled:
            with self._lock:
                self._phase, self._step, self._since = phase, step, time.monotonic()

    @contextlib.contextmanager
    def phase(self, phase: str, step: int) -> Iterator[None]:
        """``phase`` for the duration of the block; afterwards the phase before it again, with a fresh clock."""
        if not self.enabled:
            yield
            return
        previous = (self._phase, self._step)
        self.enter(phase, step)
        try:
            yield
        finally:
            with self._lock:
                self._phase, self._step, self._since = previous[0], previous[1], time.monotonic()

    def leave(self) -> None:
        """No phase: nothing is timed."""
        if self.enabled:
            with self._lock:
                self._phase = None

    # ------------------------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            with self._lock:
                phase, step, since = self._phase, self._step, self._since
            if phase is not None:
                elapsed = time.monotonic() - since
                if elapsed > self.limits[phase]:
                    self._fire(phase, step, elapsed, None)
            other = self._other_rank_hung()
            if other is not None:
                self._fire(phase, step, 0.0 if phase is None else time.monotonic() - since, other)

    def _hang_files(self) -> list[str]:
        """The hang files written during this run (by any rank)."""
        out = []
        try:
            for path in self.folder.glob(HANG_FILE.format(rank="*")):
                if path.stat().st_mtime >= self._started - 1:
                    out.append(path.name)
        except OSError:
            pass
        return sorted(out)

    def _other_rank_hung(self) -> Optional[str]:
        """The hang file another rank wrote during this run, if any."""
        others = [name for name in self._hang_files() if name != HANG_FILE.format(rank=self.rank)]
        return others[0] if others else None

    def _fire(self, phase: Optional[str], step: int, elapsed: float, other: Optional[str]) -> None:
        limit = self.limits.get(phase or "", math.nan)
        if other is None:
            why = f"phase {phase} of step {step} has lasted {elapsed:.1f} s, over its limit of {limit:g} s"
        else:
            why = f"another rank hung ({other}); this rank was in phase {phase or '(none)'} of step {step} for {elapsed:.1f} s"
        path = self.folder / HANG_FILE.format(rank=self.rank)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(
                    f"Watchdog of rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()}): {why}.\n"
                    f"Exit code {EXIT_CODE_HANG}. The Python stack of every thread of this process follows (most "
                    f"recent call first).\n\n"
                )
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            log.error("The watchdog could not write %s: %s", path, e)
        log.error(
            "Watchdog: rank %d ends the run: %s. Stacks of all its threads: %s. Exit code %d.",
            self.rank,
            why,
            path,
            EXIT_CODE_HANG,
        )
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        deadline = time.monotonic() + 3 * self.poll_seconds + 2
        while len(self._hang_files()) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.1)  # the other ranks write theirs while they are still blocked
        os._exit(EXIT_CODE_HANG)


class WatchdogCallback(Callback):
    """The watchdog as a loop callback: it starts with the run, times each phase the loop enters, and stops last."""

    def __init__(self, watchdog: Watchdog):
        self.watchdog = watchdog
        watchdog.start()  # before any other callback's pre_train: the step-0 checkpoint is timed too

    def on_phase(self, phase: Optional[str], step: int) -> None:
        if phase is None:
            self.watchdog.leave()
        else:
            self.watchdog.enter(phase, step)

    def close(self) -> None:
        self.watchdog.close()
