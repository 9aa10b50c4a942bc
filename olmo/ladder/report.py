"""What a ladder has done and what it says: per-size checkpoint status, the results table, the scaling-law fit
with its predictions, and the plots (learning-rate schedules, loss against compute).

Everything is read from the sizes' save folders: committed checkpoints (their commit markers) and
``metrics.jsonl`` (training steps and evaluations, merged by step; a resumed run's later lines win).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..config import SchedulerUnits
from ..optim import build_scheduler
from ..util.checkpoint_dirs import list_checkpoints
from ..util.json_lines import read_metrics_jsonl
from .fit import PowerLawFit, fit_chinchilla, fit_loss_vs_compute
from .plan import Branch, Rung
from .run_planner import format_count

__all__ = [
    "TRAIN_LOSS",
    "read_metrics",
    "rung_status",
    "format_status",
    "ladder_results",
    "format_results",
    "lr_schedule",
    "plot_lr",
    "plot_loss_vs_compute",
]

log = logging.getLogger(__name__)

TRAIN_LOSS = "train/CrossEntropyLoss"
LOSS_WINDOW = 10
"""Steps averaged for a run's final training loss (and whose spread gives its standard error)."""
MIN_FIT_POINTS = 3
MIN_CHINCHILLA_POINTS = 6


