"""Checkpoint directories as files on disk, without torch: the commit marker, discovery, the newest checkpoint.

Kept at the bottom of the package (beside the config layer) so that ``${path.last_checkpoint:FOLDER}`` resolves
in any config, whoever loads it; :mod:`olmo.checkpoint` builds loading and saving on top of it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..exceptions import OLMoCheckpointError, OLMoConfigurationError

__all__ = [
    "MARKER",
    "STEP_DIR",
    "CheckpointInfo",
    "read_marker",
    "list_checkpoints",
    "find_latest_checkpoint",
    "unreadable_checkpoints",
    "path_last_checkpoint",
]

log = logging.getLogger(__name__)

MARKER = ".olmo-checkpoint.json"
STEP_DIR = re.compile(r"^step(\d+)(-unsharded)?$")
"""A checkpoint directory's name: ``stepN`` (sharded) or ``stepN-unsharded``."""


def read_marker(path: Path) -> dict[str, Any]:
    """Parse a ``.olmo-checkpoint.json`` marker and check its fields.

    :raises OLMoCheckpointError: if it is unreadable, not JSON, or lacks ``step``/``sharded``/``files``.
    """
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        meta["step"] = int(meta["step"])
        meta["sharded"] = bool(meta["sharded"])
        if not isinstance(meta.get("files"), dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in meta["files"].items()
        ):
            raise ValueError("'files' is not a map of file names to sizes")
        return meta
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise OLMoCheckpointError(
            f"The commit marker '{path}' is damaged ({type(e).__name__}: {e}), so the checkpoint it marks "
            f"cannot be trusted to be complete. Load another checkpoint, or copy this one again from its source."
        ) from None


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory is, as far as we can tell without loading it."""

    path: str
    step: int
    sharded: bool
    marked: bool
    ephemeral: bool = False
    layout: str = "olmo-trainer"
    """``olmo-trainer`` for ours, else the original OLMo trainer's layout (:mod:`olmo.checkpoint.olmo_formats`)."""


def list_checkpoints(folder: os.PathLike | str) -> list[CheckpointInfo]:
    """Committed checkpoints directly inside ``folder``, oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / MARKER).is_file():
            try:
                ephemeral = bool(read_marker(child / MARKER).get("ephemeral", False))
            except OLMoCheckpointError as e:
                log.warning("Ignoring checkpoint %s: %s", child, e)
                continue
            found.append(CheckpointInfo(str(child), int(match.group(1)), match.group(2) is None, True, ephemeral))
    # At equal steps the sharded checkpoint sorts last (it is the one resumes prefer, as in OLMo).
    return sorted(found, key=lambda c: (c.step, c.sharded))


def unreadable_checkpoints(folder: os.PathLike | str) -> list[str]:
    """Checkpoint directories directly inside ``folder`` whose marker exists but cannot be read (damaged):
    :func:`list_checkpoints` passes over them, and a resume must move them aside rather than write over them."""
    root = Path(folder)
    if not root.is_dir():
        return []
    out = []
    for child in sorted(root.iterdir()):
        if STEP_DIR.match(child.name) and child.is_dir() and (child / MARKER).is_file():
            try:
                read_marker(child / MARKER)
            except OLMoCheckpointError:
                out.append(str(child))
    return out


def find_latest_checkpoint(folder: os.PathLike | str) -> Optional[Path]:
    """The newest committed checkpoint in ``folder`` (sharded wins a tie), or None."""
    checkpoints = list_checkpoints(folder)
    return Path(checkpoints[-1].path) if checkpoints else None


def path_last_checkpoint(folder: str) -> str:
    """``${path.last_checkpoint:FOLDER}`` in a config: the newest committed checkpoint in FOLDER."""
    latest = find_latest_checkpoint(folder)
    if latest is None:
        raise OLMoConfigurationError(f"${{path.last_checkpoint:{folder}}}: no committed checkpoint in '{folder}'.")
    return str(latest)
