"""The trainer's side of the callback protocol (:class:`olmo.train.callback.Loop`): :class:`LoopControl` holds the
callbacks, calls their hooks, keeps the phase the loop is in, and records what callbacks ask of the loop (a rewind,
a stop, a restart of the throughput clock) for :meth:`olmo.train.Trainer.fit` to carry out."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

from ..exceptions import OLMoTrainingError
from .callback import Callback

if TYPE_CHECKING:
    from ..distributed import DistEnv
    from .metrics_sinks import MetricsCallback
    from .stop import StopConditions

__all__ = ["LoopControl", "MAX_REWINDS_TO_ONE_CHECKPOINT"]

log = logging.getLogger(__name__)

MAX_REWINDS_TO_ONE_CHECKPOINT = 10
"""Rewinds to one checkpoint in one launch; the next one stops the run (with ``stability.rollback`` enabled, at
least ``max_rollbacks`` + 1, so that its own limit speaks first). Retraining the same steps from the same checkpoint
gives the same result, so a callback that asks again would otherwise rewind forever."""


class LoopControl:
    """What a callback may ask of the loop, and the dispatch of the hooks (a base of the trainer, which provides
    ``log_metrics``). It owns what callbacks ask for: the trainer reads it through :attr:`stop_reason`,
    :meth:`take_rewind_request` and :meth:`take_clock_restart`, and sets up each ``fit`` with :meth:`begin_loop`."""

    metrics: MetricsCallback
    """The metrics-logging callback (set by :meth:`begin_loop`)."""
    _stop: StopConditions

    def __init__(self, callbacks: list[Callback], state: Any, env: DistEnv):
        self.user_callbacks = callbacks
        self.state, self.env = state, env
        self.callbacks: list[Callback] = []  # in the order they run (set by begin_loop)
        self._phase: tuple[Optional[str], int] = (None, 0)
        self._rewind_request: Optional[tuple[int, str]] = None
        self._rewinds_to: dict[int, list[str]] = {}  # this launch's rewinds, by the step of their checkpoint
        self._stop_reason: Optional[str] = None
        self._clock_restarted = False

    def begin_loop(self, stop: StopConditions, metrics: MetricsCallback, callbacks: list[Callback]) -> None:
        """A ``fit`` begins: its stop conditions, metrics callback and callbacks in the order they run; nothing
        asked for yet."""
        self._stop, self.metrics, self.callbacks = stop, metrics, callbacks
        self._stop_reason, self._rewind_request, self._rewinds_to, self._clock_restarted = None, None, {}, False

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the ranks agreed to stop, once they did (the loop ends after the current hooks)."""
        return self._stop_reason

    @property
    def rewind_requested(self) -> bool:
        return self._rewind_request is not None

    def take_rewind_request(self) -> Optional[tuple[int, str]]:
        """The rewind a callback asked for (``before_step``, reason), now being carried out, or None."""
        request, self._rewind_request = self._rewind_request, None
        return request

    def take_clock_restart(self) -> bool:
        """Whether the time since the last step was not training (:meth:`restart_clock`), once."""
        restarted, self._clock_restarted = self._clock_restarted, False
        return restarted

    def log_metrics(self, collect: bool = True) -> None:
        raise NotImplementedError

    def call_hook(self, hook: str, ctx: Any) -> None:
        """Call ``hook`` of every callback; a ``post_step`` ends early once a callback asks to rewind or stop."""
        for callback in self.callbacks:
            getattr(callback, hook)(ctx)
            if hook == "post_step" and (self._rewind_request is not None or self._stop_reason is not None):
                return

    def rewind(self, before_step: int, reason: str) -> None:
        if self._rewind_request is None:
            self._rewind_request = (before_step, reason)

    def _count_rewind(self, from_step: int, to_step: int, reason: str, limit: int) -> None:
        """Count a rewind from ``from_step`` to the checkpoint of ``to_step``, before anything is undone.

        :raises OLMoTrainingError: when it would be rewind number ``limit`` + 1 to that checkpoint in this launch.
        """
        reasons = self._rewinds_to.setdefault(to_step, [])
        if len(reasons) >= limit:
            raise OLMoTrainingError(
                f"Step {from_step}: {reason}; a callback asked to rewind to the checkpoint of step {to_step} again, "
                f"after {len(reasons)} rewinds to it in this launch (the first: {reasons[0]}). At most {limit} go back "
                f"to one checkpoint (olmo.train.loop_control.MAX_REWINDS_TO_ONE_CHECKPOINT): the same steps trained "
                f"again from it give the same result, so the rewinds would never end. Stopping with the checkpoints "
                f"as they are. Make the callback ask once per problem (remember the steps it rewound from) or change "
                f"something before it asks again; then resume with --try_load_latest_save."
            )
        reasons.append(reason)

    def stop(self, reason: str) -> None:
        if self._stop.request.reason is None:  # agreed on by every rank, with signals and the time limit
            self._stop.request.reason = reason

    def _finish(self, reason: str) -> None:
        """The ranks agreed to stop (the stop callback): the loop ends after the current hooks."""
        if self._stop_reason is None:
            self._stop_reason = reason

    def restart_clock(self) -> None:
        self._clock_restarted = True

    def flush_metrics(self) -> None:
        self.log_metrics()

    def waiting(self, interruptible: bool = True) -> contextlib.AbstractContextManager[None]:
        return self._stop.waiting(interruptible)

    @contextlib.contextmanager
    def phase(self, name: str, step: Optional[int] = None) -> Iterator[None]:
        """The loop is in phase ``name`` of ``step`` (default: the last trained) for the block (``on_phase``)."""
        previous = self._phase
        self._enter_phase(name, self.state.global_step if step is None else step)
        try:
            yield
        finally:
            self._enter_phase(*previous)

    def _enter_phase(self, name: Optional[str], step: int) -> None:
        self._phase = (name, step)
        for callback in self.callbacks:
            callback.on_phase(name, step)

    def log_results(self, step: int, metrics: dict[str, float], records: dict[str, Any]) -> None:
        """Log an evaluation's metrics (in full on the console) and its non-numeric records (samples)."""
        self.metrics.logger.log(step, metrics, console_keys=sorted(metrics))
        if records:
            self.metrics.logger.log_records(step, records)

    def log_event(self, step: int, message: str) -> None:
        """A line about the run (a stage begins, a rollback, a stop), on rank 0's console."""
        if self.env.rank == 0:
            log.info("[step=%d] %s", step, message)
