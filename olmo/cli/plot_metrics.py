"""Plot training and evaluation curves from runs' ``metrics.jsonl`` files, several runs overlaid.

    python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] [--out DIR]

Writes PNG files into ``--out`` (default ``FIRST_RUN_DIR/plots``): ``loss.png`` (training cross entropy,
raw and smoothed, and with a KL stage the total loss), ``loss_by_source.png`` (with a data mixture, each
source's ``train/{source}/CrossEntropyLoss``), ``kl.png`` (``train/KL``, with a KL stage),
``learning_rate.png``, ``throughput.png`` (tokens/s per device) and one file per evaluation metric group
(``eval_<label>.png``, ``eval_downstream.png``). In a staged run (``stages:``) every plot marks where each
stage begins with a dashed line.

``--out`` is always a folder, created if missing; the PNG files in it are replaced. A path that is a file (or lies
under one) is refused before anything is read or written: give a folder, not the name of an image.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Optional

from olmo.exceptions import OLMoCliError
from olmo.util import unwritable_reason
from olmo.util.json_lines import read_metrics_jsonl

log = logging.getLogger("plot_metrics")

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)]


def read_metrics(run: Path) -> Series:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise OLMoCliError(f"'{path}' does not exist; pass the save_folder of a run (it holds metrics.jsonl).")
    series: Series = defaultdict(list)
    for step, values in sorted(read_metrics_jsonl(path).items()):
        for key, value in values.items():
            series[key].append((step, value))
    return dict(series)


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def stage_starts(series: Series) -> list[tuple[int, int]]:
    """``(first step, stage)`` of every stage after the first, from ``train/stage``."""
    out, previous = [], None
    for step, stage in series.get("train/stage", []):
        if previous is not None and stage != previous:
            out.append((step, int(stage)))
        previous = stage
    return out


def plot(
    runs: dict[str, Series], keys: list[str], title: str, ylabel: str, path: Path, smooth: bool = False
) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    drawn = False
    for name, series in runs.items():
        for key in keys:
            points = series.get(key)
            if not points:
                continue
            steps, values = zip(*points)
            label = name if len(keys) == 1 else f"{name}: {key}"
            if smooth and len(values) > 10:
                line = ax.plot(steps, values, alpha=0.25)[0]
                ax.plot(
                    steps, _smooth(list(values), max(2, len(values) // 20)), color=line.get_color(), label=label
                )
            else:
                ax.plot(steps, values, marker="o" if len(values) < 20 else None, label=label)
            drawn = True
    if drawn:
        for series in runs.values():
            for step, stage in stage_starts(series):
                ax.axvline(step, color="gray", linestyle="--", linewidth=0.8)
                ax.annotate(
                    f" stage {stage}", (step, 1.0), xycoords=("data", "axes fraction"), va="top", fontsize=7
                )
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl)")
    parser.add_argument(
        "--out", type=Path, help="output folder, created if missing; never a file (default: FIRST_RUN/plots)"
    )
    args = parser.parse_args(argv)
    out = args.out or args.runs[0] / "plots"
    dangling = out.is_symlink() and not out.exists()
    problem = (
        f"it is a symlink to '{os.readlink(out)}', which does not exist" if dangling else unwritable_reason(out)
    )
    if problem is not None:
        flag = "--out" if args.out else "The default output folder"
        raise OLMoCliError(
            f"{flag} '{out}' cannot hold the plots: {problem}. The plots are PNG files written into a folder; give "
            f"--out=FOLDER (a new or existing folder) instead."
        )
    runs = {run.resolve().name: read_metrics(run) for run in args.runs}
    out.mkdir(parents=True, exist_ok=True)
    figures = [
        (["train/CrossEntropyLoss", "train/TotalLoss"], "Training loss", "loss", "loss.png", True),
        (["train/KL"], "KL(policy || reference)", "KL per token", "kl.png", False),
        (["optim/learning_rate_group0"], "Learning rate", "learning rate", "learning_rate.png", False),
        (["throughput/device/tokens_per_second"], "Throughput", "tokens/s per device", "throughput.png", True),
    ]
    source_keys = sorted(
        {k for series in runs.values() for k in series if k.startswith("train/") and k.count("/") == 2}
    )
    if source_keys:  # a mixture: one curve per source (train/{source}/CrossEntropyLoss)
        figures.insert(1, (source_keys, "Training loss per source", "loss", "loss_by_source.png", True))
    eval_keys = sorted({key for series in runs.values() for key in series if key.startswith("eval/")})
    groups: dict[str, list[str]] = defaultdict(list)
    for key in eval_keys:
        if key != "eval/seconds":
            groups[key.split("/")[1]].append(key)
    for group, keys in sorted(groups.items()):
        figures.append((keys, f"Evaluation: {group}", "value", f"eval_{group.replace('/', '_')}.png", False))
    written = [
        out / name
        for keys, title, ylabel, name, smooth in figures
        if plot(runs, keys, title, ylabel, out / name, smooth)
    ]
    for path in written:
        log.info("Wrote %s", path)
    if not written:
        raise OLMoCliError(f"No metrics to plot in {', '.join(map(str, args.runs))}.")
    return 0
