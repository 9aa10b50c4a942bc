"""Plan, train, track and fit a scaling ladder: a family of model sizes trained with one recipe from one YAML.

    python scripts/ladder.py dry-run CONFIG [--size S ...] [--json] [--key.path=value ...]
    python scripts/ladder.py plot-lr CONFIG [--size S ...] --out DIR
    python scripts/ladder.py run CONFIG --size S [--budget M ...] [--overwrite] [--benchmark [--steps 20] [--warmup 5]]
    torchrun --nproc_per_node=N scripts/ladder.py run CONFIG --size S
    python scripts/ladder.py status CONFIG [--json]
    python scripts/ladder.py results CONFIG [--json] [--out DIR]

CONFIG is a ladder YAML (see configs/ladder/ and olmo/ladder/config.py): an OLMo base config, the sizes, the
devices, and the rules that turn a size into a batch, a micro-batch, a learning rate and a length. Overrides after
the config apply to the ladder, in the train script's syntax: --dir=/tmp/ladder, --chinchilla_multiple=0.5,
--sizes=[60M,150M], --train_overrides=[fused_loss=true].

* dry-run: per size, the parameters (non-embedding and total), shape, target and actual global batch, micro-batch
  per device, devices (= data-parallel size), gradient-accumulation steps, steps, tokens, learning rate, warmup,
  training FLOPs, estimated peak memory per device and wall time. --json prints only a JSON list (one object per
  size) to stdout.
* plot-lr: DIR/lr_SIZE.png, each size's learning rate over steps and tokens.
* run: trains one size with scripts/train.py's code into DIR/SIZE/ (its config is written to
  DIR/configs/SIZE.yaml), resuming from its newest checkpoint (--overwrite starts it over). The launch must have
  as many processes as the size's planned devices. With budgets, it trains the stable phase into DIR/SIZE/stable
  (stopping at each branch point in turn, where it checkpoints), then each budget's decay branch from its
  checkpoint into DIR/SIZE/budget-Mx (config DIR/configs/SIZE-budget-Mx.yaml); finished parts are skipped, so a
  rerun resumes where it stopped. --budget M (repeatable) trains only those budgets (the stable phase up to the
  latest of their branch points). --benchmark instead runs scripts/benchmark.py on it (no
  checkpoints, no evaluations, a hard stop after --warmup + 2 x --steps steps) and reports tokens/s and MFU.
* status: per size, its expected checkpoints (✔ written, ✘ not yet) with step, tokens and path, the metrics at
  each, and the latest metrics; with budgets, the stable run's checkpoints and each branch's progress.
* results: per size (per size and budget with budgets), the final training loss, evaluation metrics, tokens and
  FLOPs; the fit of L(C) = E + A * C^(-alpha), and of L(N, D) = E + A * N^(-alpha) + B * D^(-beta) when at least
  six runs vary parameters and tokens independently, with 1-sigma errors; the predicted loss of the next sizes
  (by both fits), beside their measured loss once they have run; with budgets, the compute of the stable runs and
  branches against separate runs to every budget. --out DIR writes results.json, results.md and loss_vs_compute.png; --json prints only the JSON.

Two launches of `run` for the same size at once are refused: the second stops with an error naming the ladder folder
and the process holding its lock (DIR/.locks/SIZE.rank{R}.lock, an flock released when that process ends). Different
sizes may run at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from olmo.bench.train_step import main as benchmark_main
from olmo.cli.train import main as train_main
from olmo.exceptions import OLMoCliError
from olmo.ladder.config import LadderConfig, load_ladder
from olmo.ladder.lock import run_lock
from olmo.ladder.plan import Rung, plan_ladder, write_rung_config
from olmo.ladder.report import (
    format_results,
    format_status,
    ladder_results,
    plot_loss_vs_compute,
    plot_lr,
    rung_status,
)
from olmo.ladder.run_planner import format_count, format_plan
from olmo.ladder.runs import (
    TrainRun,
    benchmark_file,
    benchmark_summary,
    check_launch,
    check_rung_data,
    select_branches,
    training_runs,
)
from olmo.util import env_rank, env_world_size, unwritable_reason

log = logging.getLogger("ladder")

COMMANDS = ("dry-run", "plot-lr", "run", "status", "results")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's options, and the ladder overrides (everything else)."""
    parser = argparse.ArgumentParser(prog="ladder.py", description=__doc__.split("\n")[0], allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name in COMMANDS:
        sub = commands.add_parser(name, allow_abbrev=False)
        sub.add_argument("config", help="ladder YAML")
        sub.add_argument("--size", action="append", help="a size of the ladder (repeatable; default: all)")
        if name in ("dry-run", "status", "results"):
            sub.add_argument("--json", action="store_true", help="print only JSON to stdout")
        if name in ("plot-lr", "results"):
            sub.add_argument("--out", required=name == "plot-lr", help="folder for the PNG (and results) files")
        if name == "run":
            sub.add_argument("--overwrite", action="store_true", help="start the size over instead of resuming it")
            sub.add_argument(
                "--budget", type=float, action="append", help="with budgets: train only this one (repeatable)"
            )
            sub.add_argument("--benchmark", action="store_true", help="measure throughput instead of training")
            sub.add_argument("--steps", type=int, default=20, help="benchmark: measured steps (run twice)")
            sub.add_argument("--warmup", type=int, default=5, help="benchmark: unmeasured steps first")
    return parser.parse_known_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)  # wherever it stands, before anything is checked (like scripts/train.py)
        return 0
    args, overrides = parse_args(argv)
    ladder = load_ladder(args.config, overrides)
    if args.command == "run":
        return run(ladder, args)
    if args.command == "results":
        return results(ladder, args)
    rungs = plan_ladder(ladder, args.size)
    if args.command == "dry-run":
        if args.json:
            print(json.dumps([r.summary() for r in rungs], indent=1))
        else:
            print("\n\n".join(describe_rung(r) for r in rungs))
    elif args.command == "plot-lr":
        out = _output_folder(args.out)
        for rung in rungs:
            plot_lr(rung, out / f"lr_{rung.name}.png")
            print(out / f"lr_{rung.name}.png")
    else:
        statuses = [rung_status(r) for r in rungs]
        print(json.dumps(statuses, indent=1) if args.json else format_status(statuses))
    return 0


