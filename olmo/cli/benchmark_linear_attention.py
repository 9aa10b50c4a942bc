"""``scripts/benchmark_linear_attention.py``: the command is :func:`olmo.bench.linear_attention.main` (its docstring
has the usage)."""

from olmo.bench.linear_attention import main

__all__ = ["main"]
