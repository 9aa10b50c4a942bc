"""What ``ladder.py run`` trains for one size, and the checks before it writes anything.

The command checks the launch (:func:`check_launch`) and the data (:func:`check_rung_data`), takes the size's lock
(:func:`olmo.ladder.lock.run_lock`), writes the size's train config (:func:`olmo.ladder.plan.write_rung_config`) and
trains each of the :func:`training_runs` in turn with ``scripts/train.py``'s code. With budgets, those are the stable
phase up to each branch point (each stop writes the checkpoint a branch starts from), then each budget's decay
branch; what is already trained is skipped, so a rerun resumes where the last one stopped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..data import DataContext, build_dataset
from ..exceptions import OLMoCliError
from ..util.checkpoint_dirs import list_checkpoints
from .config import LadderConfig
from .plan import Branch, Rung, write_rung_config

__all__ = [
    "TrainRun",
    "benchmark_file",
    "benchmark_summary",
    "check_launch",
    "check_rung_data",
    "select_branches",
    "training_runs",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainRun:
    """One training run of a size: ``scripts/train.py``'s code on :attr:`config`."""

    config: Path
    """The train config (``DIR/configs/SIZE.yaml``, or a budget's ``SIZE-budget-Mx.yaml``)."""
    overwrite: bool
    """Start the run over (``--save_overwrite``) instead of resuming its newest checkpoint (``--try_load_latest_save``)."""
    stop_at: Optional[int] = None
    """Stop after this step (``--stop_at``), which checkpoints: a branch point of the stable phase."""
    description: str = ""
    """What the run trains, for the log; empty for a size without budgets."""


def check_launch(rung: Rung, world_size: int) -> None:
    """Refuse a launch whose process count is not the size's planned devices.

    :raises OLMoCliError: naming the ``torchrun`` options that launch the size, or ``--max_devices`` to replan it.
    """
    devices = rung.plan.num_devices
    if world_size != devices:
        raise OLMoCliError(
            f"Size {rung.name!r} is planned for {devices} device(s) (global batch {rung.plan.global_batch_size_instances}"
            f" = {devices} x micro-batch {rung.plan.rank_microbatch_instances} x {rung.plan.grad_accum_steps} "
            f"accumulation steps), but this launch has {world_size} process(es). Launch it with "
            f"torchrun --nproc_per_node={devices} (or --nnodes x --nproc_per_node = {devices}), or plan it for "
            f"{world_size} with --max_devices={world_size} if its batch allows."
        )


def check_rung_data(rung: Rung) -> None:
    """Check the size's training data (its files, not their tokens), before anything is written.

    :raises OLMoDataError: naming the missing or malformed file.
    """
    cfg = rung.cfg
    dataset = build_dataset(
        cfg.data, cfg.model, DataContext.from_train_config(cfg), include_instance_metadata=False
    )
    dataset.validate(cfg.model.vocab_size, scan_max_tokens=0)


def select_branches(rung: Rung, budgets: Optional[list[float]]) -> list[Branch]:
    """The branches ``--budget`` names (all when None).

    :raises OLMoCliError: for ``--budget`` on a size without budgets, or a budget it does not have.
    """
    if budgets is None:
        return rung.branches
    have = {b.multiple: b for b in rung.branches}
    unknown = [m for m in budgets if m not in have]
    if unknown:
        listing = ", ".join(f"{m:g}" for m in have) or "none (the ladder has no budgets)"
        raise OLMoCliError(
            f"--budget {', '.join(f'{m:g}' for m in unknown)}: size {rung.name!r} has budgets {listing}. Pick one "
            f"of them, or add it to the ladder's budgets."
        )
    return [have[m] for m in sorted(set(budgets))]


def training_runs(
    ladder: LadderConfig, rung: Rung, config: Path, branches: list[Branch], overwrite: bool
) -> list[TrainRun]:
    """The runs that train the size from its train ``config`` (:func:`~olmo.ladder.plan.write_rung_config`'s), in
    order; with ``branches``, their configs are written too.

    Without branches: one run of the whole size, resuming it unless ``overwrite``. With branches: the stable phase to
    each branch point not yet checkpointed, then each branch not yet finished (``overwrite``: everything, the first
    run starting over). Training to a branch point only adds checkpoints up to it, so what is there now decides.

    :raises OLMoCliError: for a stable run past a branch point without a checkpoint at it.
    """
    if not branches:
        return [TrainRun(config, overwrite)]
    runs = []
    start_over = overwrite
    saved = {c.step for c in list_checkpoints(rung.save_folder) if not c.ephemeral}
    for point in sorted({b.start_step for b in branches}):
        if point in saved and not overwrite:
            log.info("Size %s: the stable run's checkpoint at step %d is there.", rung.name, point)
            continue
        if saved and max(saved) > point and not overwrite:
            raise OLMoCliError(
                f"Size {rung.name!r}: the stable run in {rung.save_folder} is past step {point} (at {max(saved)}) "
                f"but has no checkpoint at it, which a budget branches from. Rerun with --overwrite to train the "
                f"stable phase again, or drop that budget with --budget."
            )
        description = f"Size {rung.name}: training the stable phase to step {point}."
        runs.append(TrainRun(config, start_over, stop_at=point, description=description))
        start_over = False
    for branch in branches:
        path = write_rung_config(ladder, rung, branch)
        done = {c.step for c in list_checkpoints(branch.save_folder) if not c.ephemeral}
        if branch.steps in done and not overwrite:
            log.info("Size %s, budget %gx: finished (%s).", rung.name, branch.multiple, branch.save_folder)
            continue
        description = (
            f"Size {rung.name}, budget {branch.multiple:g}x: decaying from step {branch.start_step} to "
            f"{branch.steps} into {branch.save_folder}."
        )
        runs.append(TrainRun(path, overwrite, description=description))
    return runs


def benchmark_file(ladder: LadderConfig, rung: Rung) -> Path:
    """Where ``ladder.py run --benchmark`` writes the size's ``scripts/benchmark.py`` result (its folder created)."""
    path = Path(ladder.dir) / "benchmarks" / f"{rung.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def benchmark_summary(rung: Rung, result: Path) -> str:
    """One line of the size's measured speed (``scripts/benchmark.py``'s ``result``) against its plan."""
    measured = json.loads(result.read_text())["results"]
    mfu = "n/a" if measured["mfu"] is None else f"{100 * measured['mfu']:.1f}%"
    return (
        f"Size {rung.name}: {measured['tokens_per_second']:,.0f} tokens/s per device, MFU {mfu} (planned at "
        f"{100 * rung.plan.assumed_mfu:.0f}%); {result}."
    )
