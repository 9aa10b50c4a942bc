"""The remote case of ``scripts/benchmark_dataloader.py --remote``: token files served over HTTP, read in place.

The files are served by :mod:`olmo.testing.http` in a process of its own (so that it does not share the loader's
CPU time), with ``--latency`` seconds added to every answer (default 50 ms, a distant object store). Measured:

1. the loader's throughput over the URLs (``build_train_dataloader``, the trainer's loader), next to the rows of
   the same corpus read locally, and the bytes fetched per byte of instances delivered;
2. the time from launching ``scripts/train.py`` (the quickstart model, ``configs/tiny/OLMo-tiny.yaml``) to the
   end of its first step over N remote files (``--startup-files``): a first launch, and a relaunch that resumes
   from a checkpoint (its record of the files saves the header reads), each next to the same files local;
3. ``throughput/data_wait_seconds`` of a short run of the quickstart model (``--wait-steps``) on the remote files
   and on the same files local.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from olmo.bench.scripts import sibling_script
from olmo.config import DataConfig, ModelConfig, TrainConfig
from olmo.data import DataContext, IterableDataset, build_train_loader

QUICKSTART_CONFIG = Path("configs/tiny/OLMo-tiny.yaml")
"""The quickstart model's config, in the checkout the benchmark is run from."""


def serve(folder: Path, latency: float) -> tuple[subprocess.Popen, str]:
    """Serve ``folder`` from a new process; the process and the base URL."""
    cmd = [sys.executable, "-m", "olmo.testing.http", str(folder), "--latency", str(latency)]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    port = int(process.stdout.readline())
    return process, f"http://127.0.0.1:{port}"


def loader_row(
    data: DataConfig,
    model: ModelConfig,
    context: DataContext,
    work_dir: Path,
    warmup: int,
    steps: int,
    repeats: int,
    time_batches: Callable,
    summarize: Callable,
) -> dict[str, Any]:
    """Throughput of the loader over the (remote) files of ``data``, and what it fetched per byte delivered."""
    loader = build_train_loader(data, model, context, work_dir=work_dir)
    order = loader.dataset
    assert isinstance(order, IterableDataset)
    stats = order.dataset.fetch_stats  # type: ignore[attr-defined]
    before = stats.snapshot()["bytes"]
    order.stop_index = (
        warmup + steps
    ) * context.global_train_batch_size  # what each run draws: nothing fetched past it
    runs = [time_batches(iter(loader), warmup, steps) for _ in range(repeats)]
    tokens_per_batch = context.global_train_batch_size * model.max_sequence_length
    row = summarize(runs, tokens_per_batch, data.num_workers)
    delivered = repeats * (warmup + steps) * tokens_per_batch * np.dtype(data.memmap_dtype).itemsize
    row["bytes_fetched_per_byte_delivered"] = round((stats.snapshot()["bytes"] - before) / delivered, 4)
    return row


def split_corpus(tokens: np.ndarray, folder: Path, files: int, tokens_per_file: int) -> list[str]:
    """``files`` token files of ``tokens_per_file`` tokens each, cut from ``tokens`` (repeated as needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(files):
        start = (i * tokens_per_file) % max(1, len(tokens) - tokens_per_file)
        name = f"part-{i:05d}.npy"
        np.asarray(tokens[start : start + tokens_per_file], dtype=np.uint16).tofile(folder / name)
        names.append(name)
    return names


def quickstart_config(path: Path, save_folder: Path, paths: list[str], max_duration: int, **more: Any) -> Path:
    """The quickstart model on ``paths``, without evaluators, saving a checkpoint at step 1."""
    overrides = [
        f"save_folder={save_folder}",
        "data.paths=[set-below.npy]",  # the quickstart's glob needs its data; these runs bring their own
        f"max_duration={max_duration}",
        "evaluators=[]",
        "save_interval_unsharded=1",
        "save_num_unsharded_checkpoints_to_keep=1",
        "wandb=null",
        "console_log_interval=1000",
        *(f"{k}={v}" for k, v in more.items()),
    ]
    cfg = TrainConfig.load(QUICKSTART_CONFIG, overrides)
    cfg.data.paths = paths
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg.save(path)
    return path


def run_train(config: Path, *args: str) -> tuple[float, Path]:
    """``python scripts/train.py CONFIG ARGS``: seconds from the launch to the first metrics line, and the run."""
    cfg = TrainConfig.load(config)
    metrics = Path(cfg.save_folder) / "metrics.jsonl"
    lines_before = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    env = {**os.environ, "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    cmd = [sys.executable, str(sibling_script("train.py")), str(config), *args]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    while process.poll() is None:
        if first is None and metrics.is_file() and len(metrics.read_text().splitlines()) > lines_before:
            first = time.perf_counter() - start
        time.sleep(0.02)
    output = process.stdout.read() if process.stdout else ""
    if process.returncode != 0 or first is None:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {process.returncode}):\n{output[-4000:]}")
    return round(first, 2), Path(cfg.save_folder)


def startup_rows(tokens: np.ndarray, root: Path, base_url: str, data: Path, files: int) -> dict[str, Any]:
    """Seconds to the end of the first step with ``files`` files, remote and local, first launch and relaunch."""
    names = split_corpus(tokens, data / f"startup-{files}", files, 2**15)
    out: dict[str, Any] = {}
    for where, prefix in (("remote", f"{base_url}/startup-{files}"), ("local", str(data / f"startup-{files}"))):
        config = quickstart_config(
            root / f"startup-{files}-{where}.yaml",
            root / f"startup-{files}-{where}",
            [f"{prefix}/{n}" for n in names],
            2,
        )
        first, run = run_train(config, "--stop_at=1")
        again, _ = run_train(config, "--try_load_latest_save")
        out[where] = {"first_launch_s": first, "relaunch_s": again}
        if where == "remote":
            last = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
            out[where]["first_launch_requests"] = last.get("throughput/data_requests")
    return out


def data_wait_rows(tokens: np.ndarray, root: Path, base_url: str, data: Path, steps: int) -> dict[str, Any]:
    """Mean ``throughput/data_wait_seconds`` (steps 2 on) of the quickstart model on 10 files, remote and local."""
    names = split_corpus(tokens, data / "wait", 10, 2**20)
    out: dict[str, Any] = {}
    for where, prefix in (("remote", f"{base_url}/wait"), ("local", str(data / "wait"))):
        config = quickstart_config(
            root / f"wait-{where}.yaml",
            root / f"wait-{where}",
            [f"{prefix}/{n}" for n in names],
            steps,
            save_interval_unsharded="null",
        )
        run_train(config)
        metrics = [json.loads(line) for line in (root / f"wait-{where}/metrics.jsonl").read_text().splitlines()]
        waits = [m["throughput/data_wait_seconds"] for m in metrics[1:] if "throughput/data_wait_seconds" in m]
        out[where] = {
            "data_wait_s_mean": round(statistics.fmean(waits), 6),
            "data_wait_s_max": round(max(waits), 6),
            "tokens_per_s": round(metrics[-1]["throughput/device/tokens_per_second"]),
            "bytes_fetched": metrics[-1].get("throughput/data_bytes_fetched"),
        }
    return out
