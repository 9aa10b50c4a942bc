"""Loading a config so that one report lists every problem: the unknown keys (misspelled, with a did-you-mean) and
the bad values that the value checks find, instead of the first misspelled key hiding every value error.

OmegaConf refuses a structured config with an unknown key, so nothing can be checked until every key is known.
:func:`load_reporting_all` therefore finds the unknown keys itself (in the YAML file and in the overrides), loads
the config once more without them, and reports both kinds of problem together.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

from omegaconf import OmegaConf as om
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ..exceptions import OLMoCliError, OLMoConfigurationError
from .cli import config_error, load_structured, load_yaml, parse_override
from .docs import nested_dataclass

__all__ = ["load_reporting_all"]

T = TypeVar("T")
Part = Union[str, int]


@dataclasses.dataclass(frozen=True)
class _UnknownKey:
    parts: tuple[Part, ...]
    """Where the key is, from the top of the config (``("evaluators", 0, "typ")``)."""
    refusal: ConfigKeyError
    """OmegaConf's own error for the key (its message has the did-you-mean)."""
    source: str
    """``in FILE`` or ``from the command-line override '--KEY=VALUE'``."""
    override: Optional[int] = None
    """The position of the override that sets the key; None for a key of the file."""

    @property
    def key(self) -> str:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.parts).lstrip(".")

    def error(self) -> OLMoConfigurationError:
        self.refusal.full_key = self.key  # OmegaConf names the key within its section only
        return config_error(self.refusal, self.source)


def load_reporting_all(
    schema: type[T],
    path: Union[str, Path],
    overrides: Optional[list[str]],
    prepare: Callable[[Any], Any],
    value_problems: Callable[[T], list[str]],
) -> T:
    """:func:`olmo.config.cli.load_structured`, except that when the file or the overrides have unknown keys (and
    no other problem that stops loading, such as a wrong type), the config is loaded without them and the
    ``value_problems`` of that config are reported with them, in one error.

    :param prepare: applied to the raw YAML before it is merged (e.g. accepting legacy spellings).
    :param value_problems: one line for each bad value of a loaded config.
    :raises OLMoConfigurationError: listing every problem found.
    """
    try:
        return load_structured(schema, path, overrides, prepare=prepare)
    except OLMoConfigurationError as e:
        first = e
    path, overrides = Path(path), overrides or []
    in_file = list(
        _unknown_keys(schema, om.to_container(prepare(load_yaml(path)), resolve=False), (), f"in {path}")
    )
    unknown = in_file + list(_unknown_in_overrides(schema, overrides))
    if not unknown:
        raise first
    dropped = {u.override for u in unknown}
    kept = [arg for i, arg in enumerate(overrides) if i not in dropped]
    try:
        cfg = load_structured(schema, path, kept, prepare=lambda raw: _without(prepare(raw), in_file))
    except (OLMoConfigurationError, OLMoCliError):
        raise first from None  # other problems stop loading too; the first report lists all of them
    problems = [str(u.error()) for u in unknown] + value_problems(cfg)
    if len(problems) == 1:
        raise OLMoConfigurationError(problems[0])
    listing = "\n".join(f"  - {p}" for p in problems)
    raise OLMoConfigurationError(
        f"{path}{' and its command-line overrides' if overrides else ''} {'have' if overrides else 'has'} "
        f"{len(problems)} problems; fix them all:\n{listing}"
    )


def _unknown_keys(section: type, node: Any, parts: tuple[Part, ...], source: str) -> Iterator[_UnknownKey]:
    """The unknown keys in ``node`` (plain YAML content at ``parts``), read as the dataclass ``section``."""
    if not isinstance(node, dict):
        return
    hints = typing.get_type_hints(section)
    for key, value in node.items():
        if key not in hints:
            refusal = _refusal(section, key)
            if refusal is not None:
                yield _UnknownKey((*parts, key), refusal, source)
            continue
        inner, is_list = nested_dataclass(hints[key])
        if inner is None:
            continue  # a plain value, or a mapping of any keys (a stage's data)
        if not is_list:
            yield from _unknown_keys(inner, value, (*parts, key), source)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                yield from _unknown_keys(inner, item, (*parts, key, i), source)


_LIST_INDEX = re.compile(r"\[(\d+)\]|\.(\d+)(?=\.|\[|$)")


def _unknown_in_overrides(schema: type, overrides: list[str]) -> Iterator[_UnknownKey]:
    """The unknown key each override sets, if any (a key into a value that is not a section is left to OmegaConf)."""
    for position, arg in enumerate(overrides):
        try:
            entry = parse_override(arg, schema)
        except OLMoCliError:
            continue  # reported as it is by the first load
        dotted = _LIST_INDEX.sub(lambda m: f".#{m.group(1) or m.group(2)}", entry.split("=", 1)[0])
        parts = [int(p[1:]) if p.startswith("#") else p for p in dotted.split(".")]
        section: Optional[type] = schema
        is_list = False
        for depth, part in enumerate(parts):
            if is_list:  # a list of sections: this part must be an index into it
                if not isinstance(part, int):
                    break
                is_list = False
                continue
            if section is None or isinstance(part, int):
                break  # a key into a plain value or a mapping: OmegaConf judges it
            hints = typing.get_type_hints(section)
            if part not in hints:
                refusal = _refusal(section, part)
                if refusal is not None:
                    source = f"from the command-line override '--{entry}'"
                    yield _UnknownKey(tuple(parts[: depth + 1]), refusal, source, position)
                break
            section, is_list = nested_dataclass(hints[part])


def _refusal(section: type, key: Any) -> Optional[ConfigKeyError]:
    """OmegaConf's error for ``key`` in ``section``, or None when OmegaConf takes the key after all."""
    try:
        om.merge(om.structured(section), {key: None})
    except ConfigKeyError as e:
        return e
    except OmegaConfBaseException:
        return None
    return None


def _without(raw: Any, unknown: list[_UnknownKey]) -> Any:
    """``raw`` (the YAML file's content, prepared) with the ``unknown`` keys removed."""
    for u in unknown:
        node = raw
        for part in u.parts[:-1]:
            node = node[part]
        del node[u.parts[-1]]
    return raw
