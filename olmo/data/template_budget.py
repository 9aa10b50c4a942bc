"""The budget of memory and time every chat template evaluation runs under (issue 50).

A chat template is a user's file, so its evaluation is bounded by limits it cannot get round, enforced by the sandbox
(:mod:`olmo.data.template_sandbox`) on every step the template takes, not by a list of forbidden expressions:

- **Size of the template**: at most :data:`MAX_TEMPLATE_CHARS` characters, checked before it is compiled; a template
  file is read only if it is a regular file, and at most :data:`MAX_TEMPLATE_FILE_BYTES` of it.
- **Size of every value**: no step (an operator, a call, a filter, a loop's item, a piece of output) may make or be
  given a string longer than :data:`MAX_STRING_CHARS` characters (what a value would print as, for lists and dicts), a
  list, tuple or dict of more than :data:`MAX_ITEMS` items, a number of more than :data:`MAX_INT_BITS` bits, or a
  value nested more than :data:`MAX_DEPTH` levels deep. The few steps whose result can outgrow their inputs
  (repetition ``*``, powers ``**``, ``%`` and ``format`` widths, ``join``, ``replace``, ``indent``, ``wordwrap``,
  ``tojson``/``pprint`` indents, ``expandtabs``, ``translate``, ``lipsum``) are checked before they run, by their
  result's size; every step's result is checked after it, and no number passed to a call or filter (a width, a
  count) may exceed :data:`MAX_ITEMS`.
- **Memory of a render**: the strings and items all steps of one rendering make, output included, add up to at most
  :data:`MAX_RENDER_CHARS`.
- **Time**: at most :data:`MAX_STEPS` steps (each operator, call, filter, attribute or item lookup, loop iteration
  and piece of output counts one; ``lipsum`` one per word) per rendering, the same on every machine; and, as a backstop, each rendering ends within :data:`MAX_SECONDS`
  seconds of wall clock, checked at every step. ``range`` is the sandbox's (at most 100,000
  numbers) and each number it yields in a loop is a step.

Going over any limit stops the evaluation with :class:`TemplateBudgetError`, naming the limit and how to fix it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_DEPTH",
    "MAX_INT_BITS",
    "MAX_ITEMS",
    "MAX_RENDER_CHARS",
    "MAX_SECONDS",
    "MAX_STEPS",
    "MAX_STRING_CHARS",
    "MAX_TEMPLATE_CHARS",
    "MAX_TEMPLATE_FILE_BYTES",
    "Meter",
    "TemplateBudget",
    "TemplateBudgetError",
    "text_size",
]

MAX_TEMPLATE_CHARS = 128 * 1024
"""The longest template source, in characters (real chat templates are a few KB; compiling this many takes a few
seconds)."""
MAX_TEMPLATE_FILE_BYTES = 16 * 1024 * 1024
"""The largest template file read: a ``.jinja`` file or a ``tokenizer_config.json`` (which also lists the tokens)."""
MAX_STRING_CHARS = 4 * 1024 * 1024
"""The longest string any one step may make or be given, the rendered conversation included."""
MAX_ITEMS = 100_000
"""The most items of a list, tuple or dict one step may make, and the largest number passed to a call or filter (a
width, a count): Jinja's sandbox bounds ``range`` to as many."""
MAX_INT_BITS = 4096
"""The largest number a step may make, in bits."""
MAX_DEPTH = 100
"""The deepest nesting of lists and dicts a step may be given."""
MAX_RENDER_CHARS = 32 * 1024 * 1024
"""All the characters and items the steps of one rendering make, added up: what bounds its memory."""
MAX_STEPS = 1_000_000
"""The most steps of one rendering: a chat template takes a few per message."""
MAX_SECONDS = 60.0
"""The wall-clock time one rendering may take: a backstop behind :data:`MAX_STEPS`, which bounds the time the same
on every machine (a rendering within its steps takes a few seconds at most, however busy the machine)."""

