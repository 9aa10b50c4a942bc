"""``scripts/benchmark_data_order.py``: the command is :func:`olmo.bench.data_order.main` (its docstring has the usage)."""

from olmo.bench.data_order import main

__all__ = ["main"]
