"""``scripts/benchmark_ladder.py``: the command is :func:`olmo.bench.ladder.main` (its docstring has the usage)."""

from olmo.bench.ladder import main

__all__ = ["main"]
