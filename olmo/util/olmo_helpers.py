"""Small helpers under the names the original OLMo's scripts import from ``olmo.util`` (re-exported there):
``clean_opt`` (a CLI option as an OmegaConf dotlist entry), ``dir_is_empty`` and ``flatten_dict``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

__all__ = ["clean_opt", "dir_is_empty", "flatten_dict"]


def clean_opt(arg: str) -> str:
    """A CLI option as an OmegaConf dotlist entry: ``--model.n_layers=2`` -> ``model.n_layers=2``,
    ``--save-overwrite`` -> ``save_overwrite=true`` (OLMo's scripts turn their leftover arguments into config
    overrides this way; so does :mod:`olmo.config.cli`)."""
    name, sep, value = arg.partition("=")
    key = name.strip("-").replace("-", "_")
    return f"{key}={value if sep else 'true'}"


def dir_is_empty(path: Union[str, Path]) -> bool:
    """Whether ``path`` holds nothing (hidden files count), or is not a directory at all."""
    folder = Path(path)
    if not folder.is_dir():
        return True
    return next(folder.iterdir(), None) is None


def flatten_dict(
    dictionary: Mapping[str, Any], parent_key: str = "", separator: str = ".", include_lists: bool = False
) -> dict[str, Any]:
    """A nested mapping as one level with joined keys: ``{"b": {"e": 5}}`` -> ``{"b.e": 5}``. Lists stay values
    unless ``include_lists``, which flattens them too under their indices (``"b.e.0"``)."""
    out: dict[str, Any] = {}

    def visit(value: Any, key: str) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                visit(v, f"{key}{separator}{k}" if key else str(k))
        elif include_lists and isinstance(value, list) and value:
            for i, v in enumerate(value):
                visit(v, f"{key}{separator}{i}" if key else str(i))
        else:
            out[key] = value

    for k, v in dictionary.items():
        visit(v, f"{parent_key}{separator}{k}" if parent_key else str(k))
    return out
