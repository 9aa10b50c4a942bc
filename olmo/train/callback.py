"""The training loop's callback protocol: :class:`Callback` and the small context objects its hooks receive.

:meth:`olmo.train.Trainer.fit` is the loop itself (fetch a batch, train a step); everything around it is a callback
that the loop calls at fixed points, in list order:

===================  ==================================================================================================
hook                 when
===================  ==================================================================================================
``pre_train``        once, before the first step of this launch (after any restore)
``pre_step``         before the loop waits for the next step's batch
``post_step``        after each step; ``ctx.metrics`` is the step's record, which callbacks may add to before it is
                     logged (it is logged when its values are read back from the device)
``post_metrics``     when a step's metrics were read back, just before they are logged (``ctx.values``)
``pre_checkpoint``   before a checkpoint is written (``ctx.step``, ``ctx.kind``)
``post_checkpoint``  after a checkpoint is published (``ctx.path``)
``on_phase``         the loop entered a phase (``data_wait``, ``forward_backward``, ``optimizer``, ``checkpoint``,
                     ``evaluation``; None: no phase)
``on_stage``         a stage begins in this launch (``ctx.stage``; ``ctx.at_boundary`` at its first step, else a
                     resume within it), before the data moves to the stage's own; a run without ``stages`` is
                     one stage, so it is called once per launch
``on_rewind``        the run goes back to an earlier checkpoint (``ctx.to_step``, the data position it leaves)
``post_train``       once, after the last step of this launch (``ctx.how``: ``finished``, ``stopped`` or
                     ``interrupted``, a stop that came while waiting for data)
``on_error``         an exception left a step (``ctx.error``); a callback may recover by requesting a rewind
===================  ==================================================================================================

A hook gets a context, never the trainer: what it may do to the run goes through :class:`Loop` (``ctx.loop``), a
narrow interface the trainer implements: ask to rewind to a checkpoint before some step, ask to stop, restart the
throughput clock, flush the metrics read back so far, enter a phase, log. A rewind, and the stop the ranks agree on,
end the current step's remaining ``post_step`` hooks; the loop then carries them out. Every rank runs every hook:
a request must be made on every rank (base it on logged metrics, which every rank reads the same).

Built in, in this order, each with its :attr:`Callback.priority` (higher runs first): the watchdog (100), straggler
detection (90), spike skipping and rollback (80), throughput and MFU (70), metrics logging (60), the stop agreement
(50), checkpointing (40), stage entry (30: its event and a KL stage's boundary checkpoint), evaluation (20: in-loop
samples are its ``generate`` evaluators) and the Hugging Face export (10). Add your own from Python with
``Trainer(..., callbacks=[...])`` or ``olmo.cli.train.main(argv, callbacks=[...])``; configs never name code to
import (README, "Your own callbacks"). Yours run after every built-in (priority 0) unless their ``priority`` says
otherwise (e.g. 45: after the stop agreement, before checkpointing), and keep their own state across a restart with
``state_dict``/``load_state_dict`` (:mod:`olmo.train.callback_state`).
"""

from __future__ import annotations

import contextlib
import inspect
import reprlib
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from ..exceptions import OLMoConfigurationError

__all__ = [
    "Callback",
    "Loop",
    "RunContext",
    "StepContext",
    "MetricsContext",
    "CheckpointContext",
    "StageContext",
    "RewindContext",
    "EndContext",
    "ErrorContext",
    "check_callbacks",
    "ordered_callbacks",
]


class Loop(Protocol):
    """What a callback may ask of the training loop (the trainer implements it)."""

    def rewind(self, before_step: int, reason: str) -> None:
        """Go back to the newest committed checkpoint from before ``before_step`` once the current hooks return:
        the checkpoints written since are deleted, ``on_rewind`` hooks run, the model, optimizer and data position
        are restored from it, and training goes on from there. At most
        :data:`~olmo.train.loop_control.MAX_REWINDS_TO_ONE_CHECKPOINT` rewinds go back to one checkpoint in a launch;
        the next stops the run (``OLMoTrainingError``)."""

    def stop(self, reason: str) -> None:
        """Stop training, with a final checkpoint and exit code 75, as a signal would: every rank stops together at
        the next stop agreement, which follows the metrics logged after a step (asked from ``post_metrics``, the
        run stops after this step; from a later hook, after the next). ``post_train`` gets ``how="stopped"``."""

    def restart_clock(self) -> None:
        """The time since the last step was not training (a checkpoint, an evaluation): throughput restarts."""

    def flush_metrics(self) -> None:
        """Read back the steps' pending metrics and log the ready ones (``post_metrics`` hooks)."""

    def log_event(self, step: int, message: str) -> None:
        """A line about the run on rank 0's console (``[step=N] message``)."""

    def log_results(self, step: int, metrics: dict[str, float], records: dict[str, Any]) -> None:
        """Log an evaluation's metrics (in full on the console) and its records that are not numbers (samples)."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A block of the loop in phase ``name`` (``on_phase`` hooks; the previous phase afterwards)."""

    def waiting(self, interruptible: bool = True) -> contextlib.AbstractContextManager[None]:
        """A block that only the outside world ends (reading remote data): a stop signal interrupts it."""


