"""How long ``inspect_batch.py RUN --step N --json`` takes to answer for a run over many token files
(``scripts/benchmark_inspect.py``).

    python scripts/benchmark_inspect.py [--files 1000] [--instances-per-file 64] [--seq-len 512]
        [--docs-per-file 256] [--lookups 20] [--folder DIR] [--out result.json]

Writes ``--files`` token files of random ids, each with the document metadata ``dolma tokens`` writes beside it
(``part-*.csv.gz``: ``start,end,id,src,loc`` rows, ``--docs-per-file`` documents of equal length), a run folder
with its resolved ``config.yaml`` and the epoch's order (``train_data/global_indices.npy``, built as training
builds it), then answers ``--lookups`` steps spread over the epoch with the code of ``inspect_batch.py --json``
(:func:`olmo.train.batch_lookup.batch_rows` with provenance: config, dataset, order, every instance's source file,
offset and documents), in this process. Reports the time of each lookup (median and slowest), and the wall time of
one whole command (a new Python process, imports included), which is what a user waits for.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from olmo.bench.scripts import sibling_script
from olmo.testing import tiny_config_dict
from olmo.train.batch_lookup import batch_rows
from olmo.util import machine_info, result_file_problem, write_result_file

log = logging.getLogger("benchmark_inspect")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmark_inspect.py", description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--instances-per-file", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--docs-per-file", type=int, default=256)
    parser.add_argument("--lookups", type=int, default=20)
    parser.add_argument("--folder", type=Path, help="where the files go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="write the result as JSON to this file")
    args = parser.parse_args(argv)
    if min(args.files, args.instances_per_file, args.seq_len, args.docs_per_file, args.lookups) < 1:
        parser.error("every count must be at least 1")
    problem = result_file_problem(args.out, ("setup", "results")) if args.out else None
    if problem is not None:
        parser.error(f"--out={args.out} cannot be written: {problem}")
    return args


def write_files(folder: Path, args: argparse.Namespace) -> list[str]:
    """The token files and their dolma metadata; returns the token files' paths."""
    rng = np.random.default_rng(0)
    tokens_per_file = args.instances_per_file * args.seq_len
    bounds = np.linspace(0, tokens_per_file, args.docs_per_file + 1).astype(int)
    paths = []
    for i in range(args.files):
        path = folder / f"part-0-{i:05d}.npy"
        rng.integers(0, 50_000, tokens_per_file, dtype=np.uint16).tofile(path)
        rows = "".join(
            f"{bounds[d]},{bounds[d + 1]},doc-{i}-{d},s3://bucket/src-{i}.json.gz,{d}\n"
            for d in range(args.docs_per_file)
        )
        with gzip.open(path.with_name(path.name.replace(".npy", ".csv.gz")), "wt") as f:
            f.write(rows)
        paths.append(str(path))
    return paths


def build_run(folder: Path, paths: list[str], seq_len: int, steps: int) -> tuple[Path, Any]:
    """A run folder as training leaves it (a run of ``steps`` steps): its resolved config.yaml and the epoch's order
    file."""
    from olmo.config import TrainConfig
    from olmo.data import IterableDataset, build_memmap_dataset

    run = folder / "run"
    raw = tiny_config_dict(run, paths, **{"model.max_sequence_length": seq_len, "model.vocab_size": 50_304})
    raw["model"]["embedding_size"] = 50_304
    raw["max_duration"] = steps
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    cfg = TrainConfig.load_saved(run / "config.yaml")
    dataset = build_memmap_dataset(cfg, cfg.data)
    IterableDataset(dataset, cfg.global_train_batch_size, seed=cfg.seed, work_dir=run / "train_data")
    return run, cfg


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="olmo-bench-inspect-", dir=args.folder) as scratch:
        folder = Path(scratch)
        start = time.perf_counter()
        paths = write_files(folder, args)
        steps_per_epoch = (
            args.files * args.instances_per_file // tiny_config_dict(folder, [])["global_train_batch_size"]
        )
        run, cfg = build_run(folder, paths, args.seq_len, steps_per_epoch)
        setup_s = time.perf_counter() - start
        steps = sorted({int(s) for s in np.linspace(1, steps_per_epoch, args.lookups)})
        times = []
        for step in steps:
            start = time.perf_counter()
            rows = batch_rows(cfg, step, None, run / "train_data", provenance=True)
            times.append(time.perf_counter() - start)
            assert len(rows) == cfg.global_train_batch_size and all(r.documents for r in rows)
        start = time.perf_counter()
        command = [
            sys.executable,
            str(sibling_script("inspect_batch.py")),
            str(run),
            "--step",
            str(steps[-1]),
            "--json",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        command_s = time.perf_counter() - start
        if result.returncode != 0:
            raise RuntimeError(f"inspect_batch.py failed: {result.stderr[-2000:]}")
        answered = json.loads(result.stdout)
    results = {
        "lookup_s_median": statistics.median(times),
        "lookup_s_max": max(times),
        "lookups": len(times),
        "command_s": command_s,
        "instances_per_lookup": len(answered),
        "documents_per_instance": statistics.mean(len(r["documents"]) for r in answered),
        "setup_s": setup_s,
    }
    report = {
        "setup": {
            "files": args.files,
            "instances_per_file": args.instances_per_file,
            "seq_len": args.seq_len,
            "docs_per_file": args.docs_per_file,
            "global_batch": cfg.global_train_batch_size,
            "machine": machine_info(),
        },
        "results": results,
    }
    print(
        f"{args.files} files: a lookup takes {1e3 * results['lookup_s_median']:.1f} ms (median of {len(times)}, "
        f"slowest {1e3 * results['lookup_s_max']:.1f} ms); the whole command {results['command_s']:.2f} s."
    )
    if args.out:
        write_result_file(args.out, json.dumps(report, indent=1, default=str) + "\n")
    return 0
