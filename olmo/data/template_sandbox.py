"""The sandbox chat templates run in: Jinja's immutable sandbox, with every step metered against the template's
budget (:mod:`olmo.data.template_budget`).

The steps are met where Jinja lets an environment in: every operator (``call_binop``, ``call_unop``), call (``call``),
attribute and item lookup (``getattr``, ``getitem``) and filter (each filter is wrapped); and where it does not, the
compiled template is changed before compiling so that each loop's items, each piece of output and each ``~``
concatenation pass through a filter that meters them. The wrapping filters take the context, so Jinja never runs
them (nor anything built on them) at compile time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from jinja2 import nodes, pass_context
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

from .template_budget import Meter, TemplateBudget

__all__ = ["BudgetedSandbox"]

_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\d*|\*)(?:\.(\d*|\*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_NUMBER = re.compile(r"\d+")


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _format_size(meter: Meter, fmt: Any, values: list) -> int:
    """At most how long formatting ``values`` into ``fmt`` (``%`` or ``str.format``) comes out: each field is at
    most its width or precision (written in ``fmt`` or passed as a number) or the longest value, whichever is more."""
    if not isinstance(fmt, str):
        return meter.size(fmt) + meter.size(values)
    specs = [n for m in _PERCENT_FIELD.finditer(fmt) for n in m.groups() if n and n != "*"]
    specs += [n for spec in _BRACE_SPEC.findall(fmt) for n in _NUMBER.findall(spec)]
    fields = fmt.count("%") + fmt.count("{")
    numbers = [abs(v) for v in _flat(values) if isinstance(v, int) and not isinstance(v, bool)]
    widest = max([int(n) for n in specs] + numbers + [0])
    return len(fmt) + fields * (widest + max([meter.size(v) for v in values] + [0]))


def _flat(values: Any) -> list:
    if isinstance(values, (list, tuple)):
        return [v for value in values for v in _flat(value)]
    if isinstance(values, dict):
        return list(values.values())
    return [values]


def _width(width: Any) -> int:
    """A width or count argument as characters: a string's length, a number itself."""
    if isinstance(width, str):
        return len(width)
    return max(0, width) if isinstance(width, int) else 0


def _lines(value: Any) -> int:
    return value.count("\n") + 1 if isinstance(value, str) else 1


def _json_size(meter: Meter, value: Any, indent: Any) -> int:
    """At most how long ``value`` as (indented) JSON or ``pprint`` comes out: escapes at most 6 characters each, and
    two lines per item, each indented by the nesting's depth."""
    chars, items, depth = meter.shape(value)
    step = len(indent) if isinstance(indent, str) else (indent or 0)
    return 6 * chars + 2 * (items + 1) * (step * (depth + 1) + 2)


def _replace_size(meter: Meter, s: Any, old: Any, new: Any) -> int:
    if not isinstance(s, str) or not isinstance(old, str):
        return meter.size(s) * (1 + meter.size(new))
    count = len(s) + 1 if not old else s.count(old)
    return len(s) + count * max(0, meter.size(new) - len(old))


_Growth = Callable[[Meter, Any, tuple, dict], int]
_GROWTH: dict[str, _Growth] = {
    # What a step whose result can outgrow its inputs would make (the value, its arguments): a filter's or a str
    # method's name. Every other step makes at most a few times what it is given, which is checked, and its result
    # is checked after it.
    "format": lambda m, s, a, k: _format_size(m, s, [*a, *k.values()]),
    "format_map": lambda m, s, a, k: _format_size(m, s, list(a)),
    "join": lambda m, s, a, k: _join_size(m, s, a, k),
    "replace": lambda m, s, a, k: _replace_size(m, s, _arg(a, k, 0, "old", ""), _arg(a, k, 1, "new", "")),
    "indent": lambda m, s, a, k: m.size(s) + _lines(s) * _width(_arg(a, k, 0, "width", 4)),
    "wordwrap": lambda m, s, a, k: m.size(s) * (1 + _width(_arg(a, k, 2, "wrapstring", None) or "\n")),
    "tojson": lambda m, s, a, k: _json_size(m, s, _arg(a, k, 1, "indent", None)),
    "pprint": lambda m, s, a, k: _json_size(m, s, 1),
    "expandtabs": lambda m, s, a, k: m.size(s) * (1 + _width(_arg(a, k, 0, "tabsize", 8))),
    "translate": lambda m, s, a, k: m.size(s) * (1 + m.size(a[0] if a else None)),
}


def _join_size(meter: Meter, sep: Any, args: tuple, kwargs: dict) -> int:
    """A filter's ``value|join(sep)`` or a method's ``sep.join(items)``: ``sep`` between every two items."""
    if isinstance(sep, str) and args:  # str.join(items)
        items, sep = args[0], sep
    else:
        items, sep = sep, _arg(args, kwargs, 0, "d", "")
    count = len(items) if isinstance(items, (list, tuple, dict, str)) else 0
    return meter.size(items) + count * meter.size(sep)


def _listed(value: Any) -> Any:
    """A generator made into a list, so that its size can be checked before a step that joins it."""
    return value if isinstance(value, (str, list, tuple, dict)) or not hasattr(value, "__iter__") else list(value)


