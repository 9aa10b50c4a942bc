"""``scripts/benchmark_olmo.py``: the command is :func:`olmo.bench.olmo.main` (its docstring has the usage)."""

from olmo.bench.olmo import main

__all__ = ["main"]
