"""Data mixtures: named sources of token files drawn by target token ratios (``data.mixture``).

A source is cut into fixed-length instances like any token file (``chunk_size`` tokens, documents running across
instance boundaries as in OLMo's pretraining data), so a source's share of tokens is its share of instances. The
mix is a *selection*: for every source the number of instances its ratio asks for (the largest-remainder rounding of
``ratio * total``, so the counts add up exactly), made of whole passes over the source and, for the fraction of a
pass left, instances drawn without replacement with ``mixture.seed`` (the first values of a keyed permutation of
the source, computed one at a time: the selection takes no memory however large the mix). It depends only on the
config and the files' sizes, never on the world size; the epoch's order (``global_indices.npy``) then shuffles it as it
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
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from ..exceptions import OLMoConfigurationError, OLMoDataError

if TYPE_CHECKING:
    from ..config import MixtureConfig

__all__ = [
    "MixturePlan",
    "MixtureSelection",
    "SourcePlan",
    "allocate",
    "plan_mixture",
    "mixture_selection",
    "check_recorded_mixture",
    "MIXTURE_FILE",
]

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


def check_recorded_mixture(path: Path, plan: MixturePlan, key: str, fix: str) -> None:
    """Refuse a mixture that is not the one a run recorded in ``path`` (its ``mixture.json``) when it began: a source
    whose files now hold another number of instances (a glob that matches more files, a file that grew), or changed
    settings, would change the selection, and with it the instances that every position of the run's data order
    (and so a checkpoint's data position) names. No record, no check (the run has not written it yet).

    :param key: where the mixture is in the config (``data.mixture``), for the message.
    :param fix: how to train on the sources as they are now instead (a new run, say), for the message.
    :raises OLMoDataError: naming the record, each source that changed and how.
    """
    if not path.is_file():
        return
    try:
        record = json.loads(path.read_text())
        recorded = [
            (str(s["name"]), int(s["available_instances"]), int(s["instances"])) for s in record["sources"]
        ]
        seed, chunk_size = int(record["seed"]), int(record["chunk_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:  # ValueError: not JSON, or not a number
        raise OLMoDataError(
            f"'{path}', the record of the mixture in {key} this run draws, cannot be read ({type(e).__name__}: "
            f"{e}), so whether the sources still hold what the run drew from cannot be checked. Restore it from a "
            f"copy, or delete it to record the mixture as the sources hold it now."
        ) from None
    changes = []
    if [r[0] for r in recorded] != [s.name for s in plan.sources]:
        changes.append(f"its sources were {[r[0] for r in recorded]} and are {[s.name for s in plan.sources]} now")
    else:
        for i, ((name, available, instances), now) in enumerate(zip(recorded, plan.sources)):
            where = f"source '{name}' ({key}.sources[{i}])"
            if available != now.available:
                changes.append(
                    f"{where} held {available:,} instances of {chunk_size} tokens and holds {now.available:,} now: its "
                    f"files ({key}.sources[{i}].paths) grew, shrank or were replaced"
                )
            elif instances != now.instances:
                changes.append(
                    f"{where} gave {instances:,} instances and would give {now.instances:,} now: its ratio or "
                    f"{key}.tokens changed"
                )
    if seed != plan.seed:
        changes.append(f"{key}.seed was {seed} and is {plan.seed} now")
    if chunk_size != plan.chunk_size:
        changes.append(
            f"instances were {chunk_size} tokens long and are {plan.chunk_size} now (model.max_sequence_length)"
        )
    if changes:
        raise OLMoDataError(
            f"The mixture in {key} is not the one this run recorded in '{path}' when it began: {'; '.join(changes)}. "
            f"The instances drawn, and with them what the run's data order and its checkpoints' data position point "
            f"at, would change silently. Restore the sources' files and settings as they were; or, to draw from "
            f"them as they are now, {fix}."
        )


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


def mixture_selection(plan: MixturePlan, offsets: list[int]) -> MixtureSelection:
    """The selected instances as indices into the sources' files taken together (source ``i`` starts at
    ``offsets[i]``): for each source, its whole passes in order, then the rest of a pass drawn without replacement
    (the first instances of a seeded permutation of the source, keyed by ``(seed, source position)``)."""
    return MixtureSelection(plan, offsets)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijective scramble of 64 bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class _Permutation:
    """A seeded permutation of ``range(n)`` computed element by element in O(1) memory: a 4-round Feistel network
    over the smallest square power of two at least ``n``, walked until it lands inside ``range(n)`` (on average
    fewer than 4 steps). Drawing ``k`` instances without replacement is taking its first ``k`` values."""

    ROUNDS = 4

    def __init__(self, n: int, key: tuple[int, ...]):
        self.n = n
        self.half_bits = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half_bits) - 1
        seed = 0
        for part in key:
            seed = _mix64((seed ^ (part & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64)
        self.keys = [_mix64(seed + r + 1 & _MASK64) for r in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half_bits, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half_bits) | right

    def __call__(self, x: int) -> int:
        y = self._encrypt(x)
        while y >= self.n:
            y = self._encrypt(y)
        return y


class MixtureSelection:
    """The mixture's selection as a function from a position to an instance of the files taken together, in memory
    that grows with the number of sources only (an OLMo-scale mix of a billion instances costs nothing to hold, on
    every rank and DataLoader worker). Positions ``[starts[i], starts[i + 1])`` belong to source ``i``."""

    def __init__(self, plan: MixturePlan, offsets: list[int]):
        counts = [s.instances for s in plan.sources]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.offsets = list(offsets)
        self.available = [s.available for s in plan.sources]
        self.full = [(s.instances // s.available) * s.available if s.available else 0 for s in plan.sources]
        self.permutations = [_Permutation(max(n, 1), (plan.seed, i)) for i, n in enumerate(self.available)]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < len(self):
            raise IndexError(f"position {position} is outside the mixture's {len(self)} instances")
        i = int(np.searchsorted(self.starts, position, side="right")) - 1
        p = position - int(self.starts[i])
        local = p % self.available[i] if p < self.full[i] else self.permutations[i](p - self.full[i])
        return self.offsets[i] + local

    def indices(self, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Positions ``[start, stop)`` as an int64 array (for inspection and tests; training reads one at a time)."""
        stop = len(self) if stop is None else stop
        return np.fromiter((self[p] for p in range(start, stop)), dtype=np.int64, count=stop - start)
