"""Benchmarks: the code behind ``scripts/benchmark*.py`` (each module's ``main`` is the command's, through the thin
``olmo.cli.benchmark*`` modules) and the pieces they share (``common``: synthetic batches, a phase clock;
``scripts``: the other scripts a benchmark runs, found beside its own).

``olmo_worker`` is loaded by its path into the original OLMo's virtualenv and imports nothing from ``olmo``.
May import every package but ``olmo.cli``.
"""
