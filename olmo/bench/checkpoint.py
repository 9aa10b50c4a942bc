"""Measure checkpoint size, save/load time and throughput for a model built from a config, on the CPU.

    python scripts/benchmark_checkpoint.py [CONFIG] [--repeats 3] [--steps-between 0] [--out results.json]
        [--folder DIR] [--override key=value ...] [--smoke]

CONFIG defaults to configs/official/OLMo-300M.yaml. One optimizer step on a small random batch gives the
optimizer its full state (two AdamW moments per parameter) before anything is measured. Every repeat saves and reloads a sharded (DCP) and an
unsharded (torch.save) checkpoint through ``olmo.checkpoint.save_checkpoint`` / ``load_checkpoint``, exactly
as the trainer does (including the fsync of every file and the atomic commit), then writes every state tensor
once (what the first optimizer step after a restart does: a load that left the state in a lazily copied memory map
pays for it there), then deletes them. As a
separate, raw measurement it also times ``torch.distributed.checkpoint.async_save`` of the same state (the
trainer does not offer asynchronous saves yet): how long it blocks the caller (staging a copy of the state)
and when the write is done, once with torch's default of new staging buffers per save and once with a
stager that keeps its buffers between saves. A 1 GiB write + fsync gives the disk's own speed.

Throughput is the in-memory state (model + optimizer tensors) in GB (1e9 bytes) per second. The page cache
is not dropped, so loads right after a save mostly read from RAM, not the disk. ``--smoke`` shrinks the
model (1 layer, d_model 256) for a quick check that the script works.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from olmo.checkpoint import inspect_checkpoint, load_checkpoint, save_checkpoint
from olmo.checkpoint.config_record import ConfigRecord
from olmo.config import TrainConfig
from olmo.distributed import DistEnv, ParallelizeOptions, ParallelLayout, build_model
from olmo.optim import build_optimizer
from olmo.util import machine_info

log = logging.getLogger("benchmark_checkpoint")

DEFAULT_CONFIG = "configs/official/OLMo-300M.yaml"
"""Relative to the working directory, as every config path: run the benchmark from the checkout."""
SMOKE_OVERRIDES = ["model.n_layers=1", "model.d_model=256"]
PAGE_CACHE_NOTE = "The page cache is not dropped: loads right after a save read mostly from RAM."
ASYNC_NOTE = (
    "Async rows: a raw torch.distributed.checkpoint.async_save of the same state into its own directory "
    "(the trainer's save_async takes the kept-buffers path, then commits with the marker protocol)."
)
RAW_WRITE_BYTES = 2**30


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_checkpoint.py", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="model/optimizer config (YAML)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per kind; medians are reported")
    parser.add_argument(
        "--steps-between",
        type=int,
        default=0,
        help="optimizer steps between repeats, so each save writes new values",
    )
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument(
        "--folder", help="where to create the temporary checkpoint folder (default: the system temp)"
    )
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument(
        "--smoke", action="store_true", help=f"quick check: also apply {' '.join(SMOKE_OVERRIDES)}"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps_between < 0:
        parser.error("--repeats must be >= 1 and --steps-between >= 0")
    return args


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, vocab_size: int) -> None:
    """One step on a small random batch, so every parameter has its full optimizer state."""
    input_ids = torch.randint(0, vocab_size, (1, 16))
    model(input_ids).logits.float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a sharded save hands to DCP (views of the live tensors, no copies)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors in a (nested) state dict."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


@torch.no_grad()
def write_every_state_tensor(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write every parameter and optimizer-state tensor once (``add_(0)``), as the first optimizer step after a load
    does: a load that left the state in a lazily copied memory map pays for it here."""
    for p in model.parameters():
        p.add_(0)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim():
                value.add_(0)


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(seconds, result) of ``fn(*args, **kwargs)``."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def raw_write_seconds(folder: Path, n_bytes: int) -> float:
    """Write ``n_bytes`` to a new file and fsync it: the disk's own write speed, as a baseline."""
    chunk = np.ones(64 * 2**20, dtype=np.uint8)
    path = folder / "raw-write.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n_bytes // chunk.nbytes):
            f.write(chunk.data)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def async_save_seconds(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, stager: Optional[DefaultStager]
) -> tuple[float, float]:
    """(blocking, total) seconds of a raw DCP ``async_save`` of the trainer's sharded state dict.

    :param stager: None stages into new buffers (torch's default); a stager that has staged this state
        before copies into the buffers it keeps, as a trainer holding on to its stager would.
    """
    state = sharded_state_dict(model, optimizer)
    start = time.perf_counter()
    response = dcp.async_save(state, checkpoint_id=str(folder), async_stager=stager)
    blocking = time.perf_counter() - start
    # With an asynchronous stager torch returns both futures; the write is done when the upload is.
    upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
    upload.result()
    total = time.perf_counter() - start
    shutil.rmtree(folder)
    return blocking, total


