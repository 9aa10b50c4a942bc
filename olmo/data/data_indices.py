"""``save_folder/data-indices/``: which instances every rank trained on at every step.

Each line is ``step<TAB>index<TAB>index...`` (OLMo's format). A fresh run writes ``rank{R}.tsv.gz``;
a launch that resumes after step N writes ``rank{R}.step{N}.tsv.gz``, so a file cut short by a crash is
never appended to (a gzip stream with an unfinished member followed by another cannot be read).
:func:`read_data_indices` merges the files; for a step trained more than once (after a crash), the
launch that resumed latest wins, and steps an earlier launch trained past the checkpoint a later
launch resumed from are dropped: only the steps behind the final weights remain.
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


class DataIndexLog:
    """Writes this rank's instance indices for every step of one launch.

    :param folder: the run's ``save_folder``.
    :param start_step: the step this launch resumes after (0 for a fresh run).
    """

    def __init__(self, folder: str, rank: int, start_step: int, enabled: bool = True):
        self.file: Optional[IO[str]] = None
        if enabled:
            name = f"rank{rank}.tsv.gz" if start_step == 0 else f"rank{rank}.step{start_step}.tsv.gz"
            path = Path(folder) / "data-indices" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = gzip.open(path, "wt")

    def write(self, step: int, indices: torch.Tensor) -> None:
        if self.file is not None:
            self.file.write("\t".join([str(step), *map(str, indices.tolist())]) + "\n")
            self.file.flush()  # a sync-flush block: everything up to here survives a crash

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def read_data_indices(folder: str | Path) -> dict[int, dict[int, list[int]]]:
    """``{step: {rank: [instance indices]}}`` from every launch's files in ``folder/data-indices``."""
    files = []
    for path in (Path(folder) / "data-indices").glob("rank*.tsv.gz"):
        match = _NAME.match(path.name)
        if match:
            files.append((int(match.group(2) or 0), int(match.group(1)), path))
    launches: dict[int, list[tuple[int, Path]]] = {}
    for start, rank, path in files:
        launches.setdefault(start, []).append((rank, path))
    steps: dict[int, dict[int, list[int]]] = {}
    for start in sorted(launches):
        # A launch that resumed after step `start` discarded whatever earlier launches trained past it.
        for stale in [step for step in steps if step > start]:
            del steps[stale]
        for rank, path in launches[start]:
            for step, indices in _read_lines(path):
                steps.setdefault(step, {})[rank] = indices
    return steps


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
