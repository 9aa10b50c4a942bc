"""Config field documentation read back from the source, and the listing ``train.py CONFIG --help`` prints.

A field is documented by the string literal on the lines right under its annotated assignment, as in
OLMo-core (``d_model: int = 768`` followed by a docstring line ``Hidden size.``). Python keeps no such
string at runtime, so :func:`field_docs` parses the class's source with :mod:`ast`. Nothing here names a
config class: any dataclass works, so new fields and sections are covered as soon as they are written.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from enum import Enum
from typing import Any, Optional, Union

from ..util.secrets import redact_text

__all__ = ["field_docs", "summary", "format_value", "describe_config", "undocumented_fields", "nested_dataclass"]


_FIELD_DOCS: dict[type, dict[str, str]] = {}


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> cleaned docstring for the dataclass ``cls``, fields of dataclass bases included
    (parsed once per class). Fields without a docstring are absent, as is every field of a class whose
    source cannot be read."""
    if cls not in _FIELD_DOCS:
        docs: dict[str, str] = {}
        for klass in reversed(cls.__mro__):  # a subclass's docstring replaces its base's
            if dataclasses.is_dataclass(klass):
                docs.update(_own_field_docs(klass))
        _FIELD_DOCS[cls] = docs
    return _FIELD_DOCS[cls]


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # made at runtime (make_dataclass) or shipped without source
        return {}
    class_def = ast.parse(source).body[0]
    assert isinstance(class_def, ast.ClassDef), f"inspect.getsource({cls.__name__}) is not a class"
    docs = {}
    for statement, following in zip(class_def.body, class_def.body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def summary(doc: str) -> str:
    """The first line of ``doc``, with '...' after it when the text goes on."""
    lines = doc.strip().splitlines()
    if not lines:
        return ""
    return lines[0].strip() + (" ..." if len(lines) > 1 else "")


def format_value(value: Any, width: int = 60) -> str:
    """``value`` spelled as in YAML or an override (``null``, ``true``, enum values), with lists and
    mappings cut to about ``width`` characters and their length given."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, str):
        return value or "''"
    if isinstance(value, (list, tuple)):
        return _shorten([format_value(v, width) for v in value], "[]", width)
    if isinstance(value, dict):
        return _shorten([f"{k}: {format_value(v, width)}" for k, v in value.items()], "{}", width)
    return str(value)


def _shorten(items: list[str], brackets: str, width: int) -> str:
    shown: list[str] = []
    for item in items:
        if shown and len(", ".join([*shown, item])) > width:
            return f"{brackets[0]}{', '.join(shown)}, ... ({len(items)} in all){brackets[1]}"
        shown.append(item)
    return f"{brackets[0]}{', '.join(shown)}{brackets[1]}"


@dataclasses.dataclass
class _Section:
    title: str
    rows: list[tuple[str, str, str]]  # (dotted key, value, doc summary)


def describe_config(config: Any, max_value_width: int = 24) -> str:
    """Every field of the dataclass instance ``config``, one line each: its dotted key, its current value
    and the first line of its docstring, grouped by section (``model``, ``data``, ``evaluators[0]``, ...).

    A null section (``compile: null``) or an empty list of sections is followed by the defaults its
    fields take once one of them is set, the first time a section of that class is null.

    :param max_value_width: values up to this long are padded into a column; longer ones push the doc out.
    """
    lines: list[str] = []
    for section in _sections(config, "", "Top level", set()):
        key_width = max(len(key) for key, _, _ in section.rows)
        value_width = min(max(len(value) for _, value, _ in section.rows), max_value_width)
        lines += ["", section.title]
        lines += [
            f"  {key:<{key_width}}  {value:<{value_width}}  {doc}".rstrip() for key, value, doc in section.rows
        ]
    return "\n".join(lines[1:])


def _sections(obj: Any, prefix: str, title: str, expanded: set[type]) -> list[_Section]:
    """The section of dataclass instance ``obj`` (keys start with ``prefix``), then its subsections in
    field order. ``expanded`` holds the classes whose defaults have been listed already."""
    own = _Section(title, [])
    subsections: list[_Section] = []
    hints = typing.get_type_hints(type(obj))
    docs = field_docs(type(obj))
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        doc = summary(docs.get(f.name, ""))
        about = f": {doc}" if doc else ""
        nested, is_list = nested_dataclass(hints[f.name])
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            subsections += _sections(value, f"{key}.", f"{key}{about}", expanded)
        elif is_list and nested is not None and value:
            for i, item in enumerate(value):
                subsections += _sections(item, f"{key}[{i}].", f"{key}[{i}]{about}", expanded)
        else:
            own.rows.append((key, redact_text(format_value(value)), doc))
            if nested is not None and nested not in expanded:  # None, or an empty list of sections
                expanded.add(nested)
                key = f"{key}[]" if is_list else key
                what = "each entry has" if is_list else f"setting any {key}.* key enables it with"
                note = f"{key} ({format_value(value)}: {what} these defaults)"
                subsections += _sections(nested(), f"{key}.", note, expanded)
    return ([own] if own.rows else []) + subsections


def nested_dataclass(hint: Any) -> tuple[Optional[type], bool]:
    """The dataclass a field of type ``hint`` holds (through ``Optional`` and ``list``), and whether it is
    a list of them; ``(None, False)`` for a plain field."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Union and len(args) == 1:
        hint = args[0]
    is_list = typing.get_origin(hint) is list
    if is_list:
        hint = typing.get_args(hint)[0]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, is_list
    return None, False


def undocumented_fields(cls: type) -> list[str]:
    """Dotted keys of the fields without a docstring in the dataclass ``cls`` and every section under it
    (each class's fields reported once, under the first key that reaches them)."""
    missing: list[str] = []
    seen: set[type] = set()

    def visit(klass: type, prefix: str) -> None:
        if klass in seen:
            return
        seen.add(klass)
        hints = typing.get_type_hints(klass)
        docs = field_docs(klass)
        for f in dataclasses.fields(klass):
            if f.name not in docs:
                missing.append(f"{prefix}{f.name}")
            nested, is_list = nested_dataclass(hints[f.name])
            if nested is not None:
                visit(nested, f"{prefix}{f.name}{'[]' if is_list else ''}.")

    visit(cls, "")
    return missing
