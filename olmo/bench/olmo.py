"""Speed against the original: the same model timed in olmo-trainer and in ai2-olmo 0.6.0, interleaved in one run.

    python scripts/benchmark_olmo.py [--d-model 256] [--n-layers 4] [--n-heads 4] [--seq 256] [--batch 4]
        [--vocab 50304] [--rounds 10] [--iters 3] [--warmup 2] [--device cpu|cuda] [--dtype fp32|bf16]
        [--threads N] [--olmo-python .venv-olmo/bin/python] [--ours-only] [--profile a|b] [--json OUT]

Two long-lived workers build the model once each: ours (this script with ``--worker``, in our virtualenv) and the
original (``scripts/olmo_original_worker.py`` under ``--olmo-python``, the virtualenv ``make olmo-env`` makes,
started with ``-I`` from a temporary directory so that ``import olmo`` finds the original). The driver asks them
for rounds in turn and alternates which goes first (ours-original, original-ours, ...), so a change of load on a
shared machine hits both sides alike. Both get the same torch thread count (``--threads``, also as
``OMP_NUM_THREADS``) and fp32 matmul precision (TF32 allowed on CUDA, our trainer's default ``high``).

The model (OLMo-1B's architecture, scaled down): SwiGLU MLP with ``mlp_ratio`` 8, RoPE, no biases, the default
layer norm without affine parameters, tied embeddings, no dropout, ``mitchell`` init. Ours initializes it; its
state dict is loaded into the original with ``strict=True`` (the parameter names are OLMo's). Before timing, one
forward and backward on the same batch must give bit-identical logits (``torch.equal``), loss and gradients; the
result is reported, never hidden.

Measurements. A round is ``--iters`` steps with the device synchronized only at both ends; its sample is the
mean step time. ``--warmup`` unmeasured steps per side come first.

(a) forward + backward with the same plain loss: ``zero_grad``, forward to the (B, T, V) logits,
    ``F.cross_entropy`` averaged over all B*T targets, ``backward``. The same code
    (``olmo.bench.olmo_worker.Side.plain_step``) runs around both models, so only the models differ.
(b) a training step. Ours: ``Trainer.step``, the step ``Trainer.fit`` and ``scripts/benchmark.py`` run, on
    synthetic batches made up front by our collator: token-id check, copy to the device, labels, label count,
    ``zero_grad``, forward with ``fused_loss`` (chunked cross entropy from the hidden states, no logits
    tensor), backward, the gradient norm (``clip_grads``; ``max_grad_norm`` is unset, so nothing is scaled),
    learning rate (constant), the step's metrics (read back every step on CPU, every 10 on GPU), AdamW
    (torch's; fused on CUDA), and ``gc.collect(1)`` (``gen1_gc_interval: 1``). Original: ``zero_grad``, copy to
    the device, forward to the logits, the loss its trainer computes (``logits[:, :-1]`` made contiguous,
    cross entropy against the next tokens; averaged over those labels, as ours is), backward, its AdamW
    (``olmo.optim.AdamW``, which is torch's AdamW step here; foreach on CUDA), and ``gc.collect(1)`` (its
    ``gen1_gc_interval: 1``). Both use AdamW with OLMo-1B's hyperparameters on the same batches from the same
    weights, so the two loss curves are printed side by side.

Reported per side: the median and the minimum over rounds, and tokens/s at the median. The comparison is the
ratio of step times ours / original (below 1: ours is faster) of the medians, of the minima, and of each round's
pair of samples (median and range). ``--profile a|b`` then runs ``torch.profiler`` over ``--iters`` steps of that
measurement on each side and prints the ops with the most time of their own. ``--ours-only`` (no original
virtualenv needed, as in CI) runs our side alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from itertools import cycle
from pathlib import Path
from typing import Any, Optional

import torch

from olmo.bench.olmo_worker import AUTOCAST_DTYPES, Side, serve
from olmo.bench.scripts import sibling_script
from olmo.exceptions import OLMoError
from olmo.util import machine_info

log = logging.getLogger("benchmark_olmo")

OLMO_PYTHON = ".venv-olmo/bin/python"
"""The original's python as ``make olmo-env`` installs it in the checkout, relative to the working directory: run the
benchmark from the checkout, or pass ``--olmo-python``."""
FLOAT32_MATMUL_PRECISION = "high"  # our TrainConfig's default; set on both sides
SEED = 6198
OPTIMIZER = {"name": "adamw", "learning_rate": 4.0e-4, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1.0e-5}
"""OLMo-1B's AdamW settings, on both sides."""
MEASUREMENTS = {
    "a": "forward+backward, plain cross entropy (same code on both sides)",
    "b": "training step: ours Trainer.train_step (fused loss) vs original forward+backward+AdamW",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_olmo.py", description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, help="attention heads (default: d_model / 64, OLMo's head size)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per instance")
    parser.add_argument("--batch", type=int, default=4, help="instances per step (one micro-batch)")
    parser.add_argument(
        "--vocab", type=int, default=50304, help="vocab_size; the embedding is padded to a multiple of 128"
    )
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds per side and measurement")
    parser.add_argument("--iters", type=int, default=3, help="steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side before each measurement")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument(
        "--dtype", choices=sorted(AUTOCAST_DTYPES), default="fp32", help="bf16: autocast (CUDA only)"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads on each side")
    parser.add_argument("--olmo-python", default=OLMO_PYTHON, help="python of the original's virtualenv")
    parser.add_argument("--ours-only", action="store_true", help="time ours alone (no original needed)")
    parser.add_argument("--profile", choices=["a", "b"], help="afterwards, profile this measurement on each side")
    parser.add_argument("--json", help="write the report as JSON to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.n_heads = args.n_heads or max(1, args.d_model // 64)
    if args.d_model % args.n_heads:
        parser.error(f"--d-model {args.d_model} is not a multiple of --n-heads {args.n_heads}")
    if args.dtype == "bf16" and args.device != "cuda":
        parser.error("--dtype bf16 is CUDA autocast; use --device cuda, or --dtype fp32 on CPU")
    if min(args.rounds, args.iters, args.threads) < 1 or args.warmup < 0 or args.seq < 2:
        parser.error("--rounds, --iters and --threads must be >= 1, --warmup >= 0 and --seq >= 2")
    args.olmo_python = os.path.abspath(args.olmo_python)  # the worker starts elsewhere; a venv's python is a link
    if not args.ours_only and not Path(args.olmo_python).is_file():
        parser.error(
            f"{args.olmo_python} does not exist: run `make olmo-env` (the default is its .venv-olmo in the working "
            f"directory), pass --olmo-python, or use --ours-only"
        )
    return args


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The model config, in the field names both implementations share."""
    return {
        "d_model": args.d_model,
        "n_heads": args.n_heads,
        "n_layers": args.n_layers,
        "mlp_ratio": 8,
        "activation_type": "swiglu",
        "block_type": "sequential",
        "rope": True,
        "alibi": False,
        "flash_attention": False,
        "attention_dropout": 0.0,
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
        "include_bias": False,
        "layer_norm_type": "default",
        "layer_norm_with_affine": False,
        "bias_for_layer_norm": False,
        "attention_layer_norm": False,
        "weight_tying": True,
        "init_fn": "mitchell",
        "max_sequence_length": args.seq,
        "vocab_size": args.vocab,
        "embedding_size": -(-args.vocab // 128) * 128,
        "eos_token_id": args.vocab - 1,
        "pad_token_id": 1,
    }


# ---------------------------------------------------------------------------------------------- our worker
class OursSide(Side):
    """Our side: the model, optimizer and :class:`olmo.train.Trainer` as ``scripts/benchmark.py`` builds them."""

    def build(self, request: dict[str, Any]) -> dict[str, Any]:
        # Imported in the worker only: the driver never needs the trainer.
        from olmo.bench.common import SyntheticBatches
        from olmo.bench.train_step import git_state
        from olmo.config import TrainConfig
        from olmo.data import DataContext
        from olmo.distributed import DistEnv, ParallelizeOptions, ParallelLayout, build_model
        from olmo.optim import build_optimizer, build_scheduler
        from olmo.train import Trainer
        from olmo.train.build_module import build_train_module
        from olmo.util.rng import seed_all

        batch, seq = request["batch"], request["model"]["max_sequence_length"]
        cfg = TrainConfig.from_dict(
            {
                "seed": SEED,
                "model": request["model"],
                "optimizer": request["optimizer"],
                "scheduler": {"name": "constant"},
                "global_train_batch_size": batch,
                "device_train_microbatch_size": batch,
                "precision": {"fp32": "fp32", "bf16": "amp_bf16"}[request["dtype"]],
                "float32_matmul_precision": request["float32_matmul_precision"],
                "fused_loss": True,
                "data": {"paths": None, "datasets": None},
                "evaluators": [],
                "wandb": None,
            }
        )
        cfg.validate(1)
        env = DistEnv(self.device, rank=0, local_rank=0, world_size=1, local_world_size=1)
        seed_all(cfg.seed)
        layout = ParallelLayout.of_run(cfg, env)
        self.model = model = build_model(cfg.model, layout, ParallelizeOptions.from_train_config(cfg))
        optimizer = build_optimizer(cfg.optimizer, model)
        context = DataContext.from_train_config(cfg)
        loader: Any = SyntheticBatches(cfg.model, cfg.data, context, layout, n_steps=4)  # 4 batches, cycled
        train_module = build_train_module(cfg, env, model, optimizer, build_scheduler(cfg.scheduler))
        self.trainer = Trainer(cfg, env, train_module, loader, layout=layout)
        self.train_batches = cycle(loader.batches)
        gen = torch.Generator().manual_seed(cfg.seed)
        input_ids = torch.randint(0, cfg.model.vocab_size, (batch, seq), generator=gen)  # (B, T)
        targets = torch.randint(0, cfg.model.vocab_size, (batch, seq), generator=gen)  # (B, T)
        self.input_ids, self.targets = input_ids.to(self.device), targets.to(self.device)
        shared = {
            "model": {k: v.cpu() for k, v in model.state_dict().items()},
            "input_ids": input_ids,
            "targets": targets,
            "train_batches": [b["input_ids"].cpu() for b in loader.batches],
        }
        torch.save(shared, request["exchange_file"])
        return {
            "git": git_state(),
            "n_params": model.num_params(),
            "flops_per_token": model.num_flops_per_token(),
            "optimizer": type(optimizer).__module__ + "." + type(optimizer).__name__,
            "optimizer_fused": bool(optimizer.defaults.get("fused")),
        }

    def train_step(self) -> Any:
        return self.trainer.step(next(self.train_batches))

    def finish_train_steps(self) -> None:
        self.trainer.collect_metrics()  # every 10 steps on GPU, so some may still be queued

    def loss_value(self, result: Any) -> float:
        if isinstance(result, torch.Tensor):
            return result.item()
        return result.values["train/CrossEntropyLoss"]  # a StepMetrics, read back by now


# ---------------------------------------------------------------------------------------------- the driver
class Worker:
    """One worker process and its line protocol; its stderr goes to ``log_path``."""

    def __init__(self, name: str, cmd: list[str], cwd: Path, env: dict[str, str], log_path: Path):
        self.name, self.log_path = name, log_path
        with open(log_path, "w") as log_file:
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True
            )

    def ask(self, cmd: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            tail = "".join(self.log_path.read_text().splitlines(keepends=True)[-30:])
            raise OLMoError(
                f"The {self.name} worker exited (code {self.proc.wait()}) during '{cmd}'; its log:\n{tail}"
            )
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise OLMoError(f"The {self.name} worker failed during '{cmd}':\n{reply['error']}")
        return reply

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def start_workers(args: argparse.Namespace, work_dir: Path) -> list[Worker]:
    """Ours, then (unless ``--ours-only``) the original; both start importing at once."""
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    ours = [sys.executable, str(sibling_script("benchmark_olmo.py")), "--worker"]
    workers = [Worker("ours", ours, Path.cwd(), env, work_dir / "ours.log")]
    if not args.ours_only:
        # -I and a cwd outside the repository: `import olmo` must find the original, never ours.
        cmd = [args.olmo_python, "-I", str(sibling_script("olmo_original_worker.py"))]
        workers.append(Worker("original", cmd, work_dir, env, work_dir / "original.log"))
    return workers


def compare_outputs(ours_path: Path, original_path: Path) -> dict[str, Any]:
    """Bit-identity of the logits, the loss and every gradient of one plain-loss step on the same batch."""
    ours, orig = torch.load(ours_path, weights_only=True), torch.load(original_path, weights_only=True)
    names = sorted(set(ours["grads"]) | set(orig["grads"]))
    differing = [
        n
        for n in names
        if n not in ours["grads"] or n not in orig["grads"] or not torch.equal(ours["grads"][n], orig["grads"][n])
    ]
    common = [n for n in names if n in ours["grads"] and n in orig["grads"]]
    return {
        "logits_equal": torch.equal(ours["logits"], orig["logits"]),
        "logits_max_abs_diff": (ours["logits"].float() - orig["logits"].float()).abs().max().item(),
        "loss_equal": torch.equal(ours["loss"], orig["loss"]),
        "loss": {"ours": ours["loss"].item(), "original": orig["loss"].item()},
        "grads_equal": not differing,
        "grads_max_abs_diff": max(
            ((ours["grads"][n] - orig["grads"][n]).abs().max().item() for n in common), default=0.0
        ),
        "grads_differing": differing,
    }


def measure(workers: list[Worker], mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up each side, then ``--rounds`` rounds, alternating which side goes first."""
    if args.warmup:
        for worker in workers:
            worker.ask("round", mode=mode, iters=args.warmup)
    seconds: dict[str, list[float]] = {w.name: [] for w in workers}
    losses: dict[str, list[float]] = {w.name: [] for w in workers}
    for r in range(args.rounds):
        for worker in workers if r % 2 == 0 else workers[::-1]:
            reply = worker.ask("round", mode=mode, iters=args.iters)
            seconds[worker.name].append(reply["seconds"])
            losses[worker.name].append(reply["loss"])
        log.info(
            "(%s) round %d/%d: %s",
            mode,
            r + 1,
            args.rounds,
            ", ".join(
                f"{name} {s[-1] * 1e3:,.1f} ms/step (loss {losses[name][-1]:.4f})" for name, s in seconds.items()
            ),
        )
    return summarize(seconds, losses, args.batch * args.seq)


def summarize(seconds: dict[str, list[float]], losses: dict[str, list[float]], tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        name: {
            "median_s": statistics.median(s),
            "min_s": min(s),
            "tokens_per_s": tokens / statistics.median(s),
            "rounds_s": s,
            "loss_after_round": losses[name],
        }
        for name, s in seconds.items()
    }
    if "original" in seconds:
        ours, orig = seconds["ours"], seconds["original"]
        paired = [a / b for a, b in zip(ours, orig)]
        out["ours_over_original"] = {
            "median": statistics.median(ours) / statistics.median(orig),
            "min": min(ours) / min(orig),
            "paired_median": statistics.median(paired),
            "paired_range": [min(paired), max(paired)],
            "rounds_ours_faster": sum(p < 1 for p in paired),
        }
    return out


def markdown_table(results: dict[str, Any]) -> str:
    """The results as Markdown rows, ready for RESEARCH_LOG.md."""

    def cell(side: Optional[dict[str, Any]]) -> str:
        if side is None:
            return "–"
        return f"{side['median_s'] * 1e3:,.1f} ms ({side['min_s'] * 1e3:,.1f}); {side['tokens_per_s']:,.0f} tok/s"

    rows = [
        "| measurement | ours: median (min); tokens/s | original: median (min); tokens/s "
        "| ours / original: medians, minima; per round median [range], rounds ours faster |",
        "|---|---|---|---|",
    ]
    for mode, r in results.items():
        ratio = r.get("ours_over_original")
        compared = "–"
        if ratio is not None:
            lo, hi = ratio["paired_range"]
            n = len(r["ours"]["rounds_s"])
            compared = (
                f"{ratio['median']:.3f}, {ratio['min']:.3f}; {ratio['paired_median']:.3f} [{lo:.3f}–{hi:.3f}], "
                f"{ratio['rounds_ours_faster']}/{n}"
            )
        rows.append(
            f"| ({mode}) {MEASUREMENTS[mode]} | {cell(r['ours'])} | {cell(r.get('original'))} | {compared} |"
        )
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        serve(OursSide().handlers())
        return 0
    machine = machine_info()  # its load average is taken now, before the benchmark loads the CPUs
    setup = {
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "float32_matmul_precision": FLOAT32_MATMUL_PRECISION,
        "batch": args.batch,
        "model": model_fields(args),
        "optimizer": OPTIMIZER,
    }
    with tempfile.TemporaryDirectory(prefix="olmo-benchmark-olmo-") as tmp:
        work_dir = Path(tmp)
        workers = start_workers(args, work_dir)
        try:
            exchange = str(work_dir / "ours_state.pt")
            sides = {w.name: w.ask("setup", **setup, exchange_file=exchange) for w in workers}
            log.info("Setup: %s", json.dumps(sides))
            identity = None
            if not args.ours_only:
                for w in workers:
                    w.ask("check", path=str(work_dir / f"{w.name}_check.pt"))
                identity = compare_outputs(work_dir / "ours_check.pt", work_dir / "original_check.pt")
                log.info("Bit identity (one plain-loss step, same weights and batch): %s", json.dumps(identity))
            results = {mode: measure(workers, mode, args) for mode in MEASUREMENTS}
            profiles = {}
            if args.profile:
                profiles = {
                    w.name: w.ask("profile", mode=args.profile, iters=args.iters)["table"] for w in workers
                }
        finally:
            for w in workers:
                w.close()
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "machine": {**machine, "load_average_1_5_15min_at_end": [round(x, 2) for x in os.getloadavg()]},
        "setup": {
            **setup,
            "seq": args.seq,
            "rounds": args.rounds,
            "iters": args.iters,
            "warmup": args.warmup,
            "profile": args.profile,
        },
        "implementations": sides,
        "measurements": MEASUREMENTS,
        "bit_identity": identity,
        "results": results,
        "profiles": profiles,
        "markdown": markdown_table(results),
    }
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        log.info("Wrote %s", args.json)
    return 0


def print_report(report: dict[str, Any]) -> None:
    for side, table in report["profiles"].items():
        print(f"\nProfile of ({report['setup']['profile']}) on the {side} side:\n{table}")
    identity = report["bit_identity"]
    if identity is not None:
        print(
            f"\nBit identity on the same weights and batch: logits {'equal' if identity['logits_equal'] else 'DIFFER'} "
            f"(max |diff| {identity['logits_max_abs_diff']:.3g}), loss {'equal' if identity['loss_equal'] else 'DIFFERS'}, "
            f"gradients {'equal' if identity['grads_equal'] else 'DIFFER'} (max |diff| {identity['grads_max_abs_diff']:.3g})"
        )
    s, m = report["setup"], report["setup"]["model"]
    print(
        f"\n{m['n_layers']} layers, d_model {m['d_model']}, {m['n_heads']} heads, vocab {m['vocab_size']}, "
        f"B={s['batch']} x T={s['seq']}, {s['dtype']} on {s['device']} ({s['threads']} threads); "
        f"{s['rounds']} rounds of {s['iters']} steps per side after {s['warmup']} warmup steps\n"
    )
    print(report["markdown"])
