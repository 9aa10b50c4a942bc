"""``scripts/plan.py``: the command is :func:`olmo.ladder.mesh_plan.main` (its docstring has the usage)."""

from olmo.ladder.mesh_plan import main

__all__ = ["main"]
