"""``scripts/benchmark_rl.py``: the command is :func:`olmo.bench.rl.main` (its docstring has the usage)."""

from olmo.bench.rl import main

__all__ = ["main"]
