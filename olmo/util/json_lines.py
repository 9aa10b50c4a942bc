"""Reading JSON-lines files (``.gz`` too) with errors that name the file and the line, each line bounded.

The rule for every user-supplied JSON-lines file (issue 50): only a regular file (or a symlink to one) is opened,
never a FIFO, a device (``/dev/zero``) or a directory (:func:`olmo.util.bounded_files.open_regular`); each line is
read with at most :data:`MAX_LINE_BYTES` bytes (after ``.gz`` decompression; callers may state another limit) and
refused as soon as it is longer, before it is decoded or parsed, so one endless line cannot fill the memory; and a
line whose arrays and objects nest deeper than :data:`MAX_JSON_DEPTH` is refused before :mod:`json` recurses into it.
The whole file may be of any size: lines are read one at a time.

A ``.parquet`` file (a dataset as Hugging Face publishes it) is read as its rows, row *n* (from 1) standing for line
*n*: each row group is read in batches, refused when its uncompressed size passes :data:`MAX_ROW_GROUP_BYTES`, and
a schema nested deeper than :data:`MAX_JSON_DEPTH` is refused before any row is read.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np

from ..exceptions import OLMoDataError
from .bounded_files import open_regular, size_text

log = logging.getLogger(__name__)

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_ROW_GROUP_BYTES",
    "json_depth",
    "json_type",
    "read_json_lines",
    "read_metrics_jsonl",
]


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, with its article, for messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


MAX_LINE_BYTES = 8 << 20
"""The most bytes one line may hold, its newline left out (8 MiB): a conversation of some two million tokens, far
past any sequence length trained on, while tokenizing a line takes about a hundred times its size in memory."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a line may hold (a conversation needs 3: the line, a list of messages, a
message); well below the depth at which Python's parser, or any code walking the value, runs out of stack."""

