"""Your callbacks' own state in checkpoints: what each one's :meth:`~olmo.train.callback.Callback.state_dict`
returns is saved in the trainer state of every checkpoint (``train.pt``; each rank's ``train/rank{R}.pt`` when
sharded), under the callback's class name (``module.Class``, then ``#2``, ``#3`` for more of one class, in list
order), and handed back to its ``load_state_dict`` when a run resumes from that checkpoint or rewinds to it.

The state must be plain data, as the checkpoint is read back with ``torch.load(weights_only=True)``: None, booleans,
numbers, strings, tensors, and lists, tuples and dicts of them (string keys). Anything else is refused when the
checkpoint is about to be written, naming the callback, so no checkpoint is written that could not be read. A state
in the checkpoint with no callback of its name in this launch is reported once and ignored; a callback with no
state there (a fresh run, an older checkpoint) is not called.

Each rank saves its own callbacks' states: restored from a sharded checkpoint at the same world size each rank gets
its own back; otherwise every rank gets rank 0's (keep state that is the same on every rank, as hooks that read
logged metrics see the same values everywhere).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..exceptions import OLMoConfigurationError
from .callback import Callback

__all__ = ["callback_states", "load_callback_states", "CALLBACKS_KEY"]

log = logging.getLogger(__name__)

CALLBACKS_KEY = "callbacks"
"""The trainer state's entry holding the callbacks' states (absent when no callback has any)."""
MAX_DEPTH = 32
"""Nesting a state may have (deeper is refused, as a cycle would be)."""


def _names(callbacks: list[Callback]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for callback in callbacks:
        name = f"{type(callback).__module__}.{type(callback).__qualname__}"
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


def callback_states(callbacks: list[Callback]) -> dict[str, Any]:
    """``{CALLBACKS_KEY: {name: state}}`` for the callbacks whose ``state_dict`` returns one (empty when none does).

    :raises OLMoConfigurationError: a state that is not plain data, naming the callback and the offending part.
    """
    states = {}
    for name, callback in zip(_names(callbacks), callbacks):
        state = callback.state_dict()
        if state is None:
            continue
        problem = _not_plain(state, "state_dict()", 0)
        if problem is not None:
            raise OLMoConfigurationError(
                f"The callback {name} returned a state_dict() that a checkpoint cannot hold: {problem}. A callback's "
                f"state must be plain data (None, booleans, numbers, strings, tensors, and lists, tuples and dicts "
                f"of them with string keys), as checkpoints are read back with torch.load(weights_only=True); "
                f"convert the rest (e.g. a dataclass with dataclasses.asdict). No checkpoint was written."
            )
        states[name] = state
    return {CALLBACKS_KEY: states} if states else {}


def load_callback_states(callbacks: list[Callback], trainer_state: dict[str, Any]) -> None:
    """Hand each callback its state from ``trainer_state`` (a restored checkpoint's), by name."""
    saved = trainer_state.get(CALLBACKS_KEY) or {}
    names = _names(callbacks)
    for name, callback in zip(names, callbacks):
        if name in saved:
            callback.load_state_dict(saved[name])
    unmatched = sorted(set(saved) - set(names))
    if unmatched:
        log.warning(
            "The checkpoint holds the state of callbacks this run does not have, ignored: %s.",
            ", ".join(unmatched),
        )


def _not_plain(value: Any, where: str, depth: int) -> str | None:
    """Where ``value`` holds something other than plain data (or nests past :data:`MAX_DEPTH`), or None."""
    if depth > MAX_DEPTH:
        return f"{where} nests more than {MAX_DEPTH} levels deep"
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return None
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, dict):
        bad_key = next((k for k in value if not isinstance(k, str)), None)
        if bad_key is not None:
            return f"{where} has the key {bad_key!r} (a {type(bad_key).__name__}), not a string"
        items = value.items()  # type: ignore[assignment]
    else:
        return f"{where} is a {type(value).__name__}"
    for key, item in items:
        problem = _not_plain(item, f"{where}[{key!r}]", depth + 1)
        if problem is not None:
            return problem
    return None
