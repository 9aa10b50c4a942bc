"""The GPU checks' results (:mod:`olmo.bench.gpu_checks`): each part's :class:`Result`, the numbers read from its
report, and the tables (the checks', and the benchmark rows of docs/throughput.md) and details written into ``--out`` (only over an earlier result of the command, never through
a link). Standard library only, as the command is."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeGuard

from ..exceptions import OLMoCliError, OLMoError
from ..util.atomic import atomic_write
from ..util.bounded_files import read_bounded

__all__ = [
    "Result",
    "markdown_table",
    "benchmark_table",
    "report_numbers",
    "environment_numbers",
    "read_report",
    "out_problem",
    "write_tables",
    "REPORT_LIMIT",
]

REPORT_LIMIT = 16 * 2**20
"""The largest report a part may write (a benchmark's JSON is a few KB)."""


@dataclass
class Result:
    name: str
    what: str
    status: str
    seconds: float = 0.0
    numbers: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    command: str = ""
    tail: str = ""


def report_numbers(report: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers from a benchmark's JSON (``scripts/benchmark.py``, ``benchmark_olmo.py`` or the loss
    curves'); only numbers (and short strings) are kept, so the table always formats."""
    report = _object(report)
    if "bit_identity" in report:  # benchmark_olmo.py: step-time ratios, ours over the original (below 1: faster)
        identity = report["bit_identity"] or {}
        out: dict[str, Any] = {
            "bit_identical": all(identity.get(k) for k in ("logits_equal", "loss_equal", "grads_equal"))
        }
        for key, side in report.get("results", {}).items():
            ratio = (side.get("ours_over_original") or {}).get("median")
            if _is_number(ratio):
                out[f"({key}) ours/original"] = round(ratio, 3)
        return out
    if isinstance(report.get("summary"), dict):  # float8_curves
        return plain(report["summary"])
    if "grouped_over_dense" in report:  # benchmark_experts.py: each variant's speed over the dense MLP's
        seconds = _object(report.get("seconds", {}))
        dense = seconds.get("dense")
        return {
            f"{name}/dense": round(dense / s, 3)
            for name, s in seconds.items()
            if name != "dense" and _is_number(s) and s > 0 and _is_number(dense)
        }
    r = _object(report.get("results", {}))  # benchmark.py
    out = {k: r[k] for k in ("tokens_per_second", "mfu", "peak_memory_mb", "step_time_s") if _is_number(r.get(k))}
    profile = report.get("profile")
    if isinstance(profile, dict) and isinstance(profile.get("categories_ms_per_step"), dict):  # --profile
        busy, shares = profile.get("busy_ms_per_step"), profile["categories_ms_per_step"]
        if _is_number(busy) and busy > 0:
            for name, ms in list(shares.items())[:4]:
                if _is_number(ms):
                    out[f"{str(name)[:40]} %"] = round(100 * ms / busy, 1)
    return {**out, **plain(_benchmark_facts(report))} if isinstance(report.get("setup"), dict) else out


FACTS = ("model", "gpu", "precision", "sequence", "micro_batch", "date", "commit")
"""What a row of the benchmark table says besides its numbers (from ``scripts/benchmark.py``'s report)."""


def _section(report: dict[str, Any], key: str) -> dict[str, Any]:
    value = report.get(key)
    return value if isinstance(value, dict) else {}


def _benchmark_facts(report: dict[str, Any]) -> dict[str, Any]:
    setup = _section(report, "setup")
    batch, device, git = _section(setup, "batch"), _section(setup, "device"), _section(report, "git")
    overrides = [o for o in report.get("overrides") or [] if isinstance(o, str)]
    # The model's own changes (its float8 goes into the precision, its sequence length into its own column).
    shown = ("model.float8", "model.max_sequence_length")
    changed = [o for o in overrides if o.startswith("model.") and not o.startswith(shown)]
    model = Path(str(report.get("config", "?"))).stem + "".join(f", {o}" for o in changed)
    precision = {"amp_bf16": "bf16", "fp32": "fp32"}.get(str(setup.get("precision")), str(setup.get("precision")))
    float8 = setup.get("float8")
    if isinstance(float8, dict):
        precision += f", float8 {float8.get('recipe')}"
    if setup.get("compile") is not None:
        precision += ", compiled"
    commit = str(git.get("commit", ""))[:8] + ("+" if git.get("dirty") else "")
    return {
        "model": model[:200],
        "gpu": device.get("name"),
        "precision": precision,
        "sequence": batch.get("seq_len"),
        "micro_batch": batch.get("micro_batch"),
        "date": str(report.get("date", ""))[:10],
        "commit": commit,
    }


def read_report(path: str) -> dict[str, Any]:
    """The table's numbers from the report a part wrote (:func:`report_numbers`), read within
    :data:`REPORT_LIMIT`. Raises :class:`OLMoError`, ``ValueError``, ``TypeError`` or ``RecursionError`` for one that
    is not a regular file within the limit, not JSON, or not the layout of a report."""
    return report_numbers(json.loads(read_bounded(path, REPORT_LIMIT, "its report")))


def environment_numbers(line: str) -> dict[str, Any]:
    """The environment probe's facts from its last output line (a JSON object)."""
    return plain(_object(json.loads(line)))


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"a JSON {type(value).__name__} where an object belongs")
    return value


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plain(values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` the table can show: numbers, short strings, None and short lists of numbers."""
    return {
        str(k)[:60]: v
        for k, v in list(values.items())[:50]
        if v is None
        or _is_number(v)
        or (isinstance(v, str) and len(v) <= 200)
        or (isinstance(v, list) and len(v) <= 8 and all(_is_number(x) for x in v))
    }


def markdown_table(results: list[Result]) -> str:
    """One table for RESEARCH_LOG: each part's status, time and main numbers."""
    rows = [
        "| part | what | status | time | tokens/s | MFU | peak memory | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n = r.numbers
        tps = f"{n['tokens_per_second']:,.0f}" if "tokens_per_second" in n else ""
        mfu = f"{100 * n['mfu']:.1f}%" if isinstance(n.get("mfu"), (int, float)) else ""
        mem = f"{n['peak_memory_mb']:,.0f} MB" if "peak_memory_mb" in n else ""
        extra = ", ".join(
            f"{k} {v}"
            for k, v in n.items()
            if k not in ("tokens_per_second", "mfu", "peak_memory_mb", "step_time_s", *FACTS)
        )
        note = " ".join("; ".join(x for x in (r.note, extra) if x).replace("|", "/").split())  # one row each
        rows.append(f"| {r.name} | {r.what} | {r.status} | {r.seconds:.0f} s | {tps} | {mfu} | {mem} | {note} |")
    return "\n".join(rows)


TABLE_HEAD = "| part | what | status |"
BENCHMARK_HEAD = "| model | GPU | precision | sequence | micro-batch | tokens/s per GPU | MFU | peak memory | command | date, commit |"


def benchmark_table(results: list[Result]) -> str:
    """docs/throughput.md's "Benchmarks" rows: each part that ran ``scripts/benchmark.py`` to its end, with the
    exact command, the date and the commit (``+``: uncommitted changes)."""
    rows = [BENCHMARK_HEAD, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        n = r.numbers
        if r.status != "ok" or not _is_number(n.get("tokens_per_second")) or "model" not in n:
            continue
        mfu = f"{100 * n['mfu']:.1f} %" if _is_number(n.get("mfu")) else ""
        mem = f"{n['peak_memory_mb'] / 1024:,.1f} GiB" if _is_number(n.get("peak_memory_mb")) else ""
        command = _shown_command(r.command)
        cells = [n["model"], n.get("gpu"), n.get("precision"), _count(n.get("sequence")), n.get("micro_batch")]
        cells += [
            f"{n['tokens_per_second']:,.0f}",
            mfu,
            mem,
            f"`{command}`",
            f"{n.get('date')}, {n.get('commit')}",
        ]
        rows.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(rows)


def _shown_command(command: str) -> str:
    """The command as a user types it: ``python`` for the interpreter's path, without the report's ``--out``."""
    words = command.replace("|", "/").split()
    if words and Path(words[0]).name.startswith("python"):
        words[0] = "python"
    kept = [w for i, w in enumerate(words) if w != "--out" and (i == 0 or words[i - 1] != "--out")]
    return " ".join(kept)


def _count(value: Any) -> str:
    return f"{value:,}" if _is_number(value) else ""


def out_problem(out: Path) -> Optional[str]:
    """Why the table and details cannot be written into ``out`` (creating it if missing), or None: the folder must
    be writable, and each of ``gpu_checks.md`` and ``gpu_checks.json`` absent or an earlier result of this command,
    a regular file that is not a symlink (a write would land wherever the link points)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    for name in ("gpu_checks.md", "gpu_checks.json", "benchmarks.md"):
        path = out / name
        if os.path.islink(path):
            return f"holds {name} as a symlink (to '{os.readlink(path)}'), which a write would follow; remove it"
        if not os.path.lexists(path):
            continue
        try:
            text = read_bounded(path, REPORT_LIMIT, f"Its {name}", OLMoCliError).decode(errors="replace")
            head = TABLE_HEAD if name == "gpu_checks.md" else BENCHMARK_HEAD
            earlier = not text.strip() or (
                text.startswith(head) if name.endswith(".md") else _is_result_list(json.loads(text))
            )
        except (OLMoError, ValueError, RecursionError) as e:
            return str(e).rstrip(".") if isinstance(e, OLMoError) else f"holds a {name} that is not JSON ({e})"
        if not earlier:
            return f"holds a {name} that is not an earlier result of this command, so it is never written over"
    if not os.access(out, os.W_OK | os.X_OK):
        return "is read-only for this user (or on a read-only file system)"
    return None


def _is_result_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(r, dict) and "name" in r and "status" in r for r in value)


def write_tables(out: Path, results: list[Result]) -> str:
    """Write the table, the benchmark rows and the details of ``results`` into ``out``; return the table."""
    table = markdown_table(results)
    atomic_write(out / "benchmarks.md", benchmark_table(results) + "\n")
    atomic_write(out / "gpu_checks.md", table + "\n")  # a rename: never through a link put there since the check
    atomic_write(out / "gpu_checks.json", json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return table
