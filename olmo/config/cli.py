"""Reading a YAML config file and command-line overrides, with one-paragraph errors.

Used by :meth:`olmo.config.TrainConfig.load`; knows nothing of the config classes themselves (the
schema is passed in), so it sits below ``olmo.config``.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import yaml
from omegaconf import DictConfig, ListConfig
from omegaconf import OmegaConf as om
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ..exceptions import OLMoCliError, OLMoConfigurationError
from ..util.olmo_helpers import clean_opt

__all__ = [
    "clean_opt",
    "load_yaml",
    "load_structured",
    "parse_override",
    "config_error",
    "override_yaml_error",
]


T = TypeVar("T")


def load_structured(
    schema: type[T],
    path: Union[str, Path],
    overrides: Optional[list[str]] = None,
    error: Callable[[OmegaConfBaseException, str], Exception] = lambda e, source: config_error(e, source),
    prepare: Callable[[Any], Any] = lambda raw: raw,
) -> T:
    """The dataclass ``schema`` from a YAML file and command-line overrides, interpolations resolved last.

    :param overrides: ``--key.path=value``, ``key.path=value`` or bare boolean ``--flag`` arguments.
    :param error: turns an OmegaConf error and where it came from into the exception to raise.
    :param prepare: applied to the raw YAML before it is merged (e.g. accepting legacy spellings).
    """
    path = Path(path)
    raw = load_yaml(path)
    problems: list[Exception] = []
    conf = _merge_collecting(om.structured(schema), prepare(raw), f"in {path}", error, problems)
    for arg in overrides or []:
        try:
            override = parse_override(arg, schema)
        except OLMoCliError as e:
            problems.append(e)
            continue
        try:
            conf = _apply_override(conf, override)
        except OLMoConfigurationError as e:
            problems.append(e)
        except yaml.YAMLError as e:
            problems.append(override_yaml_error(override, e))
        except OmegaConfBaseException as e:
            problems.append(error(e, f"from the command-line override '--{override}'"))
        except (TypeError, ValueError) as e:
            problems.append(
                OLMoConfigurationError(
                    f"Cannot apply the override '--{override}': {e}. Give a list whole (--data.paths=[a.npy,b.npy]) "
                    f"or one field of one entry (--data.mixture.sources[1].ratio=0.3)."
                )
            )
    if len(problems) == 1:
        raise problems[0]
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise OLMoConfigurationError(
            f"{path}{' and its command-line overrides' if overrides else ''} {'have' if overrides else 'has'} "
            f"{len(problems)} problems; fix them all:\n{listing}"
        )
    try:
        loaded = om.to_object(conf)
    except OmegaConfBaseException as e:
        raise error(e, f"in {path} or its command-line overrides") from None
    # What a saved copy of the config writes instead of the environment's values (see ``TrainConfig.as_written``).
    object.__setattr__(loaded, ENV_WRITTEN, env_written_values(conf))
    return loaded  # type: ignore[return-value]


ENV_WRITTEN = "_env_written"
"""The attribute of a loaded config that holds :func:`env_written_values`."""
_ENV_INTERPOLATION = re.compile(r"(?<!\\)\$\{oc\.env:[^${}]*\}")  # not an escaped one: that is text
_ENV_MARK = re.compile("\x00(\\d+)\x00")


def env_written_values(conf: Any) -> dict[tuple[Any, ...], str]:
    """Where a config's values come from the environment (``${oc.env:NAME}``, directly or through another
    interpolation): each such string value's key path, mapped to the value with every environment variable left as
    written (escaped, ``\\${oc.env:NAME}``, so that loading the saved file gives the text, never the environment's
    value). A saved config writes these instead of the values, which may be secrets."""
    originals: list[str] = []

    def placeholder(match: re.Match) -> str:
        originals.append(match.group(0))
        return f"\x00{len(originals) - 1}\x00"

    def mark(node: Any) -> Any:
        if isinstance(node, str):
            previous = None
            while previous != node:  # innermost first: ${oc.env:A,${oc.env:B}}
                previous, node = node, _ENV_INTERPOLATION.sub(placeholder, node)
            return node
        if isinstance(node, dict):
            return {k: mark(v) for k, v in node.items()}
        if isinstance(node, list):
            return [mark(v) for v in node]
        return node

    marked = mark(om.to_container(conf, resolve=False))
    if not originals:
        return {}
    try:
        resolved = om.to_container(om.create(marked), resolve=True)
    except OmegaConfBaseException:
        return {}

    def unmark(text: str) -> str:
        while _ENV_MARK.search(text):
            text = _ENV_MARK.sub(lambda m: "\\" + originals[int(m.group(1))], text)
        return text

    found: dict[tuple[Any, ...], str] = {}

    def walk(node: Any, parts: tuple[Any, ...]) -> None:
        if isinstance(node, str) and _ENV_MARK.search(node):
            found[parts] = unmark(node)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            walk(value, (*parts, key))

    walk(resolved, ())
    return found


def _merge_collecting(
    conf: Any,
    raw: Any,
    source: str,
    error: Callable[[OmegaConfBaseException, str], Exception],
    problems: list[Exception],
) -> Any:
    """``raw`` merged into ``conf``; where that fails, each section and then each key is merged alone, so every
    bad key of the file is reported (into ``problems``) rather than only the first."""
    try:
        return om.merge(conf, raw)
    except OmegaConfBaseException as e:
        first = e
    if not isinstance(raw, DictConfig):
        problems.append(error(first, source))
        return conf
    items = om.to_container(raw, resolve=False)
    assert isinstance(items, dict)

    def merge(conf: Any, value: Any, keys: list[Any]) -> Any:
        nested = value
        for key in reversed(keys):
            nested = {key: nested}
        try:
            return om.merge(conf, om.create(nested))
        except OmegaConfBaseException as e:
            if isinstance(value, dict) and value:
                for key, item in value.items():
                    conf = merge(conf, item, [*keys, key])
                return conf
            problems.append(error(e, source))
            return conf

    for key, value in items.items():
        conf = merge(conf, value, [key])
    return conf


_LIST_INDEX = re.compile(r"\.(\d+)(?=\.|\[|$)")


def _apply_override(conf: Any, override: str) -> Any:
    """``conf`` with one dotlist entry applied. A key into a list element (``data.mixture.sources[1].ratio=0.3``,
    also written ``data.mixture.sources.1.ratio``) sets that field of that element only."""
    key, value = override.split("=", 1)
    key = _LIST_INDEX.sub(r"[\1]", key)
    if "[" not in key:
        return om.merge(conf, om.from_dotlist([override]))
    parsed = om.from_dotlist([f"value={value}"])["value"]  # the value read as YAML, as from_dotlist reads it
    for match in re.finditer(r"\[", key):
        list_key = key[: match.start()]
        node = om.select(conf, list_key, throw_on_missing=False) if list_key else None
        index_text = key[match.end() :].split("]", 1)[0]
        if not isinstance(node, ListConfig):
            raise OLMoConfigurationError(
                f"Cannot apply the override '--{override}': {list_key or '?'} is not a list"
                f"{'' if node is None else f' (it is {type(node).__name__})'}; give its fields by name."
            )
        if not index_text.isdigit() or int(index_text) >= len(node):
            raise OLMoConfigurationError(
                f"Cannot apply the override '--{override}': {list_key} has {len(node)} entries (0 to "
                f"{len(node) - 1}), so [{index_text}] names none. To add an entry, give the whole list "
                f"(--{list_key}=[...]) or edit the YAML."
            )
    om.update(conf, key, parsed, merge=True)
    return conf


_INTERPOLATION = re.compile(r"(?<!\\)\$\{")


def refuse_interpolations(raw: DictConfig, path: Union[str, Path]) -> DictConfig:
    """``raw`` (a YAML file's content, unresolved) when no value in it holds a ``${...}`` interpolation.

    For files that come from elsewhere (a checkpoint's or a run's ``config.yaml``, written resolved): an
    interpolation there is refused, never resolved, so the file can neither read this machine's environment
    (``${oc.env:...}``) nor look at its files.

    :raises OLMoConfigurationError: naming the first key that holds one.
    """

    def walk(node: Any, key: str) -> None:
        if isinstance(node, str) and _INTERPOLATION.search(node):
            raise OLMoConfigurationError(
                f"'{path}' came with a checkpoint or a run, and such configs are saved resolved, but {key} holds "
                f"the interpolation {node!r}. It is refused, not resolved: a config from elsewhere must not read "
                f"this machine's environment or files. Write the value itself in that file, or pass it with "
                f"--{key}=VALUE."
            )
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            walk(v, f"{key}.{k}" if key and isinstance(k, str) else f"{key}[{k}]" if key else str(k))

    walk(om.to_container(raw, resolve=False), "")
    return raw


def _yaml_problem(e: yaml.YAMLError, text_lines: Optional[list[str]] = None) -> str:
    """``problem at line L, column C`` from a YAML error, with a hint for the usual causes."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    hint = ""
    if mark is not None and text_lines is not None and mark.line < len(text_lines):
        line = text_lines[mark.line]
        where += f" ({line.strip()[:60]!r})"
        if "\t" in line[: mark.column + 1]:
            hint = " YAML does not allow tabs for indentation: indent with spaces."
    if "python/" in problem:
        hint = " Configs are read with a safe YAML loader that never builds Python objects: remove the tag."
    return f"{problem}{where}.{hint}"


MAX_YAML_NODES = 1_000_000
"""The most YAML nodes a config may expand to (OmegaConf's guard against alias bombs, 10,000 by default): room for
the data mixes of official recipes (OLMo 3's midtraining lists 12,252 files), and for a run's saved config.yaml of
them, while a file whose aliases multiply (a "billion laughs") is still refused."""


def load_yaml(path: Path) -> DictConfig:
    """Read ``path`` with OmegaConf's YAML loader (built on ``yaml.SafeLoader``: tags such as
    ``!!python/object`` are refused, never constructed).

    :raises OLMoConfigurationError: for a missing, unreadable, non-YAML or non-mapping file.
    """
    if not path.exists():
        raise OLMoConfigurationError(
            f"Config file '{path}' does not exist. Pass the path of a YAML config as the first argument, e.g. "
            f"configs/tiny/OLMo-tiny.yaml."
        )
    if not path.is_file():
        raise OLMoConfigurationError(f"Config '{path}' is not a file. Pass the path of a YAML config file.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OLMoConfigurationError(
            f"Config file '{path}' cannot be read ({type(e).__name__}: {e}). Check its permissions, or that it "
            f"is a UTF-8 text (YAML) file."
        ) from None
    try:
        raw = om.load(path, max_yaml_expanded_nodes=MAX_YAML_NODES)
    except yaml.YAMLError as e:
        raise OLMoConfigurationError(
            f"Config file '{path}' is not valid YAML: {_yaml_problem(e, text.splitlines())} Fix the file."
        ) from None
    except OmegaConfBaseException as e:
        raise config_error(e, f"in {path}") from None
    if not isinstance(raw, DictConfig):
        raise OLMoConfigurationError(
            f"Config file '{path}' holds a YAML {type(om.to_container(raw)).__name__}, not a mapping of keys to "
            f"values (model:, optimizer:, ...). Check that it is a training config."
        )
    return raw


def _field_type(schema: Any, dotted: str) -> Any:
    """The annotated type of ``dotted`` in the dataclass ``schema``, or None if there is no such field."""
    node: Any = schema
    hint: Any = None
    for part in dotted.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        hint = hints[part]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        node = args[0] if typing.get_origin(hint) is Union and len(args) == 1 else hint
    return hint


def parse_override(arg: str, schema: Any) -> str:
    """One command-line override (``--a.b=c``, ``a.b=c`` or a bare ``--flag``) as a dotlist entry.

    A bare flag means ``true`` and is accepted only for boolean fields, so ``--save_folder`` given
    without its value is an error rather than a folder named ``True``.

    :raises OLMoCliError: for an argument that is not an override or a bare flag of a non-boolean field.
    """
    if "=" not in arg and not arg.startswith("-"):
        raise OLMoCliError(
            f"Unexpected argument '{arg}'. After the config file, give overrides as --key.path=value "
            f"(e.g. --model.n_layers=2) or boolean flags such as --save_overwrite."
        )
    entry = clean_opt(arg)
    name = entry.split("=", 1)[0]
    if not name or "" in name.split("."):
        raise OLMoCliError(f"Cannot read the override '{arg}': the key is empty. Write --key.path=value.")
    if "=" not in arg:
        hint = _field_type(schema, name)
        if hint is not None and hint not in (bool, Optional[bool]):
            raise OLMoCliError(
                f"{arg} needs a value: write {arg}=VALUE (only boolean options such as --save_overwrite may be "
                f"given bare, meaning true)."
            )
    return entry


def config_error(e: OmegaConfBaseException, source: str) -> OLMoConfigurationError:
    """An OmegaConf error as one paragraph naming the key, where it came from (``source``) and the fix: "Invalid config
    key" for a key the schema does not have, "Invalid value for config key" for a value a key cannot hold."""
    key = getattr(e, "full_key", None)
    if not key:  # a merge error at a section names no key; an override's own text does
        given = re.match(r"from the command-line override '--([^=']+)", source)
        key = given.group(1) if given else "?"
    msg = str(getattr(e, "msg", None) or e).splitlines()[0].rstrip(".")
    cause = e.__cause__ or e.__context__
    if cause is not None and not isinstance(cause, OmegaConfBaseException):
        msg = f"{msg} ({cause})"
    what = "Invalid config key" if isinstance(e, ConfigKeyError) else "Invalid value for config key"
    if isinstance(e, ConfigKeyError):
        fix = "Remove or rename that key (see olmo/config/train_config.py for every field and its meaning)."
    elif "is not a subclass of" in msg:
        fix = (
            f"{key} is a section of several fields: set them one by one (--{key}.FIELD=VALUE; `train.py CONFIG "
            f"--help` lists them), give a mapping (--{key}='{{FIELD: VALUE}}'), or null to leave it unset."
        )
    else:
        fix = f"Fix the value in the YAML file or override it, e.g. --{key}=VALUE."
    stop = "" if msg.endswith(("?", "!")) else "."
    return OLMoConfigurationError(f"{what} '{key}' ({source}): {msg}{stop} {fix}")


def override_yaml_error(override: str, e: yaml.YAMLError) -> OLMoCliError:
    """A command-line override whose value is not valid YAML (an unclosed ``[``, a stray quote)."""
    return OLMoCliError(
        f"Cannot read the value of the override '--{override}': {getattr(e, 'problem', None) or e}. Close every "
        f'bracket and quote, and quote the whole option for the shell, e.g. "--data.paths=[a.npy,b.npy]".'
    )
