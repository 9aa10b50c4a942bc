"""``scripts/benchmark_eval.py``: the command is :func:`olmo.bench.eval.main` (its docstring has the usage)."""

from olmo.bench.eval import main

__all__ = ["main"]