@dataclass
class RunContext:
    """``pre_train``: where this launch starts."""

    step: int
    """Steps trained before this launch (0 for a fresh run)."""
    stop_at: int
    """The step this launch stops at."""
    restored_step: Optional[int]
    """The step of the checkpoint this launch restored, if any."""
    loop: Loop


@dataclass
class StepContext:
    """``pre_step`` (``step``: steps trained so far) and ``post_step`` (``step``: the step just trained)."""

    step: int
    stop_at: int
    loop: Loop
    metrics: dict[str, float] = field(default_factory=dict)
    """``post_step``: the step's metrics record (device values until read back); add host values to it."""
    data_wait: float = 0.0
    """``post_step``: seconds the step waited for its batch."""
    tokens_seen: int = 0
    """``post_step``: tokens trained on so far in the run (all ranks)."""
    clock_restarted: bool = False
    """``post_step``: the time before this step was not all training (a checkpoint, an evaluation, a new stage, a
    rewind: see :meth:`Loop.restart_clock`)."""


@dataclass
class MetricsContext:
    """``post_metrics``: one step's metrics, read back from the device, about to be logged."""

    step: int
    values: dict[str, float]
    loop: Loop
    instances: Any = None
    """``instances()``: the instance indices of that step's global batch, or None when no longer known."""


@dataclass
class CheckpointContext:
    """``pre_checkpoint`` and ``post_checkpoint``."""

    step: int
    kind: str
    """``sharded``, ``unsharded``, ``ephemeral`` or ``named``."""
    path: Optional[str] = None
    """``post_checkpoint``: where it was published."""


@dataclass
class StageContext:
    """``on_stage``: ``stage`` (a :class:`olmo.train.stages.Stage`) begins in this launch at ``step`` + 1."""

    step: int
    stage: Any
    at_boundary: bool
    """``step`` is the stage's start (its first step is next); False when the launch resumed within the stage."""
    staged: bool
    """The run has ``stages`` (otherwise its one stage is the whole run)."""
    loop: Loop


@dataclass
class RewindContext:
    """``on_rewind``: the run goes back from ``from_step`` to the checkpoint of ``to_step``."""

    from_step: int
    to_step: int
    before_step: int
    """The first step of the stretch that is undone (the rewind's target precedes it)."""
    reason: str
    order_dir: str
    """The data order the run was reading (``train_data`` or a stage's ``train_data/stageN``)."""
    epoch: int
    position: int
    """Instances of ``epoch`` consumed when the rewind was asked for."""
    rank: int
    loop: Loop


@dataclass
class EndContext:
    """``post_train``: how this launch ends."""

    step: int
    how: str
    """``finished`` (the last step), ``stopped`` (a signal, ``time_limit`` or a callback's ``stop``) or
    ``interrupted`` (a signal while one process waited for data or an evaluation, or while a callback's own
    interruptible ``waiting()`` ran: with several processes, other ranks may then be inside a collective)."""
    reason: Optional[str]
    world_size: int
    loop: Loop


@dataclass
class ErrorContext:
    """``on_error``: ``error`` left the step after ``step``."""

    step: int
    error: BaseException
    loop: Loop


