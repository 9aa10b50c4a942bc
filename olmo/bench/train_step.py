"""Measure training throughput (tokens/s, step time and its phases, MFU, peak memory) for a config.

    python scripts/benchmark.py CONFIG [--steps 20] [--warmup 5] [--batch B] [--micro-batch M] [--seq-len T]
        [--compile | --no-compile] [--precision amp_bf16|fp32] [--data synthetic|config] [--doc-length N]
        [--override key=value ...] [--out result.json] [--smoke] [--profile]
    torchrun --nproc_per_node=N scripts/benchmark.py CONFIG ...

It runs real training steps through the code path of ``scripts/train.py``: ``build_model`` (meta init,
activation checkpointing, compile, FSDP2 under torchrun), ``build_optimizer``, ``build_scheduler``, the train
module and ``Trainer.step`` (the step ``Trainer.fit`` runs: data position, train module, metrics read-back, gen-1
GC). Nothing is saved and no metrics are logged, so the numbers are those of the step alone.

* ``--batch`` is the *device* batch (instances per device per optimizer step; the global batch is
  B x world size), split into ``--micro-batch`` instances per forward/backward. Unset, both come from the config.
* ``--data synthetic`` (default) feeds random token batches made up front (pinned on CUDA), so data time is
  ~0 and no data files are needed: it sets ``data.paths=null``, so a ``${path.glob:...}`` in the config is
  never resolved. ``--data config`` reads the config's memmaps through ``build_train_dataloader``.
  ``--doc-length N`` makes the synthetic instances documents of N/2 to 3N/2 tokens, each ending with EOS, with
  their ``doc_lens`` (it sets ``data.generate_doc_lengths=true``): the cost of masking attention to documents.
* ``--profile`` profiles 2 more steps after the measured ones (``olmo.bench.profile``): the report's ``profile``
  gives per step the busy time, each kind of work's (matmul, attention, communication, float8 casts, ...) and the
  heaviest kernels (a GPU's device time) or operators (a CPU's).
* ``evaluators=[]`` is always applied: no evaluation runs, so the evaluators' data files are never needed.
* The config's first stage is set up as training does it: ``--override 'stages=[{max_duration: 100, kl_beta:
  0.1, kl_estimator: full}]' --override max_duration=null`` measures the step of a KL stage (reference included).
* Overrides apply in this order, later ones winning: ``--smoke`` defaults, ``--override``, the flags.

``--steps`` steps run twice. The *synchronized* pass splits each step into phases, timed from the outside
(hooks on the model's forward and on the optimizer's step) with the device synchronized at each boundary, so
each phase is charged with the GPU work it queued. Those synchronizations keep the host from queueing work
ahead, so the *free-running* pass then runs the steps as training does (metrics read back every
``metrics_collect_interval`` steps) with one synchronization at each end, and gives the throughput.
The phases:

    data      getting the batch from the loader (host only)
    prepare   token-id check, host-to-device copy, labels, zero_grad (freeing last step's gradients)
    forward   the model's forward passes with the loss (all micro-batches)
    backward  backward passes, gradient clipping, and reading the metrics back when
              ``metrics_collect_interval`` is 1 (the step's host sync)
    optimizer ``optimizer.step()``
    other     the rest: reading the metrics back every N steps when the interval is N > 1, and
              gen-1 garbage collection, as ``Trainer.fit`` does them

Reported per device (rank 0's numbers; the slowest rank's step time is reported too): tokens/s from the
free-running steps' mean time, MFU = tokens/s x FLOPs/token / peak FLOP/s (``olmo.train.metrics.device_peak_flops``: a known
GPU's dense bf16 peak, or the fp32 matmul rate of this CPU, measured once per machine and cached; an MFU above 1 is
null, with a warning), and peak memory (GPU allocations, or the process's resident set on CPU). ``--smoke``
shrinks the model (2 layers, d_model 64, T=128, batch 4 in micro-batches of 2, 3 warmup + 5 steps, no compile)
for a run of seconds on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, cast

import torch
import torch.distributed as dist

from olmo.bench.common import PhaseClock, SyntheticBatches, forever, timed_step
from olmo.bench.profile import profile_steps
from olmo.config import DataConfig, ModelConfig, TrainConfig, clean_opt
from olmo.data import DataContext, build_train_dataloader
from olmo.distributed import (
    DistEnv,
    ParallelizeOptions,
    ParallelLayout,
    all_reduce,
    init_distributed,
    teardown_distributed,
)
from olmo.distributed.pipeline import build_training_model
from olmo.distributed.run_shape import RunShape
from olmo.exceptions import OLMoCliError
from olmo.model import OLMo, describe_attention
from olmo.optim import build_optimizer, build_scheduler
from olmo.train import Trainer
from olmo.train.build_module import build_train_module
from olmo.train.metrics import PeakFlops, device_peak_flops, model_flops_utilization, peak_memory_mb
from olmo.util import env_world_size, machine_info, result_file_problem, write_result_file
from olmo.util.rng import seed_all

log = logging.getLogger("benchmark")

SMOKE_MODEL_OVERRIDES = ["model.n_layers=2", "model.d_model=64"]
SMOKE_DEFAULTS = {"batch": 4, "micro_batch": 2, "seq_len": 128, "steps": 3, "warmup": 2, "compile": False}
PHASES = ("data", "prepare", "forward", "backward", "optimizer", "other")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark.py", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="training config (YAML)")
    parser.add_argument("--steps", type=int, help="measured steps (default 20)")
    parser.add_argument("--warmup", type=int, help="unmeasured steps first, for compile and allocator (default 5)")
    parser.add_argument("--batch", type=int, help="instances per device per optimizer step (default: config)")
    parser.add_argument("--micro-batch", type=int, help="instances per forward/backward (default: config)")
    parser.add_argument("--seq-len", type=int, help="tokens per instance, model.max_sequence_length")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, help="torch.compile each block (default: config)"
    )
    parser.add_argument("--precision", choices=["amp_bf16", "amp_fp16", "fp32"], help="default: config")
    parser.add_argument("--data", choices=["synthetic", "config"], default="synthetic")
    parser.add_argument(
        "--doc-length",
        type=int,
        help="synthetic documents of about this many tokens, attention masked to each (data.generate_doc_lengths)",
    )
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", help="write the result as JSON to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny model and few steps, for CI")
    parser.add_argument("--profile", action="store_true", help="then profile 2 steps: where the time goes")
    args = parser.parse_args(argv)
    defaults = {"steps": 20, "warmup": 5, **(SMOKE_DEFAULTS if args.smoke else {})}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.doc_length is not None and (args.doc_length < 1 or args.data != "synthetic"):
        parser.error(
            "--doc-length must be at least 1, and makes the synthetic data's documents (--data synthetic)"
        )
    problem = result_file_problem(Path(args.out), ("setup", "results")) if args.out else None
    if problem is not None:
        raise OLMoCliError(
            f"--out={args.out} cannot be written: {problem}. Give a new file, or an earlier result."
        )
    return args


def config_overrides(args: argparse.Namespace, world_size: int) -> list[str]:
    """Every override the flags imply, in the order they apply."""
    out = ["evaluators=[]"]  # only training steps are measured; the evaluators' data is never needed
    if args.data == "synthetic":
        out += ["data.paths=null", "data.datasets=null"]
    if args.doc_length is not None:
        out.append("data.generate_doc_lengths=true")
    if args.smoke:
        out += SMOKE_MODEL_OVERRIDES
    out += [clean_opt(o) for o in args.override]
    if args.batch is not None:
        out.append(f"global_train_batch_size={args.batch * world_size}")
    if args.micro_batch is not None:
        out.append(f"device_train_microbatch_size={args.micro_batch}")
    if args.seq_len is not None:
        out.append(f"model.max_sequence_length={args.seq_len}")
    if args.compile is not None:
        out.append("compile={}" if args.compile else "compile=null")  # {} keeps the config's compile options
    if args.precision is not None:
        out.append(f"precision={args.precision}")
    return out


def attention_info(
    model: ModelConfig, data: DataConfig, device: torch.device, autocast: Optional[torch.dtype]
) -> dict[str, Any]:
    """Which attention kernel the model runs on ``device`` under ``autocast`` (None: fp32), and why."""
    has_bias = model.alibi or data.generate_attention_mask
    info = describe_attention(model, device, autocast, has_bias, doc_masking=data.generate_doc_lengths)
    if device.type == "cuda":
        info["sdp_enabled"] = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        }
    return info


def device_info(env: DistEnv, machine: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {"type": env.device.type, "torch_threads": torch.get_num_threads()}
    if env.device.type == "cuda":
        props = torch.cuda.get_device_properties(env.device)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gb=round(props.total_memory / 1e9, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            # TF32 changes what "fp32" means for matmul speed.
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            float32_matmul_precision=torch.get_float32_matmul_precision(),
        )
    else:
        info["name"] = machine["cpu_model"] or machine["processor"]
    return info


def git_state() -> dict[str, Any]:
    """The commit of the code that runs, and whether it has uncommitted changes: git's answer in this package's
    folder (None for both when the package is not in a git checkout, as when installed from a wheel)."""

    def git(*cmd: str) -> Optional[str]:
        result = subprocess.run(["git", *cmd], cwd=Path(__file__).parent, capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def summarize(
    measured: dict[str, Any], device_tokens: int, flops_per_token: int, peak: Optional[PeakFlops]
) -> dict[str, Any]:
    """Throughput from the free-running steps; the phase split from the synchronized ones."""
    steps, n_free = measured["synced"], len(measured["free_losses"])
    step_times = [s["step"] for s in steps]
    step_time = measured["free_seconds"] / n_free
    tokens_per_second = device_tokens / step_time
    synced_median = statistics.median(step_times)
    return {
        "tokens_per_second": tokens_per_second,
        "step_time_s": step_time,
        "achieved_tflops": tokens_per_second * flops_per_token / 1e12,
        "mfu": model_flops_utilization(tokens_per_second * flops_per_token, peak),
        "first_loss": steps[0]["loss"],
        "last_loss": measured["free_losses"][-1],
        "synced": {
            "tokens_per_second": device_tokens / synced_median,
            "step_time_s": synced_median,
            "step_time_min_s": min(step_times),
            "step_time_max_s": max(step_times),
            "phases_s": {p: statistics.median(s[p] for s in steps) for p in PHASES},
            "forward_backward_s": statistics.median(s["forward"] + s["backward"] for s in steps),
            "steps": steps,
        },
    }


def _flops(rate: float) -> str:
    return f"{rate / 1e12:,.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:,.1f} GFLOP/s"


def float8_info(model_cfg: ModelConfig, model: OLMo) -> Optional[dict[str, Any]]:
    """``model.float8`` as the benchmark ran it (recipe, emulation, layers converted), or None without float8."""
    if not model_cfg.trains_float8:
        return None
    f8 = model_cfg.float8
    assert f8 is not None
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    return {"recipe": f8.recipe, "emulate": f8.emulate, "min_features": f8.min_features, "converted": converted}


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Column, Table

    setup, r, b = report["setup"], report["results"], report["setup"]["batch"]
    synced, peak, attn = r["synced"], setup["peak_flops"], setup["attention"]
    precision = setup["precision"]
    if setup["autocast_dtype"] is None and precision != "fp32":
        precision += " (runs as fp32)"  # autocast is GPU-only
    rows = [
        ("tokens/s per device", f"{r['tokens_per_second']:,.0f}", "free-running steps, as in training"),
        ("step time", f"{r['step_time_s'] * 1e3:,.1f} ms", "mean of the free-running steps"),
        (
            "synchronized step",
            f"{synced['step_time_s'] * 1e3:,.1f} ms",
            f"median; min {synced['step_time_min_s'] * 1e3:,.1f}, max {synced['step_time_max_s'] * 1e3:,.1f}; "
            f"{synced['tokens_per_second']:,.0f} tokens/s",
        ),
        *(
            (f"  {k}", f"{v * 1e3:,.1f} ms", f"{100 * v / synced['step_time_s']:.1f}% of a synchronized step")
            for k, v in synced["phases_s"].items()
        ),
        (
            "MFU",
            "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            f"{setup['model']['flops_per_token'] / 1e9:.3f} GFLOP/token",
        ),
        ("achieved", _flops(r["achieved_tflops"] * 1e12), ""),
        ("peak", _flops(peak) if peak else "n/a", setup["peak_flops_source"]),
        ("peak memory", f"{r['peak_memory_mb']:,.0f} MB", setup["memory_kind"]),
        (
            "loss first / last",
            f"{r['first_loss']:.3f} / {r['last_loss']:.3f}",
            "synthetic: 4 batches, cycled and learnt" if setup["data"] == "synthetic" else "the config's data",
        ),
        ("attention", attn["backend"], f"SDPA kernel {attn['sdpa_kernel']}" if attn["sdpa_kernel"] else ""),
        (
            "precision / compile",
            f"{precision} / {'on' if setup['compile'] else 'off'}",
            f"data {setup['data']}",
        ),
    ]
    f8 = setup.get("float8")
    if f8:
        emulated = " (emulated)" if f8["emulate"] else ""
        rows.append(("float8", f"{f8['recipe']}{emulated}", f"{f8['converted']} linear layers"))
    table = Table(
        "measurement",
        Column("value", justify="right"),
        "note",
        title=(
            f"{Path(report['config']).name} on {setup['device']['name']} x{setup['world_size']}: "
            f"{setup['model']['n_params'] / 1e6:.1f}M params, T={b['seq_len']}, device batch {b['device_batch']} "
            f"(micro {b['micro_batch']}), {report['steps']} free-running + {report['steps']} synchronized steps "
            f"after {report['warmup']} warmup"
        ),
    )
    for row in rows:
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 150).print(table)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    overrides = config_overrides(args, env_world_size())
    cfg = TrainConfig.load(args.config, overrides)
    if args.batch is not None and cfg.data_parallel_size(env_world_size()) != env_world_size():
        # --batch counts instances per data-parallel rank: ranks sharing instances (context_parallel) share them.
        overrides = config_overrides(args, cfg.data_parallel_size(env_world_size()))
        cfg = TrainConfig.load(args.config, overrides)
    cfg.validate(env_world_size())
    env = init_distributed(cfg.distributed_timeout_minutes)
    try:
        return run(args, cfg, overrides, env, argv)
    finally:
        teardown_distributed()


def run(args: argparse.Namespace, cfg: TrainConfig, overrides: list[str], env: DistEnv, argv: list[str]) -> int:
    seed_all(cfg.seed)
    machine = machine_info()  # its load average is taken now, before the benchmark loads the CPUs
    with tempfile.TemporaryDirectory(prefix="olmo-benchmark-") as work_dir:
        layout = ParallelLayout.of_run(cfg, env)
        if args.data == "synthetic":
            context = DataContext.from_train_config(cfg)
            loader: Any = SyntheticBatches(
                cfg.model, cfg.data, context, layout, args.warmup + args.steps, args.doc_length
            )
        else:
            loader = build_train_dataloader(cfg, world_size=env.world_size, rank=env.rank, work_dir=work_dir)
        options = ParallelizeOptions.from_train_config(cfg, training=True)
        model, whole = build_training_model(cfg.model, layout, options, cfg.pipeline_parallel)
        optimizer = build_optimizer(cfg.optimizer, model, skip_steps=cfg.stability.skip_spikes.enabled)
        train_module = build_train_module(cfg, env, model, optimizer, build_scheduler(cfg.scheduler))
        trainer = Trainer(cfg, env, train_module, loader, layout=layout)
        # The first stage's setup, as fit does it (with --override 'stages=[{..., kl_beta: 0.1}]' the KL step).
        trainer.train_module.enter_stage(trainer.stage_plan.at(1), at_boundary=True)
        peak = device_peak_flops(env.device, cfg.speed_monitor.gpu_flops_available)
        device_tokens = cfg.device_tokens(env.world_size)
        log.info(
            "Model: %s parameters, %.4f GFLOP/token; %d tokens per device per step; peak %.3g FLOP/s.",
            f"{whole.num_params():,}",
            whole.num_flops_per_token() / 1e9,
            device_tokens,
            peak.flops if peak else float("nan"),
        )
        batches = forever(loader)
        measured = measure(trainer, batches, args.warmup, args.steps)
        profile = profile_steps(lambda: trainer.step(next(batches)), 2, env.device) if args.profile else None
        if profile:
            log.info("Profile, ms per step (%s): %s", profile["time"], profile["categories_ms_per_step"])
    results = summarize(measured, device_tokens, whole.num_flops_per_token(), peak)
    results["warmup_step_times_s"] = measured["warmup_seconds"]
    results["peak_memory_mb"] = peak_memory_mb(env.device)
    if env.device.type == "cuda":
        results["peak_memory_reserved_mb"] = torch.cuda.max_memory_reserved(env.device) / 2**20
    slowest = all_reduce(torch.tensor([results["step_time_s"]], device=env.device), dist.ReduceOp.MAX)
    results["slowest_rank_step_time_s"] = float(slowest.item())
    if not env.is_main:
        return 0
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "config": args.config,
        "overrides": overrides,
        "git": git_state(),
        "machine": {**machine, "load_average_1_5_15min_at_end": [round(x, 2) for x in os.getloadavg()]},
        "steps": args.steps,
        "warmup": args.warmup,
        "setup": describe_setup(args, RunShape.from_train_config(cfg), env, trainer, machine, peak, device_tokens),
        "results": results,
        **({"profile": profile} if profile else {}),
    }
    print_table(report)
    if args.out:
        write_result_file(Path(args.out), json.dumps(report, indent=1, default=str) + "\n")
        log.info("Wrote %s", args.out)
    return 0


def measure(trainer: Trainer, batches: Iterator[dict[str, Any]], warmup: int, steps: int) -> dict[str, Any]:
    """Run ``warmup`` steps, ``steps`` steps timed phase by phase, then ``steps`` free-running ones.

    The phase clock synchronizes the device at every phase boundary, several times a step, which keeps the
    host from queueing ahead; that is what ``metrics_collect_interval`` avoids in training. So the
    throughput comes from the free-running steps, timed as a whole with one synchronization at each end, and
    the phases from the others. Returns the warmup steps' seconds (compile time shows there), the
    synchronized steps' phases and losses, and the free-running steps' total seconds and losses.
    """
    trainer.model.train()
    clock = PhaseClock(trainer.env.device, trainer.model, trainer.optimizer)
    if trainer.cfg.gen1_gc_interval is not None:
        gc.disable()  # as Trainer.fit does
    warmup_seconds, synced, records = [], [], []
    try:
        for i in range(warmup + steps):
            timing, step_metrics = timed_step(trainer, batches, clock)
            log.info("%s step %d: %.1f ms", "warmup" if i < warmup else "measured", i + 1, timing["step"] * 1e3)
            if i < warmup:
                warmup_seconds.append(timing["step"])
            else:
                synced.append(timing)
                records.append(step_metrics)
        clock.close()
        start = clock.now()
        free = [trainer.step(next(batches)) for _ in range(steps)]
        trainer.collect_metrics()
        free_seconds = clock.now() - start
        log.info("free-running: %d steps in %.1f ms each", steps, free_seconds / steps * 1e3)
    finally:
        gc.enable()
        clock.close()
    for timing, step_metrics in zip(synced, records):
        timing["loss"] = step_metrics.values["train/CrossEntropyLoss"]
    return {
        "warmup_seconds": warmup_seconds,
        "synced": synced,
        "free_seconds": free_seconds,
        "free_losses": [r.values["train/CrossEntropyLoss"] for r in free],
    }


def describe_setup(
    args: argparse.Namespace,
    run: RunShape,
    env: DistEnv,
    trainer: Trainer,
    machine: dict[str, Any],
    peak: Optional[PeakFlops],
    device_tokens: int,
) -> dict[str, Any]:
    """What was measured: device, precision, compile, attention kernel, batch shape (``device_tokens`` per step on
    each device), model size, peak."""
    trained, device = trainer.model, device_info(env, machine)
    model = cast(OLMo, getattr(trained, "shell", trained))  # a pipeline's stages are part of the whole model
    return {
        "world_size": env.world_size,
        "device": device,
        "data": args.data,
        "precision": run.precision or "fp32",
        "autocast_dtype": None if trainer.autocast_dtype is None else str(trainer.autocast_dtype),
        "compile": None if run.compile is None else vars(run.compile),
        "float8": float8_info(run.model, cast(OLMo, trained)) if trained is model else None,
        "pipeline_parallel": run.pipeline_parallel.degree,
        "activation_checkpointing": run.activation_checkpointing,
        "distributed_strategy": run.distributed_strategy if env.world_size > 1 else "single process",
        "optimizer": run.optimizer.name,
        "attention": attention_info(run.model, run.data, env.device, trainer.autocast_dtype),
        "batch": {
            "device_batch": trainer.device_batch_size,
            "micro_batch": run.device_train_microbatch_size,
            "grad_accum": run.grad_accum_steps(env.world_size),
            "seq_len": run.model.max_sequence_length,
            "global_batch": run.global_train_batch_size,
            "device_tokens_per_step": device_tokens,
        },
        "model": {
            "n_params": model.num_params(),
            "n_params_non_embedding": model.num_params(include_embedding=False),
            "flops_per_token": model.num_flops_per_token(),
        },
        "peak_flops": peak.flops if peak else None,
        "peak_flops_source": peak.source if peak else "unknown GPU (set speed_monitor.gpu_flops_available)",
        "memory_kind": "max GPU memory allocated" if env.device.type == "cuda" else "max resident set (RSS)",
    }
