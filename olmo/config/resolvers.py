"""OmegaConf resolvers available inside configs: ``${path.glob:...}``, ``${path.choose:...}``,
``${path.last_checkpoint:...}``. Interpolations resolve after CLI overrides are merged.

``path.last_checkpoint`` finds the newest committed checkpoint with :mod:`olmo.util.checkpoint_dirs`, which needs no
torch. :func:`add_resolver` lets code above the config layer add its own."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf as om
from omegaconf.resolvers import oc

from ..exceptions import OLMoConfigurationError
from ..util.checkpoint_dirs import path_last_checkpoint
from ..util.secrets import note_env_value

__all__ = ["add_resolver", "register_resolvers"]

_URL = re.compile(r"^[a-z0-9]+://")


def _path_glob(*patterns: str) -> list[str]:
    """Sorted matches of every pattern, concatenated. A pattern that matches nothing stays as it is: the config
    still loads (for ``--help``, ``--dry_run``'s plan, a ladder's dry run), and building the data then stops with
    an error naming the key and the pattern (:func:`olmo.data.build_memmap_dataset`)."""
    matches: list[str] = []
    for pattern in patterns:
        matches.extend(sorted(glob.glob(pattern)) or [pattern])
    return matches


def _path_choose(*paths: str) -> str:
    """The first argument that is a URL or an existing path."""
    for path in paths:
        if _URL.match(path) or Path(path).exists():
            return path
    raise OLMoConfigurationError(
        f"${{path.choose:{','.join(paths)}}}: none of these paths exists. Create one or override the key."
    )


def _env(key: str, *default: Any) -> Any:
    """OmegaConf's own ``${oc.env:NAME[,DEFAULT]}``, noting the value read so that it is masked wherever the trainer
    prints (:func:`olmo.util.secrets.redact_text`); saved configs keep the interpolation as written."""
    value = oc.env(key, *default)
    if key in os.environ:
        note_env_value(key, value)
    return value


_RESOLVERS: dict[str, Callable[..., Any]] = {
    "oc.env": _env,
    "path.glob": _path_glob,
    "path.choose": _path_choose,
    "path.last_checkpoint": path_last_checkpoint,
}


def add_resolver(name: str, fn: Callable[..., Any]) -> None:
    """Make ``${name:...}`` available in configs, replacing an earlier resolver of that name."""
    _RESOLVERS[name] = fn
    om.register_resolver(name, fn, replace=True)


def register_resolvers() -> None:
    """Register our resolvers (idempotent)."""
    for name, fn in _RESOLVERS.items():
        om.register_resolver(name, fn, replace=True)