_WHERE = "olmo.data.template_budget"


@dataclass(frozen=True)
class TemplateBudget:
    """The limits a template's evaluation runs under; the module's constants by default (tests lower them)."""

    max_template_chars: int = MAX_TEMPLATE_CHARS
    max_template_file_bytes: int = MAX_TEMPLATE_FILE_BYTES
    max_string_chars: int = MAX_STRING_CHARS
    max_items: int = MAX_ITEMS
    max_int_bits: int = MAX_INT_BITS
    max_depth: int = MAX_DEPTH
    max_render_chars: int = MAX_RENDER_CHARS
    max_steps: int = MAX_STEPS
    max_seconds: float = MAX_SECONDS


class TemplateBudgetError(ValueError):
    """A template's evaluation went over one of its limits; the message names the limit and the fix."""


_FIX = (
    "A chat template needs far less: fix the template (a loop or a repetition without end), or, if the conversation "
    "itself is this long, shorten or drop it"
)


def _over(what: str, limit: int | float, constant: str, fix: str = _FIX) -> TemplateBudgetError:
    return TemplateBudgetError(f"{what} (the limit is {limit:,}: {_WHERE}.{constant}). {fix}.")


def text_size(value: Any, limit: int, max_depth: int = MAX_DEPTH) -> tuple[int, int, int, bool]:
    """(characters, items, depth, fixed) of ``value`` as text, about what ``str(value)`` or its JSON would hold,
    without making it: strings count their length, numbers their digits, lists and dicts their items' sizes and
    punctuation. The walk stops once the characters pass ``limit`` (the sizes returned are then only known to exceed
    it). ``fixed``: no namespace was met, so a template cannot change the sizes (its sandbox changes no list or dict).

    :raises TemplateBudgetError: for a value nested deeper than ``max_depth``.
    """
    chars = items = depth = 0
    fixed = True
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and chars <= limit:
        item, level = stack.pop()
        if isinstance(item, (str, bytes)):
            chars += len(item) + 2
            continue
        if isinstance(item, int):
            chars += item.bit_length() * 3 // 10 + 2
            continue
        if isinstance(item, float):
            chars += 24
            continue
        children = _children(item)
        if children is None:
            chars += 8
            continue
        fixed = fixed and isinstance(item, (dict, list, tuple, set, frozenset))
        if not children:
            chars += 2
            continue
        if level >= max_depth:
            raise _over(f"a value nested more than {max_depth} levels deep", max_depth, "MAX_DEPTH")
        depth = max(depth, level + 1)
        items += len(children)
        chars += 2 + 2 * len(children)
        level += 1
        stack.extend([(child, level) for child in children])
    return chars, items, depth, fixed


def _children(value: Any) -> list | None:
    """What a container holds (a dict's keys and values, a namespace's attributes), or None for anything else."""
    if isinstance(value, dict):
        return [part for pair in value.items() for part in pair]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    attributes = getattr(value, "_Namespace__attrs", None)  # jinja's namespace() keeps them there
    if isinstance(attributes, dict):
        return [part for pair in attributes.items() for part in pair]
    return None


