"""Verifiable rewards (issue 53): each scores one sampled completion against its prompt's ground truth.

The built-in rewards are named by a config (``rl.rewards: [{name, weight, ...}]``):

* ``exact_answer``: 1.0 when the completion's answer equals the ground truth, else 0.0. The answer is the content
  of the completion's last ``\\boxed{...}``, or else its last number; both sides are normalised
  (:func:`normalise_answer`): numbers compare by value (``1,000``, ``1000.0`` and ``\\boxed{1000}`` are one
  answer; ``0.5`` equals ``1/2``), text case- and space-insensitively without ``$``, ``\\text{}`` or a final period.
* ``format``: 1.0 when the whole completion matches a regular expression given in the config, else 0.0.
* ``length``: DAPO's soft over-length penalty: 0 up to ``max_tokens - buffer`` completion tokens, falling linearly
  to -1 at ``max_tokens``, and -1 past it.

A user's own reward is registered from Python by name (:func:`register_reward`) before the run starts; a config
only names it (it never names code to import).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Optional

from ..config.rl_sections import BUILTIN_REWARDS
from ..exceptions import OLMoConfigurationError

__all__ = [
    "BUILTIN_REWARDS",
    "Completion",
    "RewardFn",
    "exact_answer",
    "extract_answer",
    "format_reward",
    "length_reward",
    "normalise_answer",
    "register_reward",
    "registered_reward",
    "registered_rewards",
]


@dataclass(frozen=True)
class Completion:
    """One sampled completion, as a reward sees it."""

    prompt: str
    """The prompt's text (decoded, chat template included)."""
    text: str
    """The completion's text (decoded, up to and without the end-of-sequence token)."""
    ground_truth: str
    """The prompt's ``ground_truth`` from ``scripts/prepare_rl_prompts.py``'s input."""
    num_tokens: int
    """The completion's length in tokens (its end-of-sequence token included when it has one)."""
    truncated: bool
    """It reached ``rl.max_new_tokens`` without ending."""


RewardFn = Callable[[Completion], float]
"""A reward: a completion's score (a finite float; larger is better)."""


_REGISTERED: dict[str, RewardFn] = {}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def register_reward(name: str, reward: RewardFn) -> None:
    """Make ``reward`` available to ``rl.rewards`` as ``{name: NAME, weight: ...}`` (its value is logged as
    ``train/rl/rewards/NAME``). Call it before the run is built (e.g. in your script, before
    ``olmo.cli.train.main``). A name is letters, digits, ``_``, ``.`` and ``-``; the built-in names and a name
    registered already are refused."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise OLMoConfigurationError(
            f"register_reward: the name {name!r} is not a reward name: use 1-64 letters, digits, '_', '.' or '-', "
            f"starting with a letter or '_' (it becomes the metric train/rl/rewards/NAME)."
        )
    if name in BUILTIN_REWARDS or name in _REGISTERED:
        kind = "a built-in reward" if name in BUILTIN_REWARDS else "registered already"
        raise OLMoConfigurationError(
            f"register_reward: {name!r} is {kind}; give your reward another name (the rl.rewards entries name "
            f"it), or unregister the old one first with registered_rewards().pop({name!r})."
        )
    if not callable(reward):
        raise OLMoConfigurationError(
            f"register_reward({name!r}, ...): the reward must be callable as reward(completion) -> float, got "
            f"{type(reward).__name__}."
        )
    _REGISTERED[name] = reward


def registered_rewards() -> dict[str, RewardFn]:
    """The rewards registered so far, by name (the registry itself: popping a name unregisters it)."""
    return _REGISTERED


def registered_reward(name: str) -> Optional[RewardFn]:
    """The reward registered as ``name``, or None."""
    return _REGISTERED.get(name)


# --- exact_answer ---------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+/\d+|\d+(?:\.\d+)?|\.\d+)(?![\w])"
)  # 1,234.5 | 3/4 | 12 | 0.25 | .5 (thousands commas only in groups of three; not inside words such as x2)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_SPACES = re.compile(r"\s+")


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(text: str) -> Optional[str]:
    """A completion's answer: the content of its last ``\\boxed{}``, or else its last number; None without
    either."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Optional[Fraction]:
    plain = text.replace(",", "") if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text) else text
    try:
        if "/" in plain:
            num, den = plain.split("/")
            return Fraction(int(num), int(den)) if int(den) != 0 else None
        value = Decimal(plain)
    except (ValueError, InvalidOperation):
        return None
    return Fraction(value) if value.is_finite() else None


def normalise_answer(answer: str) -> str:
    """The form two answers are compared in: a number's value (``"1,000.0"`` -> ``"1000"``, ``"0.5"`` ->
    ``"1/2"``), else the text without ``$``, ``\\text{}`` wrappers, case, inner spacing and a final period."""
    text = answer.strip().strip("$").strip()
    text = _TEXT_WRAPPER.sub(r"\1", text).strip()
    text = text.rstrip(".").strip()
    number = _as_number(text)
    if number is not None:
        return str(number)
    return _SPACES.sub(" ", text).lower()


def exact_answer(completion: Completion) -> float:
    """1.0 when the completion's answer (:func:`extract_answer`) equals the ground truth (its own ``\\boxed{}``
    content if it has one), both normalised; else 0.0."""
    answer = extract_answer(completion.text)
    if answer is None:
        return 0.0
    truth = _last_boxed(completion.ground_truth)
    truth = completion.ground_truth if truth is None else truth
    return 1.0 if normalise_answer(answer) == normalise_answer(truth) else 0.0


# --- format and length ----------------------------------------------------------------------------------------


def format_reward(pattern: str, key: str = "rl.rewards[format].pattern") -> RewardFn:
    """A reward of 1.0 for a completion that matches ``pattern`` as a whole (``re.fullmatch``; ``.`` matches new
    lines too), else 0.0. A pattern that does not compile is refused naming ``key``."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except (re.error, TypeError) as e:
        raise OLMoConfigurationError(
            f"{key}={pattern!r} is not a regular expression Python can compile ({e}). Fix the pattern (in YAML, "
            f"quote it with single quotes so that backslashes stay as written)."
        ) from None

    def reward(completion: Completion) -> float:
        return 1.0 if compiled.fullmatch(completion.text.strip()) else 0.0

    return reward


def length_reward(max_tokens: int, buffer: int, key: str = "rl.rewards[length]") -> RewardFn:
    """DAPO's soft over-length penalty: 0 for completions of at most ``max_tokens - buffer`` tokens, falling
    linearly to -1 at ``max_tokens`` and -1 past it (``buffer`` 0: a step from 0 to -1 past ``max_tokens``)."""
    if not (isinstance(max_tokens, int) and isinstance(buffer, int) and 0 <= buffer < max_tokens):
        raise OLMoConfigurationError(
            f"{key}: max_tokens={max_tokens!r} and buffer={buffer!r} need 0 <= buffer < max_tokens (integers, in "
            f"completion tokens); e.g. max_tokens: 512, buffer: 128 penalises past 384 tokens, fully at 512."
        )
    free = max_tokens - buffer

    def reward(completion: Completion) -> float:
        n = completion.num_tokens
        if n <= free:
            return 0.0
        if n > max_tokens or buffer == 0:
            return -1.0
        return (free - n) / buffer

    return reward
