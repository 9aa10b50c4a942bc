"""The GPU checks' results (:mod:`olmo.bench.gpu_checks`): each part's :class:`Result`, the numbers read from its
report, and the table and details written into ``--out`` (only over an earlier result of the command, never through
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
    r = _object(report.get("results", {}))  # benchmark.py
    return {k: r[k] for k in ("tokens_per_second", "mfu", "peak_memory_mb", "step_time_s") if _is_number(r.get(k))}


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
            if k not in ("tokens_per_second", "mfu", "peak_memory_mb", "step_time_s")
        )
        note = " ".join("; ".join(x for x in (r.note, extra) if x).replace("|", "/").split())  # one row each
        rows.append(f"| {r.name} | {r.what} | {r.status} | {r.seconds:.0f} s | {tps} | {mfu} | {mem} | {note} |")
    return "\n".join(rows)


TABLE_HEAD = "| part | what | status |"


def out_problem(out: Path) -> Optional[str]:
    """Why the table and details cannot be written into ``out`` (creating it if missing), or None: the folder must
    be writable, and each of ``gpu_checks.md`` and ``gpu_checks.json`` absent or an earlier result of this command,
    a regular file that is not a symlink (a write would land wherever the link points)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror or e})"
    for name in ("gpu_checks.md", "gpu_checks.json"):
        path = out / name
        if os.path.islink(path):
            return f"holds {name} as a symlink (to '{os.readlink(path)}'), which a write would follow; remove it"
        if not os.path.lexists(path):
            continue
        try:
            text = read_bounded(path, REPORT_LIMIT, f"Its {name}", OLMoCliError).decode(errors="replace")
            earlier = not text.strip() or (
                text.startswith(TABLE_HEAD) if name.endswith(".md") else _is_result_list(json.loads(text))
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
    """Write the table and the details of ``results`` into ``out``; return the table."""
    table = markdown_table(results)
    atomic_write(out / "gpu_checks.md", table + "\n")  # a rename: never through a link put there since the check
    atomic_write(out / "gpu_checks.json", json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return table
