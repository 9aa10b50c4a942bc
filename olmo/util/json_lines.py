"""Reading JSON-lines files (``.gz`` too) with errors that name the file and the line."""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..exceptions import OLMoDataError

log = logging.getLogger(__name__)

__all__ = ["json_type", "read_json_lines", "read_metrics_jsonl"]


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, with its article, for messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def read_json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSON-lines file, ``.gz`` decompressed.

    :raises OLMoDataError: naming the file (and line) when it cannot be read, is not gzip though named
        ``.gz``, or has a line that is not UTF-8 or not a JSON object.
    """
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    line_no = 0
    try:
        with opener(path, "rb") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"'{path}' line {line_no}"
                try:
                    value = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise OLMoDataError(
                        f"{where} is not UTF-8 (byte {line[e.start]:#04x} at offset {e.start}). Re-encode the "
                        f"file as UTF-8, e.g. with iconv."
                    ) from None
                except json.JSONDecodeError as e:
                    raise OLMoDataError(
                        f"{where} is not valid JSON ({e.msg}, column {e.colno}). Write one JSON object per line "
                        f"(JSON lines, not a JSON document), or remove that line."
                    ) from None
                if not isinstance(value, dict):
                    raise OLMoDataError(
                        f"{where} is {json_type(value)}, not a JSON object. Write one JSON object per line."
                    )
                yield line_no, value
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        after = f" after line {line_no}" if line_no else ""
        raise OLMoDataError(
            f"'{path}' is not a complete gzip file ({e}){after}. Recompress it, or drop '.gz' from its name if "
            f"it is not compressed."
        ) from None
    except OSError as e:
        raise OLMoDataError(
            f"Cannot read '{path}' ({e.strerror or e}). Check that it is a readable file."
        ) from None


def read_metrics_jsonl(path: Path) -> dict[int, dict[str, float]]:
    """A run's ``metrics.jsonl`` as step -> every number logged at that step (``step`` and ``time`` left out). A
    resumed run appends, so a later line wins for a value logged twice at one step. A line that is not a metrics
    record (a crash can cut the last one short) is skipped with a warning, so it does not hide the rest."""
    steps: dict[int, dict[str, float]] = {}
    for line_no, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            log.warning("Skipping line %d of %s: not a metrics record.", line_no, path)
            continue
        values = steps.setdefault(step, {})
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key] = float(value)
    return steps