def describe_rung(rung: Rung) -> str:
    """A size's plan as text, with the ladder's own numbers."""
    plan = rung.plan
    head = f"=== {rung.name}" + (" (next size: planned, not fitted)" if rung.is_next else "") + " ==="
    target = (
        f"target {rung.target_batch_tokens:,.0f} tokens ({rung.target_batch_tokens / plan.sequence_length:,.1f} "
        f"instances) -> actual {plan.global_batch_size_tokens:,} tokens ({plan.global_batch_size_instances:,} "
        f"instances): {plan.num_devices} device(s) x micro-batch {plan.rank_microbatch_instances} x "
        f"{plan.grad_accum_steps} accumulation step(s)"
    )
    steps = ", ".join(f"{s:,}" for s in rung.checkpoint_steps)
    lines = [
        head,
        format_plan(plan),
        f"  global batch: {target}",
        f"  checkpoints: steps {steps} in {rung.save_folder}",
    ]
    for b in rung.branches:
        lines.append(
            f"  budget {b.multiple:g}x: {b.steps:,} steps ({format_count(b.steps * plan.global_batch_size_tokens)} "
            f"tokens), decaying over the last {b.decay_steps:,} from the stable run's step {b.start_step:,}, in "
            f"{b.save_folder}"
        )
    compute = rung.compute()
    if compute is not None:
        lines.append(
            f"  compute: stable {format_count(compute['stable_flops'])} + branches "
            f"{format_count(compute['branches_flops'])} = {format_count(compute['total_flops'])} FLOPs, against "
            f"{format_count(compute['separate_runs_flops'])} for separate runs ({compute['saving']:.2f}x as much)"
        )
    return "\n".join(lines)


def run(ladder: LadderConfig, args: argparse.Namespace) -> int:
    if not args.size or len(args.size) != 1:
        raise OLMoCliError("run trains one size: give exactly one --size (see dry-run for the sizes).")
    (rung,) = plan_ladder(ladder, args.size)
    check_launch(rung, env_world_size())
    branches = select_branches(rung, args.budget)
    check_rung_data(rung)  # before anything is written, the lock included
    with run_lock(Path(ladder.dir), rung.name, env_rank()):
        config = write_rung_config(ladder, rung)
        log.info("Size %s: train config %s, save folder %s.", rung.name, config, rung.save_folder)
        if args.benchmark:
            return benchmark(ladder, rung, config, args)
        for train_run in training_runs(ladder, rung, config, branches, args.overwrite):
            if train_run.description:
                log.info(train_run.description)
            code = train_main(train_argv(train_run))
            if code:
                return code
    return 0


def train_argv(train_run: TrainRun) -> list[str]:
    """``scripts/train.py``'s arguments for one run of a size."""
    argv = [str(train_run.config), "--save_overwrite" if train_run.overwrite else "--try_load_latest_save"]
    return argv if train_run.stop_at is None else [*argv, f"--stop_at={train_run.stop_at}"]


def benchmark(ladder: LadderConfig, rung: Rung, config: Path, args: argparse.Namespace) -> int:
    """``run --benchmark``: scripts/benchmark.py on the size's config, and its speed against the plan."""
    out = benchmark_file(ladder, rung)
    flags = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--data", "config", "--out", str(out)]
    code = benchmark_main([str(config), *flags])
    if code == 0 and env_rank() == 0:
        log.info(benchmark_summary(rung, out))
    return code


def _output_folder(out: str) -> Path:
    """The folder of ``--out``, created.

    :raises OLMoCliError: where it cannot be a folder this user writes to (a file, say).
    """
    folder = Path(out)
    problem = unwritable_reason(folder)
    if problem is not None:
        raise OLMoCliError(
            f"--out={out!r} cannot hold the output: {problem}. Give a folder (it is created if missing)."
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def results(ladder: LadderConfig, args: argparse.Namespace) -> int:
    rungs = plan_ladder(ladder, args.size)
    report: dict[str, Any] = {"ladder": ladder.name, **ladder_results(rungs, ladder.fit_metric)}
    text = format_results(report)
    if args.out:
        out = _output_folder(args.out)
        (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "results.md").write_text(text + "\n")
        if plot_loss_vs_compute(report, out / "loss_vs_compute.png"):
            log.info("Wrote %s", out / "loss_vs_compute.png")
    print(json.dumps(report, indent=1) if args.json else text)
    return 0