class Meter:
    """What one rendering has used of its :class:`TemplateBudget`; ``deadline`` is a ``time.monotonic()`` shared by
    the renderings of one conversation."""

    def __init__(self, budget: TemplateBudget, deadline: float):
        self.budget, self.deadline = budget, deadline
        self.steps = 0
        self.made = 0
        self._sizes: dict[int, tuple[Any, tuple[int, int, int]]] = {}
        """Sizes of the containers measured, by id, with the container (kept alive so its id stays its own)."""

    def step(self, count: int = 1) -> None:
        """Count ``count`` steps; stop past :data:`MAX_STEPS` or the deadline."""
        self.steps += count
        if self.steps > self.budget.max_steps:
            raise _over(
                f"it took more than {self.budget.max_steps:,} steps (operators, calls, filters, lookups, loop "
                f"iterations)",
                self.budget.max_steps,
                "MAX_STEPS",
                "A chat template takes a few steps per message: fix the template's loops (nested loops over ranges, "
                "loops without end), or, if the conversation itself is this long, shorten or drop it",
            )
        if time.monotonic() > self.deadline:
            raise _over(
                f"the conversation's renderings took more than {self.budget.max_seconds:g} s",
                self.budget.max_seconds,
                "MAX_SECONDS",
            )

    def expect(self, chars: int, what: str) -> None:
        """Refuse a step whose result would be ``chars`` characters, before it runs."""
        if chars > self.budget.max_string_chars:
            raise _over(
                f"{what} would make a string of {chars:,} characters, more than a chat template needs",
                self.budget.max_string_chars,
                "MAX_STRING_CHARS",
            )

    def given(self, values: Iterable[Any], what: str, numbers: bool = True) -> None:
        """Check what a step is given: each value's text at most :data:`MAX_STRING_CHARS`, each number (with
        ``numbers``) at most :data:`MAX_ITEMS`."""
        for value in values:
            if numbers and isinstance(value, int) and abs(value) > self.budget.max_items:
                raise _over(
                    f"{what} was given the number {value:,}, more than a chat template needs",
                    self.budget.max_items,
                    "MAX_ITEMS",
                )
            chars = self.size(value)
            if chars > self.budget.max_string_chars:
                raise _over(
                    f"{what} was given a value of more than {self.budget.max_string_chars:,} characters as text",
                    self.budget.max_string_chars,
                    "MAX_STRING_CHARS",
                )

    def size(self, value: Any) -> int:
        """The characters of ``value`` as text (:func:`text_size`), up to just past the string limit."""
        if isinstance(value, str):
            return len(value)
        return self.shape(value)[0]

    def shape(self, value: Any) -> tuple[int, int, int]:
        """(characters, items, depth) of ``value`` as text (:func:`text_size`), each container measured once."""
        known = self._sizes.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        chars, items, depth, fixed = text_size(value, self.budget.max_string_chars, self.budget.max_depth)
        if fixed and isinstance(value, (dict, list, tuple, set, frozenset)):
            self._sizes[id(value)] = (value, (chars, items, depth))
        return chars, items, depth

    def result(self, value: Any, inputs: tuple = ()) -> Any:
        """Check what a step made, count it against the render's memory, and return it."""
        if isinstance(value, bool) or any(value is given for given in inputs):
            return value
        made = 0
        if isinstance(value, (str, bytes)):
            made = len(value)
            self.expect(made, "a step")
        elif isinstance(value, int):
            self.bits(value.bit_length())
        elif isinstance(value, (list, tuple, dict, set, frozenset)):
            made = len(value)
            self.items(made)
        self.count(made)
        return value

    def bits(self, bits: int) -> None:
        """Refuse a number of ``bits`` bits over :data:`MAX_INT_BITS`."""
        if bits > self.budget.max_int_bits:
            raise _over(
                f"a number of {bits:,} bits is larger than a chat template needs",
                self.budget.max_int_bits,
                "MAX_INT_BITS",
            )

    def items(self, items: int) -> None:
        """Refuse a list or dict of ``items`` items over :data:`MAX_ITEMS`."""
        if items > self.budget.max_items:
            raise _over(
                f"a list or dict of {items:,} items is more than a chat template needs",
                self.budget.max_items,
                "MAX_ITEMS",
            )

    def count(self, made: int) -> None:
        """Count ``made`` characters or items against :data:`MAX_RENDER_CHARS`."""
        self.made += made
        if self.made > self.budget.max_render_chars:
            raise _over(
                f"its steps made more than {self.budget.max_render_chars:,} characters and items in all",
                self.budget.max_render_chars,
                "MAX_RENDER_CHARS",
            )

    def iterate(self, iterable: Any) -> Iterator[Any]:
        """``iterable``'s items, one step each."""
        for item in iterable:
            self.step()
            yield item
