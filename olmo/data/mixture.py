"""Data mixtures: named sources of token files drawn by target token ratios (``data.mixture``).

A source is cut into fixed-length instances like any token file (``chunk_size`` tokens, documents running across
instance boundaries as in OLMo's pretraining data), so a source's share of tokens is its share of instances. The
mix is a *selection*: for every source the number of instances its ratio asks for (the largest-remainder rounding of
``ratio * total``, so the counts add up exactly), made of whole passes over the source and, for the fraction of a
pass left, instances drawn without replacement with ``mixture.seed``. The selection depends only on the config and
the files' sizes, never on the world size; the epoch's order (``global_indices.npy``) then shuffles it as it
shuffles any dataset, so an index in that file is a position in the selection (``mixture.json`` says which
positions belong to which source: they are contiguous, in the order the sources are listed).

A source whose ratio needs more passes than its ``max_repetition``, or one without a whole instance, is refused
before anything is written, with the numbers and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..exceptions import OLMoConfigurationError

if TYPE_CHECKING:
    from ..config import MixtureConfig

__all__ = ["MixturePlan", "SourcePlan", "allocate", "plan_mixture", "mixture_selection", "MIXTURE_FILE"]

MIXTURE_FILE = "mixture.json"
"""Written to ``save_folder/train_data/`` by rank 0 of a run whose data is a mixture."""


@dataclass(frozen=True)
class SourcePlan:
    name: str
    target_ratio: float
    available: int
    """Whole instances in the source's files."""
    instances: int
    """Instances drawn."""
    max_repetition: float

    @property
    def repetition(self) -> float:
        """Passes over the source: drawn / available."""
        return self.instances / self.available if self.available else 0.0


@dataclass(frozen=True)
class MixturePlan:
    sources: list[SourcePlan]
    chunk_size: int
    seed: int

    @property
    def total_instances(self) -> int:
        return sum(s.instances for s in self.sources)

    def as_json(self) -> dict[str, Any]:
        """The record of ``mixture.json``: per source its target and realized share of tokens, tokens, instances,
        repetition, and the range of selection positions it holds."""
        total, start, rows = self.total_instances, 0, []
        for s in self.sources:
            rows.append(
                {
                    "name": s.name,
                    "target_ratio": s.target_ratio,
                    "realized_ratio": s.instances / total if total else 0.0,
                    "tokens": s.instances * self.chunk_size,
                    "instances": s.instances,
                    "repetition": s.repetition,
                    "available_instances": s.available,
                    "max_repetition": s.max_repetition,
                    "positions": [start, start + s.instances],
                }
            )
            start += s.instances
        return {
            "sources": rows,
            "seed": self.seed,
            "chunk_size": self.chunk_size,
            "total_instances": total,
            "total_tokens": total * self.chunk_size,
        }

    def describe(self) -> list[str]:
        """One line per source for a run's plan."""
        total = self.total_instances
        return [
            f"{s.name}: {100 * s.instances / total:.2f}% of tokens (target {100 * s.target_ratio:.2f}%), "
            f"{s.instances:,} instances, {s.repetition:.2f}x its {s.available:,}"
            for s in self.sources
        ]

    def write(self, folder: Path, name: str = MIXTURE_FILE) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        path.write_text(json.dumps(self.as_json(), indent=1) + "\n")
        return path


def allocate(ratios: list[float], total: int) -> list[int]:
    """Whole counts proportional to ``ratios`` that add up to ``total`` (largest remainder; ties to the earlier)."""
    exact = [r * total for r in ratios]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(ratios)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def plan_mixture(
    mixture: MixtureConfig, available: list[int], total_instances: int, chunk_size: int, key: str = "data.mixture"
) -> MixturePlan:
    """The instances each source gives to a mix of ``total_instances``.

    :param available: whole instances in each source's files, in the order of ``mixture.sources``.
    :raises OLMoConfigurationError: listing every source that is empty or too small for its ratio.
    """
    counts = allocate([s.ratio for s in mixture.sources], total_instances)
    problems = []
    for i, (src, n, k) in enumerate(zip(mixture.sources, available, counts)):
        where = f"{key}.sources[{i}] ({src.name!r})"
        if n == 0:
            problems.append(
                f"{where} has no whole instance of {chunk_size} tokens in its {len(src.paths)} file(s); add data or "
                f"remove the source."
            )
        elif k > n * src.max_repetition:
            needed = k / n
            problems.append(
                f"{where}: ratio {src.ratio} of {total_instances:,} instances is {k:,} instances, {needed:.2f}x its "
                f"{n:,} ({n * chunk_size:,} tokens), more than its max_repetition={src.max_repetition}. Raise "
                f"max_repetition to {math.ceil(needed * 100) / 100} or more, lower its ratio, draw fewer tokens "
                f"(mixture.tokens or max_duration), or add files to it."
            )
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise OLMoConfigurationError(f"The mixture in {key} cannot be met:\n{listing}")
    return MixturePlan(
        [
            SourcePlan(s.name, s.ratio, n, k, s.max_repetition)
            for s, n, k in zip(mixture.sources, available, counts)
        ],
        chunk_size,
        mixture.seed,
    )


def mixture_selection(plan: MixturePlan, offsets: list[int]) -> np.ndarray:
    """The selected instances as indices into the sources' files taken together (source ``i`` starts at
    ``offsets[i]``): for each source, its whole passes in order, then the rest of a pass drawn without replacement
    (sorted) with a generator seeded by ``(seed, source position)``."""
    parts = []
    for i, (src, offset) in enumerate(zip(plan.sources, offsets)):
        passes, rest = divmod(src.instances, src.available) if src.available else (0, 0)
        local = np.arange(src.available, dtype=np.int64)
        parts.extend([local + offset] * passes)
        if rest:
            rng = np.random.Generator(np.random.PCG64([plan.seed, i]))
            parts.append(np.sort(rng.choice(src.available, size=rest, replace=False)).astype(np.int64) + offset)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
