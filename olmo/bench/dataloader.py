"""Measure the training data loader's throughput (tokens/s) from a warm page cache, on the CPU.

    python scripts/benchmark_dataloader.py [CONFIG] [--steps 2000] [--warmup 20] [--repeats 3] [--workers 0,2]
        [--batch 8] [--seq-len 2048] [--corpus-tokens 50000000] [--folder DIR] [--out result.json] [--profile]
        [--remote [--latency 0.05] [--remote-steps 300] [--startup-files 10,1000] [--wait-steps 100]]

CONFIG (default configs/official/OLMo-1B.yaml) supplies the data settings (memmap dtype, pin_memory,
prefetch_factor, pad direction, ...). Its data.paths are replaced by a generated corpus: real text (the
Python standard library's source as byte-level tokens, as in ``olmo.testing.write_byte_memmap``) repeated to
``--corpus-tokens`` tokens in one headerless uint16 memmap, read once so the page cache holds it, and deleted
at the end. Batches of ``--batch`` instances of ``--seq-len`` tokens come from
``olmo.data.build_train_dataloader``, exactly the loader the trainer iterates, once per ``--workers`` value.
Each of ``--repeats`` runs starts a new iterator, draws ``--warmup`` batches (worker start-up, prefetch), then
times ``--steps`` batches; tokens/s is the median over the runs, the batch-time percentiles pool all of them.

For reference it also times the cheapest way to make the same batches: gathering the same instances with numpy
from the same memmap into one int64 tensor per batch. The gap between the two is the loader's own overhead.
``--profile`` prints where the single-process loader spends its time.

``--remote`` adds the remote case (:mod:`olmo.bench.dataloader_remote`): the same corpus served over HTTP
with ``--latency`` seconds per request, read by the same loader (``--remote-steps`` batches a run); the time to
the first training step with each of ``--startup-files`` remote files, first launch and relaunch; and the data
wait of a ``--wait-steps`` run of the quickstart model. Each next to the same files read locally.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from olmo.config import TrainConfig
from olmo.data import DataContext, IterableDataset, build_train_dataloader
from olmo.testing import BYTE_EOS, stdlib_documents
from olmo.util import machine_info

log = logging.getLogger("benchmark_dataloader")

DEFAULT_CONFIG = "configs/official/OLMo-1B.yaml"
"""Relative to the working directory, as every config path: run the benchmark from the checkout."""
GOAL_TOKENS_PER_S = 50e6
GOAL_REMOTE_TOKENS_PER_S = 1e6
"""Remote rows: one loader process delivers at least this over a 50 ms link (issue 23)."""
NUMPY_GATHER = "numpy gather"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_dataloader.py", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="training config (YAML)")
    parser.add_argument("--steps", type=int, default=2000, help="batches timed per run")
    parser.add_argument("--warmup", type=int, default=20, help="batches drawn before timing starts")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported")
    parser.add_argument("--workers", default="0,2", help="comma-separated data.num_workers values to measure")
    parser.add_argument("--batch", type=int, default=8, help="instances per batch (the device batch)")
    parser.add_argument(
        "--seq-len", type=int, default=2048, help="tokens per instance (model.max_sequence_length)"
    )
    parser.add_argument("--corpus-tokens", type=int, default=50_000_000, help="size of the generated corpus")
    parser.add_argument("--folder", help="where to create the temporary corpus (default: the system temp)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--profile", action="store_true", help="profile the single-process loader (cProfile)")
    parser.add_argument("--remote", action="store_true", help="also measure the corpus read over HTTP")
    parser.add_argument("--latency", type=float, default=0.05, help="seconds the HTTP server adds to each answer")
    parser.add_argument("--remote-steps", type=int, default=300, help="batches timed per remote run")
    parser.add_argument("--startup-files", default="10,1000", help="remote file counts for the start-up times")
    parser.add_argument("--wait-steps", type=int, default=100, help="steps of the data-wait runs")
    args = parser.parse_args(argv)
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers takes comma-separated integers, e.g. 0,2; got {args.workers!r}")
    try:
        args.startup_files = [int(n) for n in args.startup_files.split(",") if n]
    except ValueError:
        parser.error(f"--startup-files takes comma-separated integers, e.g. 10,1000; got {args.startup_files!r}")
    if min(args.workers) < 0 or args.warmup < 0 or min(args.steps, args.repeats, args.batch, args.seq_len) < 1:
        parser.error("--workers and --warmup must be >= 0; --steps, --repeats, --batch and --seq-len >= 1")
    needed = (args.warmup + args.steps) * args.batch * args.seq_len
    if args.corpus_tokens < needed:
        parser.error(
            f"--corpus-tokens={args.corpus_tokens:,} holds fewer than the {needed:,} tokens that "
            f"(--warmup + --steps) * --batch * --seq-len batches need; raise it or lower --steps."
        )
    return args


def write_corpus(path: Path, n_tokens: int) -> np.memmap:
    """``n_tokens`` byte-level tokens of real text (stdlib modules separated by EOS), repeated as needed."""
    docs = stdlib_documents(min(n_tokens, 2**24))
    text = np.frombuffer(b"".join(docs), dtype=np.uint8).astype(np.uint16)
    ends = np.cumsum([len(d) for d in docs])
    base = np.insert(text, ends, BYTE_EOS)
    out = np.memmap(path, dtype=np.uint16, mode="w+", shape=(n_tokens,))
    for start in range(0, n_tokens, len(base)):
        stop = min(start + len(base), n_tokens)
        out[start:stop] = base[: stop - start]
    out.flush()
    return np.memmap(path, dtype=np.uint16, mode="r")


def time_batches(batches: Iterator[Any], warmup: int, steps: int) -> list[float]:
    """Seconds each of ``steps`` batches took to arrive, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        next(batches)
    seconds = []
    last = time.perf_counter()
    for _ in range(steps):
        next(batches)
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
    return seconds


