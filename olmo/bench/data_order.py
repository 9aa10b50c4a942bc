"""Measure what the data order costs at OLMo-2 scale: launch time and the ranks' anonymous memory.

    python scripts/benchmark_data_order.py [--files 1000] [--tokens 4e12] [--seq-len 4096] [--nproc 2]
        [--folder DIR] [--out result.json] [--keep]

Writes ``--files`` sparse uint32 token files holding ``--tokens`` tokens in all (OLMo-2 stage 1 has 1,122 files
and ~4T tokens; sparse files take no disk, and their zeros are valid token ids), and trains a 2-layer model on
them with ``torchrun --nproc_per_node=NPROC scripts/train.py`` (gloo on CPU), three times:

1. the first launch, which builds the epoch's order (976,562,000 instances at the defaults) and saves a
   checkpoint after step 1;
2. a relaunch with ``--try_load_latest_save``, which resumes from it and trains step 2;
3. the same first launch over a corpus ``--scale-down`` (1,000) times smaller, the baseline of the memory.

For each: seconds from the launch to the end of the first step (the first line of ``metrics.jsonl``), and the
peak over time of the ranks' summed ``RssAnon`` (anonymous memory; pages of mapped files, such as the order file
and the token files, are not counted), sampled every 0.1 s from ``/proc``. The model is tiny (2 layers, d_model 16,
vocabulary 512), so that its own memory does not hide what the data costs. The issue's targets, with 2 ranks on
this 2-core machine: launch 1 holds at most 2 GB more anonymous memory than launch 3, and launch 2 ends its
first step within 60 s.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import yaml

from olmo.testing import tiny_config_dict, torchrun_command
from olmo.util import machine_info

log = logging.getLogger("benchmark_data_order")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_data_order.py", description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1000, help="token files")
    parser.add_argument("--tokens", type=float, default=4e12, help="tokens in all the files together")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per instance")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--scale-down", type=int, default=1000, help="how much smaller the baseline corpus is")
    parser.add_argument("--folder", help="where to create the files (default: the system temp)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--keep", action="store_true", help="keep the files and runs")
    args = parser.parse_args(argv)
    if min(args.files, args.seq_len, args.nproc, args.scale_down) < 1 or args.tokens < args.files * args.seq_len:
        parser.error("--files, --seq-len, --nproc and --scale-down must be >= 1, and --tokens >= files * seq-len")
    return args


def write_sparse_corpus(folder: Path, files: int, tokens: float) -> list[str]:
    """``files`` sparse uint32 files of ``tokens / files`` tokens each (no disk blocks: they read as zeros)."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = int(tokens) // files
    paths = []
    for i in range(files):
        path = folder / f"part-{i:05d}.npy"
        with open(path, "wb") as f:
            f.truncate(per_file * 4)
        paths.append(str(path))
    return paths


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rss_anon_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def launch(config: Path, nproc: int, *extra: str) -> dict[str, Any]:
    """Run torchrun on ``config``; seconds to the first metrics line, peak summed RssAnon of the ranks, exit code."""
    metrics = Path(yaml.safe_load(config.read_text())["save_folder"]) / "metrics.jsonl"
    lines_before = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    cmd, env = torchrun_command(nproc, config, *extra)
    start = time.perf_counter()
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step, peak_kb = None, 0
    while process.poll() is None:
        ranks = _children(process.pid)
        peak_kb = max(peak_kb, sum(_rss_anon_kb(pid) for pid in ranks))
        if first_step is None and metrics.is_file() and len(metrics.read_text().splitlines()) > lines_before:
            first_step = time.perf_counter() - start
        time.sleep(0.1)
    output = process.stdout.read() if process.stdout else ""
    if process.returncode != 0:
        log.error("torchrun failed (exit %d):\n%s", process.returncode, output[-4000:])
    return {
        "seconds_to_first_step": None if first_step is None else round(first_step, 1),
        "seconds_total": round(time.perf_counter() - start, 1),
        "peak_rss_anon_gb": round(peak_kb * 1024 / 1e9, 3),
        "exit_code": process.returncode,
    }


def write_run_config(root: Path, name: str, paths: list[str], seq_len: int, nproc: int) -> Path:
    cfg = tiny_config_dict(
        root / name / "run",
        paths,
        **{
            "model.max_sequence_length": seq_len,
            # The sparse files hold zeros: a small vocabulary keeps the model's own memory (its logits) out of
            # the way of what the data costs.
            "model.vocab_size": 512,
            "model.embedding_size": 512,
            "model.d_model": 16,
            "data.memmap_dtype": "uint32",
            "global_train_batch_size": nproc,
            "device_train_microbatch_size": 1,
            "max_duration": 2,
            "stop_at": 1,
            "save_interval_unsharded": 1,
            "save_data_indices": False,
        },
    )
    path = root / name / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    machine = machine_info()
    root = Path(tempfile.mkdtemp(prefix="olmo-order-benchmark-", dir=args.folder))
    results: dict[str, Any] = {}
    try:
        full = write_sparse_corpus(root / "full", args.files, args.tokens)
        small = write_sparse_corpus(root / "small", args.files, args.tokens / args.scale_down)
        instances = args.files * (int(args.tokens) // args.files // args.seq_len)
        log.info("%d sparse files, %s instances of %d tokens.", args.files, f"{instances:,}", args.seq_len)
        full_config = write_run_config(root, "full", full, args.seq_len, args.nproc)
        results["first launch"] = launch(full_config, args.nproc)
        log.info("First launch: %s", results["first launch"])
        results["relaunch"] = launch(full_config, args.nproc, "--try_load_latest_save", "--stop_at=2")
        log.info("Relaunch: %s", results["relaunch"])
        small_config = write_run_config(root, "small", small, args.seq_len, args.nproc)
        results[f"first launch, corpus {args.scale_down}x smaller"] = launch(small_config, args.nproc)
        log.info("Small corpus: %s", results[f"first launch, corpus {args.scale_down}x smaller"])
    finally:
        if args.keep:
            log.info("Kept %s", root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    extra = (
        results["first launch"]["peak_rss_anon_gb"]
        - results[f"first launch, corpus {args.scale_down}x smaller"]["peak_rss_anon_gb"]
    )
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *argv]),
        "machine": machine,
        "settings": {k: getattr(args, k) for k in ("files", "tokens", "seq_len", "nproc", "scale_down")},
        "instances": instances,
        "results": results,
        "extra_rss_anon_gb_over_small_corpus": round(extra, 3),
        "targets": {"extra_rss_anon_gb": 2.0, "relaunch_seconds_to_first_step": 60},
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0
