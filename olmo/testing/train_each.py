"""Several training runs in one torchrun launch: ``torchrun --nproc_per_node=N -m olmo.testing.train_each RUNS``,
``RUNS`` a JSON list of argument lists, runs ``scripts/train.py ARGS...`` for each in turn in every rank, each with a
process group of its own (``scripts/train.py`` sets one up and tears it down).

A torchrun launch spends seconds before the first step (the agent, then torch's import in every rank); a test that
trains several configs on the same ranks pays that once here. Each run is the command's own code path (the
``main`` of :mod:`olmo.cli.train`, as :func:`olmo.testing.run_train` calls it); what the runs share is only the
interpreter. The first run that exits non-zero (or raises) ends the launch with its code, naming it on stderr.

Runs of different layouts share a launch only where they are shown to work together: a later run's meshes can
meet the process groups of an earlier run, which are gone (a 4-rank launch of HYBRID_SHARD x TP=2, then TP=2 x
FSDP=2, fails with "Could not resolve the process group registered under the name 7"; TP=2 x FSDP=2 then CP=2 x
TP=2, and CP=2 x FSDP=2 then CP=4, train as their separate launches do). Runs of one layout always can.

May import what :mod:`olmo.testing` imports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

from ..util import exit_process, prepare_cli_environment

__all__ = ["run_torchrun_each"]


def run_torchrun_each(
    nproc: int,
    runs: Sequence[Sequence[Union[str, Path]]],
    timeout: float = 600,
    env: Optional[dict[str, str]] = None,
) -> subprocess.CompletedProcess[str]:
    """Launch torchrun once on CPU (gloo), as :func:`olmo.testing.run_torchrun` does, and train every
    ``scripts/train.py CONFIG ARGS...`` of ``runs`` (each ``[CONFIG, *ARGS]``) in turn on its ``nproc`` ranks; return
    the finished launch (exit status 0 when every run returned 0); runs of different layouts only where
    they work together (see the module's doc). ``env``: variables added to the ranks' environment."""
    from . import torchrun_launch

    cmd, base = torchrun_launch(nproc, "-m", __name__, json.dumps([[str(a) for a in run] for run in runs]))
    return subprocess.run(cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def main(runs: list[list[str]]) -> int:
    """Run ``scripts/train.py ARGS...`` for each ``ARGS`` of ``runs``; the first non-zero exit status, else 0."""
    from . import run_main

    for index, argv in enumerate(runs):
        code = run_main("train.py", *argv)
        if code != 0:
            print(f"run {index} of the launch (train.py {' '.join(argv)}) exited with {code}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    prepare_cli_environment()
    exit_process(main(json.loads(sys.argv[1])))
