"""``scripts/benchmark_checkpoint.py``: the command is :func:`olmo.bench.checkpoint.main` (its docstring has the usage)."""

from olmo.bench.checkpoint import main

__all__ = ["main"]