def run_repeat(
    root: Path,
    step: int,
    config: ConfigRecord,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stager: DefaultStager,
) -> tuple[dict[str, float], dict[str, int]]:
    """One save + load of each checkpoint kind, then the raw async saves; returns seconds and bytes on disk.

    :param config: the run's config, each checkpoint's ``config.yaml``.
    :param stager: a stager that has already staged this state once (its buffers are allocated).
    """
    seconds: dict[str, float] = {}
    on_disk: dict[str, int] = {}
    train_state = {"format_version": 1, "global_step": step, "world_size": 1, "rng": {0: torch.get_rng_state()}}
    for kind, sharded in (("sharded", True), ("unsharded", False)):
        seconds[f"save {kind}"], path = timed(
            save_checkpoint, root, step, model, optimizer, train_state, config, sharded=sharded
        )
        on_disk[kind] = disk_bytes(path)
        info = inspect_checkpoint(str(path))
        seconds[f"load {kind}"], _ = timed(load_checkpoint, info, model, optimizer)
        seconds[f"write {kind}"], _ = timed(write_every_state_tensor, model, optimizer)
        shutil.rmtree(path)
        gc.collect()
        log.info(
            "  %-9s save %.2f s, load %.2f s, then a first write %.2f s",
            kind,
            seconds[f"save {kind}"],
            seconds[f"load {kind}"],
            seconds[f"write {kind}"],
        )
    try:
        for kind, kind_stager in (("async", None), ("async reused", stager)):
            blocking, total = async_save_seconds(root / "async", model, optimizer, kind_stager)
            seconds[f"{kind} blocking"], seconds[f"{kind} total"] = blocking, total
            log.info("  %-12s blocking %.2f s, total %.2f s", kind, blocking, total)
            gc.collect()
    except Exception as e:  # async_save is experimental in torch; keep the other numbers if it breaks
        log.warning("dcp.async_save failed (%s: %s); no async numbers.", type(e).__name__, e)
    return seconds, on_disk


ROWS = [
    ("save sharded", "sync save, sharded (DCP)", "blocks the caller throughout"),
    ("load sharded", "load, sharded (DCP)", "page cache warm"),
    ("write sharded", "first write of the state after it", "part of the first step after a restart"),
    ("save unsharded", "sync save, unsharded (torch.save)", "blocks the caller throughout"),
    ("load unsharded", "load, unsharded (torch.load)", "page cache warm"),
    ("write unsharded", "first write of the state after it", "part of the first step after a restart"),
    ("async blocking", "async_save, new staging buffers: blocking", "raw DCP (torch default)"),
    ("async total", "async_save, new staging buffers: until written", "raw DCP (torch default)"),
    ("async reused blocking", "async_save, kept staging buffers: blocking", "what save_async blocks"),
    ("async reused total", "async_save, kept staging buffers: until written", "raw DCP write"),
    ("raw write", "raw disk write + fsync (1 GiB)", "baseline: the disk itself"),
]