class BudgetedSandbox(ImmutableSandboxedEnvironment):  # type: ignore[misc]
    """Jinja's immutable sandbox, every step metered against ``meter`` (set for each rendering)."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
    intercepted_unops = frozenset({"+", "-"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = Meter(TemplateBudget(), time.monotonic())
        self.label_markers: Any = None
        """What ``{% generation %}`` blocks' output is wrapped in while a rendering looks for labels, or None."""
        self.filters = {name: self.metered_filter(name, f) for name, f in self.filters.items()}
        self.filters.update(_olmo_iterate=_iterate, _olmo_emit=_emit, _olmo_concat=_concat)
        self.globals["lipsum"] = self._lipsum

    def _lipsum(self, n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        self.meter.step(n * max)  # a word is a step
        self.meter.expect(n * max * 16, "lipsum")
        return generate_lorem_ipsum(n, html, min, max)

    def parse_metered(self, source: str) -> nodes.Template:
        """``source`` parsed, each loop's items, piece of output and concatenation metered."""
        tree = _Metering().visit(self.parse(source))
        tree.set_environment(self)
        return tree

    def metered_filter(self, name: str, func: Callable) -> Callable:
        """``func``, the filter called ``name``, metered: its arguments and result checked, its growth refused."""
        pass_arg = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
        growth = _GROWTH.get(name)

        @pass_context
        def metered(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            meter = context.environment.meter
            meter.step()
            if name == "join":
                value = _listed(value)
            meter.given([value, *args, *kwargs.values()], f"the filter '{name}'")
            if growth is not None:
                meter.expect(growth(meter, value, args, kwargs), f"the filter '{name}'")
            first = {"context": context, "eval_context": context.eval_ctx, "environment": context.environment}
            lead = (first[pass_arg],) if pass_arg in first else ()
            return meter.result(func(*lead, value, *args, **kwargs), (value, *args))

        return metered

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        meter = self.meter
        meter.step()
        _check_binop(meter, operator, left, right)
        return meter.result(super().call_binop(context, operator, left, right), (left, right))

    def call_unop(self, context: Any, operator: str, arg: Any) -> Any:
        self.meter.step()
        return self.meter.result(super().call_unop(context, operator, arg), (arg,))

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.meter.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.meter.step()
        value = super().getitem(obj, argument)
        return self.meter.result(value, (obj,)) if isinstance(argument, slice) else value

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        meter = self.meter
        meter.step()
        if isinstance(obj, LoopContext) and args:  # a recursive loop's next level: its items are steps too
            args = (meter.iterate(args[0]), *args[1:])
        elif obj is not safe_range and not isinstance(obj, (Macro, type)):
            owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
            method = getattr(obj, "__name__", "")
            if isinstance(owner, (str, bytes)) and method == "join" and args:
                args = (_listed(args[0]), *args[1:])
            meter.given([*args, *kwargs.values()], f"the call of {method or 'a function'}")
            if isinstance(owner, (str, bytes)) and method in _GROWTH:
                meter.expect(_GROWTH[method](meter, owner, args, kwargs), f"the call of {method}")
        return meter.result(super().call(context, obj, *args, **kwargs), args)


def _check_binop(meter: Meter, operator: str, left: Any, right: Any) -> None:
    """Refuse an operator whose result would be over the budget, before it runs."""
    sequences = (str, bytes, list, tuple)
    if operator == "*" and isinstance(left, int) and isinstance(right, sequences):
        left, right = right, left
    if operator == "*" and isinstance(left, sequences) and isinstance(right, int):
        meter.expect(meter.size(left) * right, f"repeating {type(left).__name__} {right:,} times")
        if not isinstance(left, (str, bytes)):
            meter.items(len(left) * right)
    elif operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
        bits = left.bit_length() + right.bit_length() if operator == "*" else left.bit_length() * max(right, 0)
        if abs(left) > 1:
            meter.bits(bits)
    elif operator == "%" and isinstance(left, str):
        meter.given(_flat(right), "the operator %", numbers=False)
        meter.expect(_format_size(meter, left, _flat(right)), "the operator %")
    elif operator == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        meter.expect(meter.size(left) + meter.size(right), "the operator +")


@pass_context
def _iterate(context: Any, iterable: Any) -> Any:
    return context.environment.meter.iterate(iterable)


@pass_context
def _emit(context: Any, value: Any) -> Any:
    """A piece of output: a step, its text counted against the render's memory."""
    meter = context.environment.meter
    meter.step()
    chars = meter.size(value)
    meter.expect(chars, "a piece of output")
    meter.count(chars)
    return value


@pass_context
def _concat(context: Any, parts: list) -> str:
    """The ``~`` operator: its operands' texts joined."""
    meter = context.environment.meter
    meter.step()
    meter.expect(sum(meter.size(part) for part in parts), "the operator ~")
    return meter.result("".join(map(str, parts)))


class _Metering(NodeTransformer):
    """Puts a template's loops' items, output pieces and ``~`` concatenations through the metering filters."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _filter(node.iter, "_olmo_iterate")  # type: ignore[arg-type]
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [_filter(child, "_olmo_emit") for child in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _filter(nodes.List(node.nodes, lineno=node.lineno), "_olmo_concat")


def _filter(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)
