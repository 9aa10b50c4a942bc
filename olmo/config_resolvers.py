"""OmegaConf resolvers available inside configs: ``${path.glob:...}``, ``${path.choose:...}``,
``${path.last_checkpoint:...}``. Interpolations resolve after CLI overrides are merged."""

from __future__ import annotations

import glob
import re
from pathlib import Path

from omegaconf import OmegaConf as om

from .exceptions import OLMoConfigurationError

__all__ = ["register_resolvers"]

_URL = re.compile(r"^[a-z0-9]+://")


def _path_glob(*patterns: str) -> list[str]:
    """Sorted matches of every pattern, concatenated; a pattern that matches nothing is an error."""
    matches: list[str] = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern))
        if not found:
            raise OLMoConfigurationError(
                f"${{path.glob:{pattern}}} matched no files. Check the pattern, or create the data "
                f"first (see scripts/prepare_memmap_dataset.py)."
            )
        matches.extend(found)
    return matches


def _path_choose(*paths: str) -> str:
    """The first argument that is a URL or an existing path."""
    for path in paths:
        if _URL.match(path) or Path(path).exists():
            return path
    raise OLMoConfigurationError(
        f"${{path.choose:{','.join(paths)}}}: none of these paths exists. Create one or override the key."
    )


def _path_last_checkpoint(folder: str) -> str:
    from .checkpoint import find_latest_checkpoint

    latest = find_latest_checkpoint(folder)
    if latest is None:
        raise OLMoConfigurationError(f"${{path.last_checkpoint:{folder}}}: no committed checkpoint in '{folder}'.")
    return str(latest)


def register_resolvers() -> None:
    """Register our resolvers (idempotent)."""
    for name, fn in (
        ("path.glob", _path_glob),
        ("path.choose", _path_choose),
        ("path.last_checkpoint", _path_last_checkpoint),
    ):
        om.register_resolver(name, fn, replace=True)
