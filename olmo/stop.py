"""Stopping a run on request: SIGTERM/SIGINT become a flag the trainer checks after every step, and the
run then saves a checkpoint and exits with :data:`EXIT_CODE_STOPPED`."""

from __future__ import annotations

import logging
import signal
from typing import Any, Optional

__all__ = ["EXIT_CODE_STOPPED", "StopRequest"]

log = logging.getLogger(__name__)

EXIT_CODE_STOPPED = 75
"""Exit code after SIGTERM/SIGINT or ``time_limit``: a checkpoint was saved; relaunch to resume."""


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag checked after every step; a second signal exits at once."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.reason = signal.Signals(signum).name
        log.warning("Received %s: saving a checkpoint after this step, then exiting.", self.reason)
        self.uninstall()
