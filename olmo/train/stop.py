"""When a run stops (:class:`StopConditions`): at its last step, or on request: SIGTERM/SIGINT become a flag
the trainer checks after every step, as it does ``time_limit``, and the run then saves a checkpoint and exits
with :data:`EXIT_CODE_STOPPED`."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..distributed.collectives import all_reduce
from .callback import Callback, EndContext, StepContext

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

__all__ = ["EXIT_CODE_STOPPED", "StopNow", "StopRequest", "StopConditions", "StopCallback"]

log = logging.getLogger(__name__)

EXIT_CODE_STOPPED = 75
"""Exit code after SIGTERM/SIGINT or ``time_limit``: a checkpoint was saved; relaunch to resume."""


class StopNow(Exception):
    """Raised by the signal handler inside a wait that may not end by itself (see :meth:`StopConditions.waiting`):
    a data fetch stuck on a silent server, an evaluation reading remote data."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag checked after every step, or into :class:`StopNow` while the trainer waits
    (:attr:`waiting`); a second signal exits at once."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self.waiting = False
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        self._pid = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # a forked DataLoader worker (Ctrl-C signals them too): the training process stops them
        self.reason = signal.Signals(signum).name
        self.uninstall()
        if self.waiting:
            self.waiting = False
            log.warning("Received %s while waiting: stopping the wait now.", self.reason)
            raise StopNow(self.reason)
        log.warning("Received %s: saving a checkpoint after this step, then exiting.", self.reason)


class StopConditions:
    """When a run stops, for :meth:`olmo.train.Trainer.fit`: at :attr:`stop_at` (``max_duration``, ``stop_at`` and
    ``stop_after``, whichever comes first), on SIGTERM/SIGINT on any rank, or past ``time_limit`` seconds.

    Use it as a context manager around the loop: it installs the signal handlers and starts the clock.
    """

    def __init__(self, cfg: TrainConfig, start_step: int, max_steps: int):
        stop_at = min(cfg.stop_at or max_steps, max_steps)
        if cfg.stop_after is not None:
            stop_at = min(stop_at, start_step + cfg.stop_after)
        self.stop_at: int = stop_at
        self.time_limit = cfg.time_limit
        self.request = StopRequest()
        self.start_time = time.monotonic()

    def __enter__(self) -> StopConditions:
        self.request.install()
        self.start_time = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.request.uninstall()

    @contextmanager
    def waiting(self, interruptible: bool = True) -> Iterator[None]:
        """Around a wait that only the outside world can end (fetching a batch, an evaluation): a signal raises
        :class:`StopNow` inside it instead of waiting for the step to end (unless not ``interruptible``)."""
        self.request.waiting = interruptible and self.request.reason is None
        try:
            yield
        finally:
            self.request.waiting = False

    def elapsed(self) -> float:
        """Seconds since the loop started."""
        return time.monotonic() - self.start_time

    def agree(self, writing: bool = False) -> tuple[Optional[str], bool]:
        """One small collective per step, so that all ranks act together: the reason to stop now (a signal on any
        rank, or the time limit), or None; and whether no rank is ``writing`` a background checkpoint any more."""
        reason = self.request.reason
        if reason is None and self.time_limit is not None and self.elapsed() > self.time_limit:
            reason = "time_limit"
        flags = all_reduce(torch.tensor([float(reason is not None), float(writing)]), dist.ReduceOp.MAX).tolist()
        return reason or ("stop requested on another rank" if flags[0] > 0 else None), flags[1] == 0


class StopCallback(Callback):
    """The stop agreement as a loop callback: after each step (its metrics logged), one small collective tells every
    rank whether any wants to stop and whether any is still writing a background checkpoint, which is committed once
    none is; a stop is asked of the loop, and ``post_train`` says how the run stops (before the final checkpoint)."""

    def __init__(self, conditions: StopConditions, checkpointer: Checkpointer, finish: Callable[[str], None]):
        self.conditions, self.checkpointer, self.finish = conditions, checkpointer, finish

    def post_step(self, ctx: StepContext) -> None:
        ckpt = self.checkpointer
        reason, all_written = self.conditions.agree(writing=ckpt.is_writing())
        if all_written and ckpt.pending is not None:
            ckpt.commit()
        if reason is not None:
            self.finish(reason)

    def post_train(self, ctx: EndContext) -> None:
        if ctx.how == "stopped":
            ctx.loop.log_event(ctx.step, f"Stopping ({ctx.reason}); saving a checkpoint.")
        elif ctx.how == "interrupted" and ctx.world_size > 1:
            log.warning(
                "Stopping (%s) while waiting for data at step %d, without a checkpoint of it.",
                ctx.reason,
                ctx.step,
            )
        elif ctx.how == "interrupted":
            ctx.loop.log_event(ctx.step, f"Stopping ({ctx.reason}) while waiting; saving a checkpoint.")