def summarize(runs: list[dict[str, float]], raw_write: list[float], state_bytes: int) -> dict[str, Any]:
    """Median seconds and GB/s per measurement, in the order of :data:`ROWS`."""
    results = {}
    for key, label, note in ROWS:
        values = raw_write if key == "raw write" else [r[key] for r in runs if key in r]
        if not values:
            continue
        n_bytes = RAW_WRITE_BYTES if key == "raw write" else state_bytes
        median = statistics.median(values)
        results[key] = {
            "label": label,
            "median_s": round(median, 3),
            "gb_per_s": round(n_bytes / 1e9 / median, 3),
            "bytes": n_bytes,
            "runs_s": [round(v, 3) for v in values],
            "note": note,
        }
    return results


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    sizes = report["state_bytes"]
    table = Table(
        title=(
            f"Checkpoint benchmark: {report['n_params'] / 1e6:.0f}M params, state {sizes['total'] / 1e9:.2f} GB "
            f"(model {sizes['model'] / 1e9:.2f} + optimizer {sizes['optimizer'] / 1e9:.2f}), "
            f"median of {report['repeats']}"
        )
    )
    for column, justify in (
        ("measurement", "left"),
        ("median s", "right"),
        ("GB/s", "right"),
        ("runs (s)", "left"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    table.add_column("note")
    for r in report["results"].values():
        runs = ", ".join(f"{v:.2f}" for v in r["runs_s"])
        table.add_row(r["label"], f"{r['median_s']:.2f}", f"{r['gb_per_s']:.2f}", runs, r["note"])
    table.caption = " ".join(report["notes"])
    # Piped into a log, rich would wrap at 80 columns; keep each measurement on one line there.
    Console(width=None if sys.stdout.isatty() else 150).print(table)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    machine = machine_info()
    # Compiling would only add start-up time; checkpoints do not depend on it.
    overrides = [*(SMOKE_OVERRIDES if args.smoke else []), *args.override, "compile=null"]
    cfg = TrainConfig.load(args.config, overrides)
    torch.manual_seed(cfg.seed)
    cpu = DistEnv(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)
    model = build_model(cfg.model, ParallelLayout.of_run(cfg, cpu), ParallelizeOptions.from_train_config(cfg))
    optimizer = build_optimizer(cfg.optimizer, model)
    optimizer_step(model, optimizer, cfg.model.vocab_size)
    state = sharded_state_dict(model, optimizer)
    state_bytes = {"model": tensor_bytes(state["model"]), "optimizer": tensor_bytes(state["optim"])}
    state_bytes["total"] = state_bytes["model"] + state_bytes["optimizer"]
    del state
    n_params = sum(p.numel() for p in model.parameters())
    log.info("Model: %s parameters; checkpointed state %.2f GB.", f"{n_params:,}", state_bytes["total"] / 1e9)

    # The kept stager allocates its buffers here, untimed, as a trainer's stager would on its first save.
    stager = DefaultStager(StagingOptions(False, False, False, False))  # no pinned/shared memory, no thread
    stager.stage(sharded_state_dict(model, optimizer))
    root = Path(tempfile.mkdtemp(prefix="olmo-checkpoint-benchmark-", dir=args.folder))
    log.info("Writing checkpoints under %s; each is deleted once measured. %s", root, PAGE_CACHE_NOTE)
    runs: list[dict[str, float]] = []
    raw_write: list[float] = []
    on_disk: dict[str, int] = {}
    try:
        for repeat in range(args.repeats):
            if repeat > 0:
                for _ in range(args.steps_between):
                    optimizer_step(model, optimizer, cfg.model.vocab_size)
            log.info("Repeat %d of %d:", repeat + 1, args.repeats)
            seconds, on_disk = run_repeat(root, repeat + 1, cfg, model, optimizer, stager)
            runs.append(seconds)
            raw_write.append(raw_write_seconds(root, RAW_WRITE_BYTES))
    finally:
        stager.close()
        shutil.rmtree(root, ignore_errors=True)

    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "machine": machine,
        "config": args.config,
        "overrides": overrides,
        "n_params": n_params,
        "state_bytes": state_bytes,
        "checkpoint_bytes_on_disk": on_disk,
        "repeats": args.repeats,
        "steps_between": args.steps_between,
        "folder": str(Path(args.folder or tempfile.gettempdir()).resolve()),
        "notes": [
            "GB = 1e9 bytes; GB/s = in-memory state (model + optimizer tensors) / median seconds.",
            "Saves go through olmo.checkpoint.save_checkpoint (fsync of every file, marker, atomic rename).",
            PAGE_CACHE_NOTE,
            ASYNC_NOTE,
        ],
        "results": summarize(runs, raw_write, state_bytes["total"]),
    }
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        log.info("Wrote %s", args.out)
    return 0