def read_metrics(folder: Path) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` of a save folder as step -> every value logged at that step (empty when absent); see
    :func:`olmo.util.json_lines.read_metrics_jsonl`."""
    path = folder / "metrics.jsonl"
    return read_metrics_jsonl(path) if path.is_file() else {}


def _checkpoint_metrics(record: dict[str, float]) -> dict[str, float]:
    """The losses and evaluation results of a step (not the time its evaluation took)."""
    return {k: v for k, v in record.items() if k == TRAIN_LOSS or (k.startswith("eval/") and k != "eval/seconds")}


def rung_status(rung: Rung) -> dict[str, Any]:
    """The size's expected checkpoints (each present or not, with its step, tokens, path and the metrics logged at
    its step) and its latest metrics."""
    metrics = read_metrics(rung.save_folder)
    found = {c.step: c.path for c in list_checkpoints(rung.save_folder) if not c.ephemeral}
    suffix = "" if rung.cfg.save_interval_unsharded is None else "-unsharded"
    checkpoints = [
        {
            "step": step,
            "tokens": step * rung.plan.global_batch_size_tokens,
            "present": step in found,
            "path": found.get(step, str(rung.save_folder / f"step{step}{suffix}")),
            "metrics": _checkpoint_metrics(metrics.get(step, {})),
        }
        for step in rung.checkpoint_steps
    ]
    last = max(metrics) if metrics else None
    latest = {"step": last, **_checkpoint_metrics(metrics[last])} if last is not None else None
    out = {
        "size": rung.name,
        "save_folder": str(rung.save_folder),
        "max_steps": rung.plan.max_steps,
        "finished": last is not None and last >= (rung.plan.max_steps or 0),
        "checkpoints": checkpoints,
        "latest": latest,
    }
    if rung.branches:
        out["branches"] = [_branch_status(rung, b, set(found)) for b in rung.branches]
    return out


def _branch_status(rung: Rung, branch: Branch, stable: set[int]) -> dict[str, Any]:
    """A decay branch's progress: whether its branch point is among the stable run's checkpoint steps ``stable``
    and its final checkpoint is there, and its latest metrics."""
    metrics = read_metrics(branch.save_folder)
    final = {c.step: c.path for c in list_checkpoints(branch.save_folder) if not c.ephemeral}.get(branch.steps)
    last = max(metrics) if metrics else None
    return {
        "budget": branch.multiple,
        "name": branch.name,
        "save_folder": str(branch.save_folder),
        "branch_step": branch.start_step,
        "branch_point_present": branch.start_step in stable,
        "max_steps": branch.steps,
        "tokens": branch.steps * rung.plan.global_batch_size_tokens,
        "finished": final is not None,
        "final_checkpoint": final,
        "latest": {"step": last, **_checkpoint_metrics(metrics[last])} if last is not None else None,
    }


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _num(value: Optional[float], digits: int = 4) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1e4 or (value and abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.{digits}g}"


def _metric_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {_num(v)}" for k, v in metrics.items()) or "-"


def format_status(statuses: list[dict[str, Any]]) -> str:
    """The statuses as one block per size: a table of its checkpoints (✔ written, ✘ not yet) and its latest metrics."""
    blocks = []
    for s in statuses:
        latest = s["latest"]
        progress = f"step {latest['step']:,} of {s['max_steps']:,}" if latest else "not started"
        head = f"{s['size']}: {progress}{' (finished)' if s['finished'] else ''} in {s['save_folder']}"
        rows = [
            [
                "✔" if c["present"] else "✘",
                f"{c['step']:,}",
                format_count(c["tokens"]),
                c["path"],
                _metric_text(c["metrics"]),
            ]
            for c in s["checkpoints"]
        ]
        table = _table(["", "step", "tokens", "path", "metrics at that step"], rows)
        latest_line = (
            f"latest: step {latest['step']:,}: {_metric_text({k: v for k, v in latest.items() if k != 'step'})}"
            if latest
            else "latest: -"
        )
        lines = [head, _indent(table), _indent(latest_line)]
        for b in s.get("branches", []):
            at = b["latest"]
            progress = "finished" if b["finished"] else f"at step {at['step']:,}" if at else "not started"
            point = "✔" if b["branch_point_present"] else "✘"
            metrics = _metric_text({k: v for k, v in at.items() if k != "step"}) if at else "-"
            lines.append(
                _indent(
                    f"{'✔' if b['finished'] else '✘'} budget {b['budget']:g}x: {b['max_steps']:,} steps "
                    f"({format_count(b['tokens'])} tokens) from step {b['branch_step']:,} ({point}), {progress} in "
                    f"{b['save_folder']}: {metrics}"
                )
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _runs(rung: Rung) -> list[tuple[Optional[Branch], Path, int]]:
    """The runs of a size whose final values are results: the size's own run, or each decay branch (with its save
    folder and last step)."""
    if rung.branches:
        return [(b, b.save_folder, b.steps) for b in rung.branches]
    return [(None, rung.save_folder, rung.plan.max_steps or 0)]


def _result_row(rung: Rung, branch: Optional[Branch], folder: Path, max_steps: int) -> dict[str, Any]:
    plan, metrics = rung.plan, read_metrics(folder)
    train = [(step, rec[TRAIN_LOSS]) for step, rec in sorted(metrics.items()) if TRAIN_LOSS in rec]
    last_step = max(metrics) if metrics else 0
    final = metrics.get(last_step, {})
    tokens = int(final.get("throughput/total_tokens", last_step * plan.global_batch_size_tokens))
    window = [loss for _, loss in train[-LOSS_WINDOW:]]
    sem = float(np.std(window, ddof=1) / math.sqrt(len(window))) if len(window) > 1 else None
    planned_tokens = max_steps * plan.global_batch_size_tokens
    return {
        "size": rung.name,
        "run": rung.name if branch is None else f"{rung.name}/{branch.name}",
        "budget": None if branch is None else branch.multiple,
        "next_size": rung.is_next,
        "num_params": plan.num_params,
        "num_non_embedding_params": plan.num_non_embedding_params,
        "step": last_step,
        "max_steps": max_steps,
        "finished": bool(metrics) and last_step >= max_steps,
        "tokens": tokens,
        "planned_tokens": planned_tokens,
        "planned_train_flops": float(plan.flops_per_token) * planned_tokens,
        "train_flops": float(plan.flops_per_token) * tokens,
        "final_train_loss": train[-1][1] if train else None,
        "train_loss_last_steps": float(np.mean(window)) if window else None,
        "train_loss_stderr": sem,
        "eval": {k: v for k, v in _checkpoint_metrics(final).items() if k != TRAIN_LOSS},
    }


def _metric_value(row: dict[str, Any], metric: str) -> Optional[float]:
    if metric == TRAIN_LOSS:
        return row["train_loss_last_steps"]
    return row["eval"].get(metric)


def _choose_metric(rows: list[dict[str, Any]], requested: Optional[str]) -> str:
    if requested:
        return requested
    keys = [set(r["eval"]) for r in rows]
    common = sorted(set.intersection(*keys)) if keys else []
    return next((k for k in common if k.endswith("/CrossEntropyLoss")), TRAIN_LOSS)


def ladder_results(rungs: list[Rung], fit_metric: Optional[str] = None) -> dict[str, Any]:
    """Every size's results row, the fit of ``L(C) = E + A * C^(-alpha)`` to the finished sizes of the ladder (and
    the Chinchilla form when at least six runs vary parameters and tokens independently), and the predicted loss
    of every size not yet fitted (``next_sizes`` first), with its measured loss once it has run.

    The fitted value is ``fit_metric``'s at each run's last step (by default the first ``eval/*/CrossEntropyLoss``
    every finished size logged, else the training loss averaged over its last 10 steps); each point's standard error
    is the training loss's over those steps."""
    rows = [_result_row(r, *run) for r in rungs for run in _runs(r)]
    fitted = [row for row in rows if row["finished"] and not row["next_size"]]
    metric = _choose_metric(fitted, fit_metric)
    for row in rows:
        row["fit_value"] = _metric_value(row, metric)
    points = [row for row in fitted if row["fit_value"] is not None]
    out: dict[str, Any] = {"metric": metric, "rows": rows, "fit": None, "chinchilla_fit": None}
    out["compute"] = _compute(rungs)
    if len(points) < MIN_FIT_POINTS:
        out["fit_problem"] = (
            f"{len(points)} finished size(s) with {metric}; the fit needs at least {MIN_FIT_POINTS}. Run more sizes "
            f"(scripts/ladder.py run CONFIG --size S)."
        )
        return out
    errors = [row["train_loss_stderr"] for row in points]
    sigma = np.array(errors) if all(e is not None and e > 0 for e in errors) else None
    fit = fit_loss_vs_compute([r["train_flops"] for r in points], [r["fit_value"] for r in points], sigma)
    chinchilla = _chinchilla(points, sigma)
    predictions = []
    fitted_runs = {row["run"] for row in points}
    for row in sorted((r for r in rows if r["run"] not in fitted_runs), key=lambda r: not r["next_size"]):
        flops = row["planned_train_flops"]
        value, stderr = fit.predict(flops)
        measured = row["fit_value"] if row["finished"] else None
        prediction = {
            "size": row["size"],
            "run": row["run"],
            "budget": row["budget"],
            "train_flops": flops,
            "predicted_loss": value,
            "predicted_loss_stderr": stderr,
            "measured_loss": measured,
            "error": None if measured is None else measured - value,
        }
        if chinchilla is not None:
            value, stderr = chinchilla.predict(
                float(row["num_non_embedding_params"]), float(row["planned_tokens"])
            )
            prediction["chinchilla_predicted_loss"] = value
            prediction["chinchilla_predicted_loss_stderr"] = stderr
            prediction["chinchilla_error"] = None if measured is None else measured - value
        predictions.append(prediction)
    out["fit"] = {**fit.as_dict(), "metric": metric, "predictions": predictions}
    out["fit"]["next_size"] = predictions[0] if predictions else None
    out["chinchilla_fit"] = None if chinchilla is None else {**chinchilla.as_dict(), "metric": metric}
    return out


def _chinchilla(points: list[dict[str, Any]], sigma: Optional[np.ndarray]) -> Optional[PowerLawFit]:
    """The fit of ``L(N, D)`` when at least six points vary parameters and tokens independently (several budgets
    per size), else None."""
    if len(points) < MIN_CHINCHILLA_POINTS:
        return None
    n = np.log([r["num_non_embedding_params"] for r in points])
    d = np.log([float(r["tokens"]) for r in points])
    if abs(np.corrcoef(n, d)[0, 1]) > 0.98:
        return None  # one token budget per size: parameters and tokens cannot be told apart
    return fit_chinchilla(np.exp(n), np.exp(d), [r["fit_value"] for r in points], sigma)


def _compute(rungs: list[Rung]) -> Optional[dict[str, Any]]:
    """With budgets: each size's planned FLOPs (stable run + branches against separate runs), and their sums over the
    ladder's sizes (``next_sizes`` are listed, not summed)."""
    sizes = {r.name: c for r in rungs if (c := r.compute()) is not None}
    ladder = [sizes[r.name] for r in rungs if not r.is_next and r.name in sizes]
    if not ladder:
        return None
    keys = ("stable_flops", "branches_flops", "total_flops", "separate_runs_flops")
    total = {k: sum(c[k] for c in ladder) for k in keys}
    total["saving"] = total["separate_runs_flops"] / total["total_flops"]
    return {"sizes": sizes, "total": total}


def _pm(value: float, stderr: Optional[float]) -> str:
    return f"{_num(value)} ± {_num(stderr)}" if stderr is not None else _num(value)


def format_results(results: dict[str, Any]) -> str:
    """The results table, the fit's parameters and the predictions, as text."""
    metric = results["metric"]
    rows = [
        [
            r["run"] + (" (next)" if r["next_size"] else ""),
            format_count(r["num_non_embedding_params"]),
            f"{r['step']:,}/{r['max_steps']:,}" if r["max_steps"] else f"{r['step']:,}",
            format_count(r["tokens"]),
            format_count(r["train_flops"]),
            _num(r["final_train_loss"]),
            _pm(r["train_loss_last_steps"], r["train_loss_stderr"])
            if r["train_loss_last_steps"] is not None
            else "-",
            _num(r["fit_value"]),
        ]
        for r in results["rows"]
    ]
    headers = ["size", "non-emb params", "steps", "tokens", "FLOPs", "final loss", "loss (last 10)", metric]
    lines = [_table(headers, rows)]
    evals = sorted({k for r in results["rows"] for k in r["eval"]})
    if evals:
        eval_rows = [[r["run"], *(_num(r["eval"].get(k)) for k in evals)] for r in results["rows"]]
        lines += ["", _table(["size", *evals], eval_rows)]
    compute = results.get("compute")
    if compute is not None:
        total = compute["total"]
        lines += [
            "",
            f"Compute of the ladder's sizes: stable runs {format_count(total['stable_flops'])} + decay branches "
            f"{format_count(total['branches_flops'])} = {format_count(total['total_flops'])} FLOPs, against "
            f"{format_count(total['separate_runs_flops'])} for a separate run per budget ({total['saving']:.2f}x "
            f"as much)",
        ]
    fit = results["fit"]
    if fit is None:
        lines += ["", f"No fit: {results.get('fit_problem', '')}"]
        return "\n".join(lines)
    params = ", ".join(f"{k} = {_pm(v, fit['stderr'][k])}" for k, v in fit["params"].items())
    lines += ["", f"Fit of {fit['metric']} over {fit['n_points']} runs: {fit['form']} with {params}"]
    chin = results.get("chinchilla_fit")
    if chin is not None:
        params = ", ".join(f"{k} = {_pm(v, chin['stderr'][k])}" for k, v in chin["params"].items())
        lines.append(f"Fit over parameters and tokens: {chin['form']} with {params}")
    for p in fit["predictions"]:
        lines.append(
            f"  predicted for {p['run']} ({format_count(p['train_flops'])} FLOPs): "
            f"{_pm(p['predicted_loss'], p['predicted_loss_stderr'])}{_measured(p, p['predicted_loss'], p['error'])}"
        )
        if "chinchilla_predicted_loss" in p:
            value, error = p["chinchilla_predicted_loss"], p["chinchilla_error"]
            lines.append(
                f"    by L(N, D): {_pm(value, p['chinchilla_predicted_loss_stderr'])}{_measured(p, value, error)}"
            )
    return "\n".join(lines)


def _measured(prediction: dict[str, Any], predicted: float, error: Optional[float]) -> str:
    if prediction["measured_loss"] is None or error is None:
        return ""
    return f"; measured {_num(prediction['measured_loss'])} ({error:+.3f}, {100 * error / predicted:+.1f}%)"


def lr_schedule(rung: Rung, branch: Optional[Branch] = None) -> tuple[list[int], list[float]]:
    """The learning rate of every step of the size's run (or of a decay branch, from step 1: its first steps are the
    stable run's), as the train module sets it (step ``s`` uses the schedule at ``s`` steps, or ``s`` batches of
    tokens)."""
    cfg, max_steps = (rung.cfg, rung.plan.max_steps or 0) if branch is None else (branch.cfg, branch.steps)
    scheduler = build_scheduler(cfg.scheduler)
    unit = cfg.tokens_per_batch if cfg.scheduler.units == SchedulerUnits.tokens else 1
    steps = list(range(1, max_steps + 1))
    lrs = [scheduler.get_lr(cfg.optimizer.learning_rate, s * unit, max_steps * unit) for s in steps]
    return steps, lrs


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lr(rung: Rung, path: Path) -> None:
    """The size's learning rate over steps (bottom axis) and tokens (top axis), as a PNG."""
    plt = _pyplot()
    tokens_per_step = rung.plan.global_batch_size_tokens
    fig, ax = plt.subplots(figsize=(7, 4))
    if rung.branches:
        ax.plot(*lr_schedule(rung), color="C0", label="stable")
        for i, branch in enumerate(rung.branches):
            steps, lrs = lr_schedule(rung, branch)
            start = branch.start_step - 1
            ax.plot(steps[start:], lrs[start:], color=f"C{i + 1}", label=f"{branch.multiple:g}x: decay")
        ax.legend()
    else:
        ax.plot(*lr_schedule(rung))
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    top = ax.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step, lambda t: t / tokens_per_step))
    top.set_xlabel("tokens")
    ax.set_title(f"{rung.name}: peak {rung.plan.learning_rate:.3g}, {rung.plan.warmup_steps} warmup steps", pad=28)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_loss_vs_compute(results: dict[str, Any], path: Path) -> bool:
    """The fitted sizes' loss against training FLOPs (log-log) with the fitted curve, the predictions (with their
    1-sigma bars) and the measured loss of predicted sizes that have run. False when there is nothing to plot."""
    rows = [r for r in results["rows"] if r["finished"] and r["fit_value"] is not None]
    if not rows:
        return False
    plt = _pyplot()
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 5))
    fitted = [r for r in rows if not r["next_size"]]
    ax.scatter(
        [r["train_flops"] for r in fitted], [r["fit_value"] for r in fitted], color="C0", label="ladder", zorder=3
    )
    for r in fitted:
        ax.annotate(r["run"], (r["train_flops"], r["fit_value"]), textcoords="offset points", xytext=(5, 5))
    fit = results["fit"]
    if fit is not None:
        e, a, alpha = (fit["params"][k] for k in ("E", "A", "alpha"))
        flops = [r["train_flops"] for r in rows] + [
            p["train_flops"] for p in fit["predictions"] if p["train_flops"]
        ]
        grid = np.geomspace(min(flops) / 2, max(flops) * 2, 200)
        ax.plot(grid, e + a * grid ** (-alpha), color="C1", label=f"fit: {e:.3g} + {a:.3g}·C^(-{alpha:.3g})")
        for p in fit["predictions"]:
            ax.errorbar(
                p["train_flops"],
                p["predicted_loss"],
                yerr=p["predicted_loss_stderr"] or 0,
                fmt="o",
                mfc="none",
                color="C1",
                capsize=3,
            )
            ax.annotate(
                f"{p['run']} (predicted)",
                (p["train_flops"], p["predicted_loss"]),
                textcoords="offset points",
                xytext=(5, -12),
            )
            if p["measured_loss"] is not None:
                ax.scatter([p["train_flops"]], [p["measured_loss"]], marker="x", color="C3", zorder=3)
        if any(p["measured_loss"] is not None for p in fit["predictions"]):
            ax.scatter([], [], marker="x", color="C3", label="measured (not fitted)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(matplotlib.ticker.FormatStrFormatter("%.3g"))  # losses span a narrow range: plain numbers
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel(results["metric"])
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
