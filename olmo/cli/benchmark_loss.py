"""``scripts/benchmark_loss.py``: the command is :func:`olmo.bench.loss.main` (its docstring has the usage)."""

from olmo.bench.loss import main

__all__ = ["main"]