def numpy_batches(tokens: np.memmap, order: np.ndarray, batch: int, seq_len: int) -> Iterator[torch.Tensor]:
    """The loader's batches made the cheapest way: one numpy gather of the same instances per batch."""
    for b in range(len(order) // batch):
        starts = order[b * batch : (b + 1) * batch].astype(np.int64) * seq_len
        yield torch.from_numpy(np.stack([tokens[s : s + seq_len] for s in starts]).astype(np.int64))


def summarize(runs: list[list[float]], tokens_per_batch: int, workers: Optional[int]) -> dict[str, Any]:
    """Median throughput over the runs (lists of per-batch seconds) and pooled per-batch percentiles."""
    batches_per_s = statistics.median(len(run) / sum(run) for run in runs)
    ms = sorted(s * 1e3 for run in runs for s in run)
    return {
        "workers": workers,
        "tokens_per_s": round(batches_per_s * tokens_per_batch),
        "batches_per_s": round(batches_per_s, 1),
        "batch_ms_mean": round(statistics.fmean(ms), 4),
        "batch_ms_median": round(statistics.median(ms), 4),
        "batch_ms_p99": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 4),
        "runs_tokens_per_s": [round(len(run) * tokens_per_batch / sum(run)) for run in runs],
    }


def profile_loader(loader: torch.utils.data.DataLoader, warmup: int, steps: int, top: int = 15) -> str:
    """cProfile's top functions (by own time) while the single-process ``loader`` makes ``steps`` batches."""
    batches = iter(loader)
    for _ in range(warmup):
        next(batches)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        next(batches)
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    return stream.getvalue()


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = report["settings"]
    table = Table(
        title=(
            f"Data loader: batches of {s['batch']} x {s['seq_len']} tokens, {s['steps']} timed after "
            f"{s['warmup']} warm-up, median of {s['repeats']} runs, corpus {s['corpus_tokens'] / 1e6:.0f}M tokens "
            f"(page cache warm)"
        )
    )
    for column in ("measurement", "M tokens/s", "batches/s", "ms/batch (median)", "ms/batch (p99)", "goal"):
        table.add_column(column, justify="left" if column == "measurement" else "right")
    for name, r in report["results"].items():
        goal = GOAL_REMOTE_TOKENS_PER_S if name.startswith("remote") else report["goal_tokens_per_s"]
        meets = "yes" if r["tokens_per_s"] >= goal else "NO"
        table.add_row(
            name,
            f"{r['tokens_per_s'] / 1e6:.1f}",
            f"{r['batches_per_s']:.0f}",
            f"{r['batch_ms_median']:.3f}",
            f"{r['batch_ms_p99']:.3f}",
            "-" if name == NUMPY_GATHER else meets,
        )
    table.caption = " ".join(report["notes"])
    Console(width=None if sys.stdout.isatty() else 150).print(table)


