"""When a run stops (:class:`StopConditions`): at its last step, or on request: SIGTERM/SIGINT become a flag
the trainer checks after every step, as it does ``time_limit``, and the run then saves a checkpoint and exits
with :data:`EXIT_CODE_STOPPED`. A second signal aborts at once, without that checkpoint, in one line that names the
newest committed checkpoint and the steps lost, with :data:`EXIT_CODE_ABORTED`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..distributed.collectives import all_reduce
from ..util import env_rank
from ..util.checkpoint_dirs import list_checkpoints
from ..util.secrets import redact_text
from .callback import Callback, EndContext, StepContext

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

__all__ = [
    "EXIT_CODE_STOPPED",
    "EXIT_CODE_ABORTED",
    "StopNow",
    "StopRequest",
    "StopConditions",
    "StopLimits",
    "StopCallback",
    "checkpoint_progress",
    "checkpoint_summary",
]

log = logging.getLogger(__name__)

EXIT_CODE_STOPPED = 75
"""Exit code after SIGTERM/SIGINT or ``time_limit``: a checkpoint was saved; relaunch to resume."""

EXIT_CODE_ABORTED = 130
"""Exit code after a second SIGTERM/SIGINT (128 + SIGINT, as a shell reports Ctrl-C): no checkpoint was saved; the
steps after the newest committed one are lost."""


def checkpoint_progress(save_folder: str, step: int) -> str:
    """Where the newest committed checkpoint in ``save_folder`` leaves a run that trained ``step`` steps: which
    step it holds and the steps after it, which a stop without a checkpoint loses."""
    summary = checkpoint_summary(save_folder, step)
    if "steps after it (not saved)" in summary:
        lost = f"steps {summary['steps after it (not saved)']} are lost"
    else:
        lost = (
            "no step is lost" if summary["last checkpoint"] != "none" else f"the {step} step(s) trained are lost"
        )
    return f"last checkpoint: {summary['last checkpoint']} in '{save_folder}'; {lost}"


def checkpoint_summary(save_folder: str, step: int) -> dict[str, str]:
    """The run summary's lines on the newest committed checkpoint in ``save_folder`` (``last checkpoint``: its step
    and path, or none) and on the steps trained after it, up to ``step`` (which a relaunch with
    ``--try_load_latest_save`` trains again)."""
    checkpoints = list_checkpoints(save_folder)
    if not checkpoints:
        return {"last checkpoint": "none"}
    last = checkpoints[-1]
    lost = {"steps after it (not saved)": f"{last.step + 1}-{step}"} if step > last.step else {}
    return {"last checkpoint": f"step {last.step} ({last.path})", **lost}


class StopNow(Exception):
    """Raised by the signal handler inside a wait that may not end by itself (see :meth:`StopConditions.waiting`):
    a data fetch stuck on a silent server, an evaluation reading remote data."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag checked after every step, or into :class:`StopNow` while the trainer waits
    (:attr:`waiting`); a second signal aborts the process at once (:data:`EXIT_CODE_ABORTED`), in one line.

    :param save_folder: the run's, named by the messages (the checkpoints there tell what an abort loses).
    :param current_step: the steps trained so far, for the abort's line.
    """

    def __init__(self, save_folder: str = ".", current_step: Callable[[], int] = lambda: 0) -> None:
        self.reason: Optional[str] = None
        self.waiting = False
        self.save_folder, self.current_step = save_folder, current_step
        self._signals = 0
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
        name = signal.Signals(signum).name
        self._signals += 1
        if self._signals > 1:
            self._abort(name)
        self.reason = name
        again = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else name
        advice = (
            f"then exiting with code {EXIT_CODE_STOPPED}; to resume, relaunch the same command with "
            f"--try_load_latest_save (it continues from the newest checkpoint in '{self.save_folder}'). A second "
            f"{again} aborts at once, without that checkpoint: the steps after the newest committed one are lost."
        )
        if self.waiting:
            self.waiting = False
            log.warning("Received %s while waiting: stopping the wait now, saving a checkpoint, %s", name, advice)
            raise StopNow(name)
        log.warning("Received %s: saving a checkpoint after this step, %s", name, advice)

    def _abort(self, name: str) -> None:
        """The second signal: one line on rank 0 (written straight to the file descriptor: the signal may have
        interrupted a write to ``sys.stderr``), then the process ends without unwinding (no traceback, no save)."""
        if env_rank() == 0:
            progress = checkpoint_progress(self.save_folder, self.current_step())
            line = (
                f"\nReceived a second {name}: aborted without saving a checkpoint (exit code {EXIT_CODE_ABORTED}); "
                f"{progress}. Resume by relaunching the same command with --try_load_latest_save.\n"
            )
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError, RuntimeError):  # RuntimeError: a reentrant call, mid-write
                    pass
            os.write(2, redact_text(line).encode(errors="replace"))
        os._exit(EXIT_CODE_ABORTED)


@dataclass(frozen=True)
class StopLimits:
    """When a run stops before its last step: at step ``stop_at``, after ``stop_after`` steps of this launch, or
    past ``time_limit`` seconds (the config's keys of these names; None: no such limit)."""

    stop_at: Optional[int] = None
    stop_after: Optional[int] = None
    time_limit: Optional[float] = None


class StopConditions:
    """When a run stops, for :meth:`olmo.train.Trainer.fit`: at :attr:`stop_at` (``max_duration``, ``stop_at`` and
    ``stop_after``, whichever comes first), on SIGTERM/SIGINT on any rank, or past ``time_limit`` seconds.

    Use it as a context manager around the loop: it installs the signal handlers and starts the clock.
    """

    def __init__(
        self,
        save_folder: str,
        start_step: int,
        max_steps: int,
        current_step: Callable[[], int] = lambda: 0,
        limits: StopLimits = StopLimits(),
    ):
        stop_at = min(limits.stop_at or max_steps, max_steps)
        if limits.stop_after is not None:
            stop_at = min(stop_at, start_step + limits.stop_after)
        self.stop_at: int = stop_at
        self.time_limit = limits.time_limit
        self.request = StopRequest(save_folder, current_step)
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
