"""Nothing a run reads is deleted by the run: every input (:func:`olmo.config.input_paths.run_inputs`) is checked
against what the launch removes from ``save_folder`` up front (``--save_overwrite``) and what the run may delete
later (checkpoint retention, ephemeral checkpoints, a checkpoint saved again over an old one), before anything is
written; a rewind that a callback asks for mid-run keeps the checkpoints an input lies in (:func:`kept_checkpoints`).

A path is followed as the kernel follows it, link by link: an input is lost when any entry on its way is removed,
whether the removed entry is a folder that holds it or a link it passes through (a link in ``save_folder`` is
removed as a link, so what it points to survives, but a path through it no longer leads there).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config.input_paths import RunInput
from ..exceptions import OLMoCheckpointError
from ..util import is_url, local_path_of
from ..util.checkpoint_dirs import list_checkpoints

__all__ = ["Removal", "canonical_entry", "check_inputs_kept", "later_removals", "kept_checkpoints", "path_route"]

_MAX_LINKS = 40
"""Links followed in one path before giving up, as the kernel does (ELOOP)."""


@dataclass(frozen=True)
class Removal:
    """An entry of ``save_folder`` that the launch (``now``) or the run (later) removes, and why."""

    entry: Path
    why: str
    """Ends the sentence "... lies in save_folder's ENTRY, which ..." (e.g. "--save_overwrite removes now")."""
    fix: str = ""
    """A way out besides moving the input or choosing another save_folder, as a clause ("keep every checkpoint
    with --save_num_checkpoints_to_keep=-1")."""


def path_route(path: str) -> set[Path]:
    """Every directory entry the kernel passes through to reach ``path`` (relative to the working directory), each
    as ``real parent / name``: the links on the way and what they lead to. A link loop ends the walk."""
    given = local_path_of(path)
    parts = list((given if given.is_absolute() else Path.cwd() / given).parts[1:])
    current, route, links = Path("/"), set[Path](), 0
    while parts:
        name = parts.pop(0)
        if name == "..":
            current = current.parent
            continue
        entry = current / name
        route.add(entry)
        if entry.is_symlink() and links < _MAX_LINKS:
            links += 1
            target = Path(os.readlink(entry))
            if target.is_absolute():
                current = Path("/")
            parts = [p for p in target.parts if p != "/"] + parts
        else:
            current = entry
    return route


def _local_paths(item: RunInput) -> list[str]:
    """The local paths an input names: a glob pattern's matches (as the data reader expands it), no URL."""
    if is_url(item.path) and not item.path.startswith("file://"):
        return []
    if any(c in item.path for c in "*?["):
        return sorted(glob.glob(item.path)) or [item.path]
    return [item.path]


def canonical_entry(entry: Path) -> Path:
    """``entry`` as ``real parent / name``: the same for every way of naming it, a link kept a link."""
    return Path(os.path.realpath(entry.parent)) / entry.name


def _first_hit(item: RunInput, removals: dict[Path, Removal]) -> Optional[Removal]:
    for path in _local_paths(item):
        for step in path_route(path):
            for where in (step, *step.parents):
                if where in removals:
                    return removals[where]
    return None


def check_inputs_kept(
    save_folder: str,
    inputs: Iterable[RunInput],
    now: Iterable[Removal],
    later: Iterable[Removal],
    skip: Iterable[str] = (),
) -> None:
    """Refuse the launch when one of the run's ``inputs`` (:func:`olmo.config.input_paths.run_inputs`) lies in (or
    is reached through) an entry of ``save_folder`` that the launch removes (``now``) or, for an input read after the
    launch has started, that the run may delete (``later``). Reads the folder; writes nothing.

    :param skip: keys not read by this launch (``load_path`` when ``try_load_latest_save`` found a checkpoint).
    :raises OLMoCheckpointError: one paragraph naming every such key (three at most), its path and the fix.
    """
    removed_now = {canonical_entry(r.entry): r for r in now}
    removed_later = {canonical_entry(r.entry): r for r in later}
    if not removed_now and not removed_later:
        return
    problems: list[str] = []
    fixes: list[str] = []
    first: Optional[tuple[RunInput, Removal]] = None
    for item in inputs:
        if item.key in skip:
            continue
        hit = _first_hit(item, removed_now)
        if hit is None and item.read_later:
            hit = _first_hit(item, removed_later)
        if hit is None:
            continue
        first = first or (item, hit)
        link = (
            " (a link, which is removed as a link: the path then leads nowhere)" if hit.entry.is_symlink() else ""
        )
        problems.append(f"{item.key} '{item.path}' lies in its entry {hit.entry.name}{link}, which {hit.why}")
        if hit.fix and hit.fix not in fixes:
            fixes.append(hit.fix)
    if first is None:
        return
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    item, hit = first
    raise OLMoCheckpointError(
        f"This run would delete what it reads, so nothing was deleted or written: in save_folder '{save_folder}', "
        f"{shown}. Copy it out of the save folder first (e.g. cp -r '{hit.entry}' /elsewhere/ and point {item.key} "
        f"at the copy), {''.join(f + ', ' for f in fixes)}or choose another --save_folder."
    )


def later_removals(
    save_folder: str, save_overwrite: bool, start_step: int, removed_now: Iterable[Path]
) -> list[Removal]:
    """The checkpoints of ``save_folder`` (not removed now) that a run starting at ``start_step`` would replace while
    it trains: with ``save_overwrite``, those of a later step, which this run saves again. (Retention and the removal
    of ephemeral checkpoints pass over the checkpoints a run reads: :func:`kept_checkpoints`.)"""
    if not save_overwrite:
        return []
    gone = {canonical_entry(Path(p)) for p in removed_now}
    return [
        Removal(
            Path(c.path),
            f"this run (from step {start_step}) saves again at step {c.step} and --save_overwrite replaces",
            "drop --save_overwrite",
        )
        for c in list_checkpoints(save_folder)
        if c.step > start_step and canonical_entry(Path(c.path)) not in gone
    ]


def kept_checkpoints(save_folder: str, inputs: Iterable[RunInput]) -> set[Path]:
    """The checkpoints of ``save_folder`` that one of the run's ``inputs`` read during the run lies in (as
    :func:`path_route` finds it): a rewind or retention mid-run must not delete them."""
    found = {canonical_entry(Path(c.path)) for c in list_checkpoints(save_folder)}
    if not found:
        return set()
    kept: set[Path] = set()
    for item in inputs:
        if not item.read_later:
            continue
        for path in _local_paths(item):
            for step in path_route(path):
                kept.update(where for where in (step, *step.parents) if where in found)
    return kept
