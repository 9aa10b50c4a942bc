"""``scripts/benchmark_dataloader.py``: the command is :func:`olmo.bench.dataloader.main` (its docstring has the usage)."""

from olmo.bench.dataloader import main

__all__ = ["main"]
