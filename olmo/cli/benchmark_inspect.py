"""``scripts/benchmark_inspect.py``: the command is :func:`olmo.bench.inspect.main` (its docstring has the usage)."""

from olmo.bench.inspect import main

__all__ = ["main"]