MAX_ROW_GROUP_BYTES = 2 << 30
"""The largest uncompressed row group of a parquet input (2 GiB; Hugging Face's files hold ~100 MiB ones): a row
group is the unit a reader decodes, so this bounds the memory one takes."""

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+\\?(?:"|\Z)', re.DOTALL)
"""A JSON string, or an unterminated one up to the end (possessive, so matching it is linear in the line)."""
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(line: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``line`` (brackets inside strings not counted)."""
    brackets = np.frombuffer(_STRING.sub(b"", line).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not len(brackets):
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
    return int(steps.cumsum().max())


def _lines(f: BinaryIO, limit: int, where: str, what: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for every line of ``f``, each read with at most ``limit + 1`` bytes."""
    line_no = 0
    while line := f.readline(limit + 1):
        line_no += 1
        if len(line) > limit and not line.endswith(b"\n"):
            raise OLMoDataError(
                f"{where} line {line_no} is longer than {limit:,} bytes ({size_text(limit)}, the limit of one "
                f"line): no {what} trained on is that long. Shorten that line or remove it."
            )
        yield line_no, line


def read_json_lines(
    path: Path, max_line_bytes: Optional[int] = None, max_depth: Optional[int] = None, what: str = "conversation"
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of the JSON-lines file ``path`` (``.gz`` decompressed), each
    line bounded as the module says.

    :param max_line_bytes: the limit of one line; None: :data:`MAX_LINE_BYTES`.
    :param max_depth: the limit of nesting; None: :data:`MAX_JSON_DEPTH`.
    :param what: what one line holds, for the message about a line too long ("conversation", "document").
    :raises OLMoDataError: naming the file (and line) when it is not a regular file, cannot be read, is not gzip though
        named ``.gz``, or has a line that is too long, too deeply nested, not UTF-8 or not a JSON object.
    """
    limit = MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes
    depth_limit = MAX_JSON_DEPTH if max_depth is None else max_depth
    where, line_no = f"'{path}'", 0
    if path.name.endswith(".parquet"):
        yield from _parquet_rows(path, where, depth_limit)
        return
    try:
        with open_regular(path, 1 << 62, where) as raw:
            f: Any = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.endswith(".gz") else raw
            for line_no, line in _lines(f, limit, where, what):
                if line.strip():
                    yield line_no, _parse(line, f"{where} line {line_no}", depth_limit)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        after = f" after line {line_no}" if line_no else ""
        raise OLMoDataError(
            f"{where} is not a complete gzip file ({e}){after}. Recompress it, or drop '.gz' from its name if it is "
            f"not compressed."
        ) from None
    except OSError as e:
        raise OLMoDataError(
            f"Cannot read {where} ({e.strerror or e}). Check that it is a readable file."
        ) from None


def _arrow_depth(arrow_type: Any) -> int:
    """How deep a value of ``arrow_type`` nests lists and structs (a scalar: 0), as JSON would nest them."""
    import pyarrow as pa

    if pa.types.is_struct(arrow_type):
        return 1 + max((_arrow_depth(arrow_type.field(i).type) for i in range(arrow_type.num_fields)), default=0)
    if (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    ):
        return 1 + _arrow_depth(arrow_type.value_type)
    if pa.types.is_map(arrow_type):
        return 2 + _arrow_depth(arrow_type.item_type)
    return 0


def _parquet_rows(path: Path, where: str, depth_limit: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 1, row as a dict) for every row of the parquet file ``path`` (see the module's docstring)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise OLMoDataError(
            f"{where} is a parquet file, which needs pyarrow to be read (pip install pyarrow); or convert it to JSON "
            f"lines (one object per line)."
        ) from None
    row = 0
    try:
        with open_regular(path, 1 << 62, where) as raw:
            table = pq.ParquetFile(raw)
            depth = 1 + max((_arrow_depth(f.type) for f in table.schema_arrow), default=0)
            if depth > depth_limit:
                raise OLMoDataError(
                    f"{where}'s columns nest lists and structs {depth} deep, past the limit of {depth_limit} (a "
                    f"conversation needs 3: the row, a list of messages, a message). Drop the deeply nested columns."
                )
            for group in range(table.num_row_groups):
                size = table.metadata.row_group(group).total_byte_size
                if size > MAX_ROW_GROUP_BYTES:
                    raise OLMoDataError(
                        f"{where}'s row group {group} is {size_text(size)} uncompressed, past the limit of "
                        f"{size_text(MAX_ROW_GROUP_BYTES)} one read may take. Rewrite it with smaller row groups "
                        f"(pyarrow.parquet.write_table(..., row_group_size=10_000)) or as JSON lines."
                    )
                for batch in table.iter_batches(batch_size=256, row_groups=[group]):
                    for record in batch.to_pylist():
                        row += 1
                        yield row, record
    except (pa.ArrowException, OSError) as e:
        after = f" after row {row}" if row else ""
        raise OLMoDataError(
            f"Cannot read {where} as a parquet file ({e}){after}. Check that it is a complete parquet file (as "
            f"downloaded), or give JSON lines."
        ) from None


def _parse(line: bytes, where: str, depth_limit: int) -> dict[str, Any]:
    """The JSON object of one line, its nesting checked first (only when it holds enough brackets to be too deep)."""
    if line.count(b"[") + line.count(b"{") > depth_limit:
        depth = json_depth(line)
        if depth > depth_limit:
            raise OLMoDataError(
                f"{where} nests arrays and objects {depth} deep, past the limit of {depth_limit} (a conversation "
                f"needs 3: the line, a list of messages, a message). Remove the deeply nested values from that line."
            )
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise OLMoDataError(
            f"{where} is not UTF-8 (byte {line[e.start]:#04x} at offset {e.start}). Re-encode the file as UTF-8, "
            f"e.g. with iconv."
        ) from None
    except json.JSONDecodeError as e:
        raise OLMoDataError(
            f"{where} is not valid JSON ({e.msg}, column {e.colno}). Write one JSON object per line (JSON lines, not "
            f"a JSON document), or remove that line."
        ) from None
    if not isinstance(value, dict):
        raise OLMoDataError(f"{where} is {json_type(value)}, not a JSON object. Write one JSON object per line.")
    return value


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
