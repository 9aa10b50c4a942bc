"""``save_folder/data-indices/``: which instances every rank trained on at every step.

Each line is ``step<TAB>index<TAB>index...`` (OLMo's format). A fresh run writes ``rank{R}.tsv.gz``;
a launch that resumes after step N writes ``rank{R}.step{N}.tsv.gz``, so a file cut short by a crash is
never appended to (a gzip stream with an unfinished member followed by another cannot be read).
:func:`read_data_indices` merges the files; for a step trained more than once (after a crash), the
launch that resumed latest wins, and steps an earlier launch trained past the checkpoint a later
launch resumed from are dropped: only the steps behind the final weights remain.

With ``data.instance_filter``, the instances of a step that the filter dropped (read, listed above, but
trained on with no loss) are also written, in the same format and file names, to
``data-indices/filtered/``; steps without any are left out. Readers of the files above are unaffected;
read them with ``read_data_indices(folder, filtered=True)``.
"""

from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path
from typing import IO, Optional

import torch

__all__ = ["DataIndexLog", "read_data_indices"]

_NAME = re.compile(r"^rank(\d+)(?:\.step(\d+))?\.tsv\.gz$")
FILTERED = "filtered"
"""The subfolder of ``data-indices`` that lists the instances dropped by ``data.instance_filter``."""


class DataIndexLog:
    """Writes this rank's instance indices for every step of one launch.

    :param folder: the run's ``save_folder``.
    :param start_step: the step this launch resumes after (0 for a fresh run).
    """

    def __init__(self, folder: str, rank: int, start_step: int, enabled: bool = True):
        self.file: Optional[IO[str]] = None
        self.filtered_file: Optional[IO[str]] = None  # opened at the first filtered instance
        self.name = f"rank{rank}.tsv.gz" if start_step == 0 else f"rank{rank}.step{start_step}.tsv.gz"
        self.folder = Path(folder) / "data-indices"
        if enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.file = gzip.open(self.folder / self.name, "wt")

    def write(self, step: int, indices: torch.Tensor, instance_mask: Optional[torch.Tensor] = None) -> None:
        """Record the step's instances, and those of them that ``instance_mask`` (the batch's, if any) drops."""
        if self.file is None:
            return
        _write_line(self.file, step, indices)
        if instance_mask is not None and not bool(instance_mask.all()):
            if self.filtered_file is None:
                (self.folder / FILTERED).mkdir(exist_ok=True)
                self.filtered_file = gzip.open(self.folder / FILTERED / self.name, "wt")
            _write_line(self.filtered_file, step, indices[~instance_mask])

    def close(self) -> None:
        for f in (self.file, self.filtered_file):
            if f is not None:
                f.close()


def _write_line(f: IO[str], step: int, indices: torch.Tensor) -> None:
    f.write("\t".join([str(step), *map(str, indices.tolist())]) + "\n")
    f.flush()  # a sync-flush block: everything up to here survives a crash


def read_data_indices(folder: str | Path, filtered: bool = False) -> dict[int, dict[int, list[int]]]:
    """``{step: {rank: [instance indices]}}`` from every launch's files in ``folder/data-indices``.

    :param filtered: read only the instances that ``data.instance_filter`` dropped (``data-indices/filtered``);
        a step or rank without any is absent.
    """
    root = Path(folder) / "data-indices"
    launches = _launch_files(root)
    wanted = _launch_files(root / FILTERED) if filtered else launches
    steps: dict[int, dict[int, list[int]]] = {}
    for start in sorted(launches.keys() | wanted.keys()):
        # A launch that resumed after step `start` discarded whatever earlier launches trained past it.
        for stale in [step for step in steps if step > start]:
            del steps[stale]
        for rank, path in wanted.get(start, []):
            for step, indices in _read_lines(path):
                steps.setdefault(step, {})[rank] = indices
    return steps


def _launch_files(folder: Path) -> dict[int, list[tuple[int, Path]]]:
    """``{start step: [(rank, file)]}``: the index files each launch wrote in ``folder``."""
    launches: dict[int, list[tuple[int, Path]]] = {}
    for path in folder.glob("rank*.tsv.gz"):
        match = _NAME.match(path.name)
        if match:
            launches.setdefault(int(match.group(2) or 0), []).append((int(match.group(1)), path))
    return launches


def _read_lines(path: Path) -> list[tuple[int, list[int]]]:
    out = []
    try:
        with gzip.open(path, "rt") as f:
            for line in f:
                if line.endswith("\n"):
                    step, *indices = map(int, line.split("\t"))
                    out.append((step, indices))
    except (EOFError, zlib.error, gzip.BadGzipFile):
        pass  # the file of a launch that crashed ends early; what was flushed before is intact
    return out
