"""``scripts/gpu_checks.py``: the command is :func:`olmo.bench.gpu_checks.main` (its docstring has the usage)."""

from olmo.bench.gpu_checks import main

__all__ = ["main"]
