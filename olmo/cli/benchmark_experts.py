"""``scripts/benchmark_experts.py``: the command is :func:`olmo.bench.experts.main` (its docstring has the usage)."""

from olmo.bench.experts import main

__all__ = ["main"]