def measure_remote(
    args: argparse.Namespace, tokens: np.ndarray, root: Path, load_config: Any, results: dict[str, Any]
) -> dict[str, Any]:
    """The remote rows (added to ``results``), start-up times and data waits; see the module doc."""
    from olmo.bench import dataloader_remote as remote

    server, base_url = remote.serve(root, args.latency)
    try:
        for workers in args.workers:
            cfg = load_config(workers, f"{base_url}/{Path(corpus_name(root)).name}")
            name = f"remote loader, {workers} workers ({args.latency * 1e3:.0f} ms a request)"
            results[name] = remote.loader_row(
                cfg.data,
                cfg.model,
                DataContext.from_train_config(cfg),
                root / f"order-remote-{workers}",
                args.warmup,
                args.remote_steps,
                args.repeats,
                time_batches,
                summarize,
            )
            log.info("%s: %s tokens/s.", name, f"{results[name]['tokens_per_s']:,}")
        out: dict[str, Any] = {"latency_s": args.latency, "startup": {}}
        for files in args.startup_files:
            out["startup"][files] = remote.startup_rows(tokens, root / "runs", base_url, root, files)
            log.info("Start-up with %d files: %s", files, out["startup"][files])
        if args.wait_steps:
            out["data_wait"] = remote.data_wait_rows(tokens, root / "runs", base_url, root, args.wait_steps)
            log.info("Data wait: %s", out["data_wait"])
        return out
    finally:
        server.kill()


def corpus_name(root: Path) -> Path:
    return root / "tokens.npy"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    machine = machine_info()
    root = Path(tempfile.mkdtemp(prefix="olmo-dataloader-benchmark-", dir=args.folder))
    corpus = corpus_name(root)

    def load_config(workers: int, path: Any = corpus) -> TrainConfig:
        return TrainConfig.load(
            args.config,
            [
                f"data.paths=[{path}]",
                "data.memmap_dtype=uint16",
                f"data.num_workers={workers}",
                f"model.max_sequence_length={args.seq_len}",
                f"global_train_batch_size={args.batch}",
                f"device_train_microbatch_size={args.batch}",
                f"save_folder={root / 'run'}",
            ],
        )

    data_cfg = load_config(0).data
    tokens_per_batch = args.batch * args.seq_len
    results: dict[str, dict[str, Any]] = {}
    profile = None
    remote: dict[str, Any] = {}
    try:
        start = time.perf_counter()
        tokens = write_corpus(corpus, args.corpus_tokens)
        # One sequential pass puts (keeps) the whole file in the page cache before anything is timed.
        checksum = int(tokens.sum(dtype=np.uint64))
        log.info(
            "Wrote and read %s tokens (checksum %d) in %.1f s; corpus %s.",
            f"{args.corpus_tokens:,}",
            checksum,
            time.perf_counter() - start,
            corpus,
        )
        for workers in args.workers:
            loader = build_train_dataloader(load_config(workers), work_dir=root / "order")
            runs = [time_batches(iter(loader), args.warmup, args.steps) for _ in range(args.repeats)]
            results[f"loader, {workers} workers"] = row = summarize(runs, tokens_per_batch, workers)
            log.info("Loader with %d workers: %s tokens/s.", workers, f"{row['tokens_per_s']:,}")
        assert isinstance(loader.dataset, IterableDataset)
        order = loader.dataset.global_indices()
        runs = [
            time_batches(numpy_batches(tokens, order, args.batch, args.seq_len), args.warmup, args.steps)
            for _ in range(args.repeats)
        ]
        results[NUMPY_GATHER] = summarize(runs, tokens_per_batch, None)
        if args.profile:
            loader = build_train_dataloader(load_config(0), work_dir=root / "order")
            profile = profile_loader(loader, args.warmup, args.steps)
            print(profile)
        if args.remote:
            remote = measure_remote(args, tokens, root, load_config, results)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    report = {
        **({"remote": remote} if args.remote else {}),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "machine": machine,
        "config": args.config,
        "settings": {
            "batch": args.batch,
            "seq_len": args.seq_len,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "corpus_tokens": args.corpus_tokens,
            "memmap_dtype": "uint16",
            "pin_memory": data_cfg.pin_memory,
            "prefetch_factor": data_cfg.prefetch_factor,
            "torch_threads": torch.get_num_threads(),
        },
        "goal_tokens_per_s": GOAL_TOKENS_PER_S,
        "notes": [
            "Loader rows: olmo.data.build_train_dataloader, the trainer's loader; page cache warm.",
            f"'{NUMPY_GATHER}': the same instances gathered with numpy into one int64 tensor per batch "
            "(the floor of what reading the memmap costs).",
        ],
        "results": results,
        "profile": profile,
    }
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        log.info("Wrote %s", args.out)
    return 0