class Callback:
    """A training-loop callback: override the hooks you need (every hook does nothing here)."""

    priority: int = 0
    """Where the callback runs among the others: higher first, equal ones in the order given (the built-ins' are in
    the module's docstring, 100 to 10); 0 runs after every built-in."""

    def state_dict(self) -> Optional[dict[str, Any]]:
        """What the callback keeps across a restart, saved in every checkpoint's trainer state (plain data: numbers,
        strings, lists, dicts, tensors) and handed to :meth:`load_state_dict` when the run resumes or rewinds; None
        (the default): nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned when the checkpoint being restored was saved."""

    def pre_train(self, ctx: RunContext) -> None:
        pass

    def pre_step(self, ctx: StepContext) -> None:
        pass

    def post_step(self, ctx: StepContext) -> None:
        pass

    def post_metrics(self, ctx: MetricsContext) -> None:
        pass

    def pre_checkpoint(self, ctx: CheckpointContext) -> None:
        pass

    def post_checkpoint(self, ctx: CheckpointContext) -> None:
        pass

    def on_phase(self, phase: Optional[str], step: int) -> None:
        pass

    def on_stage(self, ctx: StageContext) -> None:
        pass

    def on_rewind(self, ctx: RewindContext) -> None:
        pass

    def post_train(self, ctx: EndContext) -> None:
        pass

    def on_error(self, ctx: ErrorContext) -> None:
        pass

    def close(self) -> None:
        """Last of all, also after an error: release what the callback holds (threads, files)."""


HOOK_ARGUMENTS = {
    "pre_train": 1,
    "pre_step": 1,
    "post_step": 1,
    "post_metrics": 1,
    "pre_checkpoint": 1,
    "post_checkpoint": 1,
    "on_phase": 2,
    "on_stage": 1,
    "on_rewind": 1,
    "post_train": 1,
    "on_error": 1,
    "close": 0,
}
"""Every hook the loop calls, with the number of arguments it passes."""


def check_callbacks(callbacks: Any) -> list[Callback]:
    """``callbacks`` as a list, once each item is checked to be a :class:`Callback` instance whose hooks take the
    arguments the loop passes (before anything is written: a wrong item would otherwise fail at its first hook, in
    the middle of the run).

    :raises OLMoConfigurationError: naming every wrong item (its index and what it is) and the fix.
    """
    fix = (
        "Pass a list of instances of Callback subclasses (from olmo.train.callback import Callback; "
        'class MyCallback(Callback): ...; callbacks=[MyCallback()]; README, "Your own callbacks").'
    )
    if isinstance(callbacks, Callback):
        raise OLMoConfigurationError(
            f"callbacks is one {type(callbacks).__name__}, not a list of callbacks. {fix}"
        )
    if not isinstance(callbacks, (list, tuple)):
        raise OLMoConfigurationError(f"callbacks is {_shown(callbacks)}, not a list of callbacks. {fix}")
    problems = [
        f"callbacks[{i}] {problem}" for i, c in enumerate(callbacks) if (problem := _problem(c)) is not None
    ]
    if problems:
        raise OLMoConfigurationError(f"The training loop's callbacks are wrong: {'; '.join(problems)}. {fix}")
    return list(callbacks)


def ordered_callbacks(built_in: list[Callback], user: list[Callback]) -> list[Callback]:
    """The callbacks in the order the loop calls them: ``built_in`` (in the order given, priorities 100, 90, ...)
    and ``user`` by their :attr:`Callback.priority`, higher first, a user callback after a built-in of the same
    priority and in list order among its own."""
    ranked = [(100 - 10 * i, i, c) for i, c in enumerate(built_in)]
    ranked += [(c.priority, len(built_in) + j, c) for j, c in enumerate(user)]
    return [c for _, _, c in sorted(ranked, key=lambda r: (-r[0], r[1]))]


def _problem(callback: Any) -> Optional[str]:
    """What is wrong with one item of ``callbacks``, or None."""
    if isinstance(callback, type):
        if issubclass(callback, Callback):
            return f"is the class {callback.__name__}, not an instance of it: write {callback.__name__}(...)"
        return f"is the class {callback.__name__}, which is not a Callback subclass"
    if callback is None:
        return "is None"
    if not isinstance(callback, Callback):
        return f"is {_shown(callback)}, not a Callback"
    priority = callback.priority
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 10**6:
        return (
            f"({type(callback).__name__}) has priority {_shown(priority)}, not a whole number within +-1,000,000"
        )
    for hook, n_args in HOOK_ARGUMENTS.items():
        method = getattr(callback, hook)
        if not callable(method):
            return f"({type(callback).__name__}) has a {hook} that is not a method ({_shown(method)})"
        try:
            inspect.signature(method).bind(*([None] * n_args))
        except TypeError:
            return f"({type(callback).__name__}).{hook} cannot be called with the loop's {n_args} argument(s)"
        except ValueError:  # no signature to inspect (a builtin): called as it is
            pass
    return None


def _shown(value: Any) -> str:
    """``value`` as an error message shows it: a short repr (``reprlib``'s: bounded for any size) and its type."""
    return f"{reprlib.repr(value)} (a {type(value).__name__})"
