"""Run the in-loop evaluators on a saved checkpoint.

    python scripts/eval.py CHECKPOINT_DIR [--out=results.json] [--key.path=value ...]
    python scripts/eval.py runs/x/step1000-unsharded "--evaluators=[{label: piqa, type: downstream}]"
    torchrun --nproc_per_node=8 scripts/eval.py CHECKPOINT_DIR

The checkpoint's own ``config.yaml`` supplies the model and the evaluators; overrides work as in
scripts/train.py (replace the evaluator list, ``--eval_subset_num_batches=20``, ...). Prints a table
and writes the metrics as JSON (``--out``, default ``CHECKPOINT_DIR/../eval-stepN.json``). ``--out`` never points
into a checkpoint (the one evaluated, or any other committed one): nothing is ever written into a committed
checkpoint.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from olmo.checkpoint import MARKER, CheckpointInfo, inspect_checkpoint, load_checkpoint
from olmo.checkpoint.restore import RestorePlan, preflight_restore
from olmo.checkpoint.safe_reads import fetch
from olmo.config import TrainConfig
from olmo.distributed import (
    DistEnv,
    ParallelizeOptions,
    ParallelLayout,
    autocast_dtype,
    build_model,
    init_distributed,
    teardown_distributed,
)
from olmo.eval import Evaluator, evaluators_of_run
from olmo.exceptions import OLMoCliError, OLMoConfigurationError
from olmo.util import env_rank, env_world_size, is_url, result_file_problem, write_result_file
from olmo.util.rng import seed_all

log = logging.getLogger("eval")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if not argv or argv[0].startswith("-"):
        raise OLMoCliError("Usage: scripts/eval.py CHECKPOINT_DIR [--out=results.json] [--key.path=value ...]")
    out, overrides = _split_out(argv[1:])
    info = inspect_checkpoint(argv[0], flag="CHECKPOINT_DIR")
    out_path = Path(out) if out else Path(info.path).parent / f"eval-step{info.step}.json"
    check_output_path(out_path, info)
    cfg = TrainConfig.load_saved(fetch(info.path, "config.yaml"), ["compile=null", *overrides])
    cfg.validate(env_world_size())
    if not cfg.evaluators:
        raise OLMoConfigurationError(
            "There is nothing to evaluate: the checkpoint's config has no evaluators. Give some, e.g. "
            '"--evaluators=[{label: piqa, type: downstream}]".'
        )
    preflight_restore(RestorePlan(info, load_optimizer_state=False, load_trainer_state=False), cfg.model)
    evaluators = evaluators_of_run(cfg, env_world_size(), env_rank())
    env = init_distributed(cfg.distributed_timeout_minutes)
    try:
        start = time.perf_counter()
        metrics = evaluate(cfg, env, info, evaluators)
        elapsed = time.perf_counter() - start
        if env.is_main:
            _report(metrics, info.path, info.step, elapsed)
            write_result_file(
                out_path, json.dumps({"checkpoint": info.path, "step": info.step, **metrics}, indent=1) + "\n"
            )
            log.info("Wrote %s", out_path)
        return 0
    finally:
        teardown_distributed()


def _split_out(args: list[str]) -> tuple[Optional[str], list[str]]:
    """The path of ``--out=PATH`` or ``--out PATH`` (the last one given), and the config overrides around it."""
    out, overrides, i = None, [], 0
    while i < len(args):
        if args[i] == "--out":
            if i + 1 == len(args):
                raise OLMoCliError("--out needs a path: --out=results.json.")
            out, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--out="):
            out = args[i].split("=", 1)[1]
        else:
            overrides.append(args[i])
        i += 1
    return out, overrides


def evaluate(
    cfg: TrainConfig, env: DistEnv, info: CheckpointInfo, evaluators: list[Evaluator]
) -> dict[str, float]:
    """Build the model, load ``info`` into it and run every evaluator (the model is garbage once this returns, so
    :func:`teardown_distributed` frees it with the process groups)."""
    seed_all(cfg.seed)
    model = build_model(cfg.model, ParallelLayout.of_run(cfg, env), ParallelizeOptions.from_train_config(cfg))
    load_checkpoint(info, model, None, load_trainer_state=False)
    metrics: dict[str, float] = {}
    for evaluator in evaluators:
        metrics.update(evaluator.evaluate(model, env.device, autocast_dtype(cfg, env.device)))
    return metrics


def check_output_path(path: Path, info: CheckpointInfo) -> None:
    """Refuse an ``--out`` that cannot or must not be written (anything but an earlier eval.py result, or a path in
    a checkpoint: the one evaluated or any committed one), before the (long) evaluation runs."""
    resolved = path.resolve()  # a link into a checkpoint leads inside it
    evaluated = None if is_url(info.path) else Path(info.path).resolve()
    holder = next((p for p in (resolved, *resolved.parents) if p == evaluated or (p / MARKER).is_file()), None)
    if holder is not None:
        beside = holder.parent / f"eval-step{info.step}.json"
        default = " (the default)" if holder == evaluated else ""
        where = "is the checkpoint" if holder == resolved else "is inside the checkpoint"
        raise OLMoCliError(
            f"--out={path} {where} '{holder}': nothing is ever written into a committed checkpoint "
            f"(it must stay exactly as it was committed). Write the results beside it instead, e.g. --out={beside}"
            f"{default}."
        )
    reason = result_file_problem(path, ("checkpoint", "step"))
    if reason is not None:
        raise OLMoCliError(
            f"--out={path} cannot be written: {reason}. Give --out=FILE.json, a new file or an earlier result, in a "
            f"writable folder."
        )


def _report(metrics: dict[str, float], checkpoint: str, step: int, seconds: float) -> None:
    table = Table(title=f"{checkpoint} (step {step}), {seconds:.1f} s")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in sorted(metrics):
        table.add_row(key, f"{metrics[key]:.4f}")
    Console(stderr=True).print(table)
