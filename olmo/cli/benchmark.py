"""``scripts/benchmark.py``: the command is :func:`olmo.bench.train_step.main` (its docstring has the usage)."""

from olmo.bench.train_step import main

__all__ = ["main"]
