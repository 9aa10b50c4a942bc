"""Documents tokenized into headerless token memmaps, as ``dolma tokens`` writes them (the code of
``scripts/prepare_memmap_dataset.py``, whose docstring describes the inputs and the output).

:func:`find_inputs` expands the inputs into files, :func:`read_documents` reads the documents of one,
:class:`ShardWriter` appends token arrays to ``part-NNNNN.npy`` files, and :func:`write_memmap_dataset` runs the
whole job into a hidden folder whose part files replace an earlier run's only once every input has been read.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from ..exceptions import OLMoCliError, OLMoDataError
from ..util import nearest_existing, unwritable_reason
from ..util.bounded_files import read_bounded
from ..util.json_lines import json_type, read_json_lines

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

__all__ = [
    "ShardWriter",
    "check_memmap_output",
    "find_inputs",
    "read_documents",
    "split_folders",
    "write_memmap_dataset",
]

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
SPLIT_FOLDERS = ("train", "val")


def check_memmap_output(out: Path, overwrite: bool) -> tuple[Path, list[Path]]:
    """The existing folder to write the run in before it is moved to ``out``, and the part files of an
    earlier run in ``out`` (allowed only with ``--overwrite``).

    :raises OLMoCliError: for an output that cannot be written, or that holds part files without ``overwrite``.
    """
    reason = unwritable_reason(out)
    if reason is not None:
        raise OLMoCliError(f"-o/--output '{out}' cannot be written: {reason}. Pass a folder you can write to.")
    anchor = nearest_existing(out)
    folders = (out, *(out / s for s in SPLIT_FOLDERS))
    old = sorted(p for folder in folders for p in folder.glob("part-*.npy") if p.is_file())
    if old and not overwrite:
        raise OLMoCliError(
            f"-o/--output '{out}' already holds {len(old)} part file(s) of an earlier run ('{old[0]}'"
            f"{' ...' if len(old) > 1 else ''}); a '*.npy' glob would mix them with this run's. Pass "
            f"--overwrite to replace them, or choose a new output folder."
        )
    return anchor, old


def find_inputs(inputs: list[str], pattern: str) -> list[Path]:
    """The files of ``inputs``: files as they are, folders searched recursively for ``pattern`` (``--glob``), and
    globs.

    :raises OLMoCliError: for an input that names no file.
    """
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob(pattern) if p.is_file())
            if not found:
                suffixes = sorted({p.suffix for p in path.rglob("*") if p.is_file() and p.suffix})
                holds = f"it holds {', '.join(suffixes)} files" if suffixes else "it holds no file with a suffix"
                example = f"'*{suffixes[0]}'" if suffixes else "'*.jsonl'"
                raise OLMoCliError(
                    f"Input folder '{item}' has no files matching --glob '{pattern}' ({holds}). Pass the "
                    f"pattern of your files, e.g. --glob {example}."
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            matches = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not matches:
                raise OLMoCliError(f"Input '{item}' is not a file, a directory or a glob that matches files.")
            files.extend(matches)
    return files


MAX_DOCUMENT_BYTES = 64 << 20
"""The most bytes one document may hold: a plain-text file, or one line of a JSON-lines file (64 MiB, some 16 million
tokens, while tokenizing takes about a hundred times a document's size in memory)."""


def read_documents(path: Path, text_key: str) -> Iterator[tuple[str, str]]:
    """(source id, text) for every document in ``path``: the whole file for plain text, the ``text_key`` string of
    every line for JSON lines; each a regular file, a document at most :data:`MAX_DOCUMENT_BYTES`.

    :raises OLMoDataError: for an unreadable file, a document too large, or a JSON line without a string under
        ``text_key``.
    """
    if not path.name.endswith(JSON_SUFFIXES):
        try:
            text = read_bounded(
                path,
                MAX_DOCUMENT_BYTES,
                f"'{path}' (a plain-text file is one document; split a larger corpus into files, or into JSON lines "
                f"of one document each)",
            )
        except OSError as e:
            raise OLMoDataError(
                f"Cannot read '{path}' ({e.strerror or e}). Check that it is a readable file."
            ) from None
        yield str(path), text.decode("utf-8", errors="replace")
        return
    for line_no, doc in read_json_lines(path, MAX_DOCUMENT_BYTES, what="document"):
        if text_key not in doc:
            strings = [k for k, v in doc.items() if isinstance(v, str)]
            raise OLMoDataError(
                f"'{path}' line {line_no} has no '{text_key}' key (its keys: "
                f"{', '.join(repr(k) for k in doc) or 'none'}). Pass --text-key with the key that holds the "
                f"document{f', e.g. --text-key {shlex.quote(strings[0])}' if strings else ''}, or fix the file."
            )
        text = doc[text_key]
        if not isinstance(text, str):
            raise OLMoDataError(
                f"'{path}' line {line_no}: '{text_key}' is {json_type(text)}, not a string. Store each document "
                f"as a string, or pass --text-key with the key that holds it."
            )
        # The 0-based line index keeps the train/val split that earlier versions of this script made.
        yield f"{path}:{line_no - 1}", text


class ShardWriter:
    """Appends token arrays to ``part-NNNNN.npy`` memmaps of at most ``max_tokens`` tokens each."""

    def __init__(self, folder: Path, dtype: np.dtype, max_tokens: int):
        self.folder, self.dtype, self.max_tokens = folder, dtype, max_tokens
        folder.mkdir(parents=True, exist_ok=True)
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.files: list[Path] = []
        self.tokens = 0
        self.documents = 0

    def add(self, ids: list[int]) -> None:
        self.buffer.append(np.asarray(ids, dtype=self.dtype))
        self.buffered += len(ids)
        self.tokens += len(ids)
        self.documents += 1
        if self.buffered >= self.max_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.buffered:
            return
        data = np.concatenate(self.buffer)
        path = self.folder / f"part-{len(self.files):05d}.npy"
        out = np.memmap(path, dtype=self.dtype, mode="w+", shape=(len(data),))
        out[:] = data
        out.flush()
        del out
        self.files.append(path)
        self.buffer, self.buffered = [], 0


def split_folders(root: Path, val_fraction: float) -> dict[str, Path]:
    """The folder of each split under ``root``: ``train/`` and ``val/`` with a ``val_fraction``, else ``root``."""
    return {s: root / s for s in SPLIT_FOLDERS} if val_fraction > 0 else {"train": root}


def tokenize_documents(
    files: list[Path],
    writers: dict[str, ShardWriter],
    tokenizer: Tokenizer,
    text_key: str,
    val_fraction: float,
    batch_size: int,
) -> int:
    """Tokenize every document of ``files``, ``batch_size`` at a time, into the writer of its split (``val`` for a
    ``val_fraction`` of the documents, by a hash of their source); return the empty documents skipped."""

    def split_of(source: str) -> str:
        bucket = int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) / 2**32
        return "val" if bucket < val_fraction else "train"

    skipped = 0
    pending: list[tuple[str, str]] = []

    def encode_pending() -> None:
        for (source, _), ids in zip(pending, tokenizer.encode_batch([t for _, t in pending])):
            writers[split_of(source)].add(ids)
        pending.clear()

    for path in tqdm(files, desc="tokenizing", unit="file"):
        for source, text in read_documents(path, text_key):
            if not text.strip():
                skipped += 1
                continue
            pending.append((source, text.strip()))  # as `dolma tokens` does, so both give the same tokens
            if len(pending) >= batch_size:
                encode_pending()
    encode_pending()
    for writer in writers.values():
        writer.flush()
    return skipped


def check_documents(
    writers: dict[str, ShardWriter], n_files: int, skipped: int, out: Path, val_fraction: float
) -> None:
    """Refuse a run that would leave its output, or one of its splits, without a document.

    :raises OLMoDataError: naming what to change.
    """
    total = sum(w.documents for w in writers.values())
    if total == 0:
        raise OLMoDataError(
            f"The {n_files} input file(s) hold no document ({skipped} empty ones skipped), so nothing was written "
            f"to '{out}'. Check the inputs, and --text-key for JSON lines."
        )
    for name, writer in writers.items():
        if writer.documents == 0:
            raise OLMoDataError(
                f"--val-fraction {val_fraction} put none of the {total} documents in {name}/, so nothing was "
                f"written to '{out}'. Pass a {'larger' if name == 'val' else 'smaller'} --val-fraction, "
                f"or more documents."
            )


def publish(staging: Path, out: Path, old_parts: list[Path]) -> None:
    """Replace ``old_parts`` with the part files written under ``staging``, at the same place under ``out``."""
    for path in old_parts:
        path.unlink()
    for folder in {p.parent for p in old_parts} - {out}:
        with contextlib.suppress(OSError):  # a train/ or val/ that this run does not write, when now empty
            folder.rmdir()
    for path in sorted(staging.rglob("part-*.npy")):
        target = out / path.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)


def write_memmap_dataset(
    files: list[Path],
    out: Path,
    tokenizer: Tokenizer,
    dtype: np.dtype,
    anchor: Path,
    old_parts: list[Path],
    text_key: str = "text",
    val_fraction: float = 0.0,
    max_tokens_per_file: int = 2**29,
    batch_size: int = 64,
) -> tuple[dict[str, ShardWriter], int]:
    """Tokenize the documents of ``files`` into part files under ``out`` (:func:`split_folders`); return the writer
    of each split and the number of empty documents skipped.

    The parts are written into a hidden folder in ``anchor`` (:func:`check_memmap_output`'s) and replace
    ``old_parts`` only once every input has been read, so a failed run leaves ``out`` as it was.

    :raises OLMoDataError: for an unreadable input, or a run that leaves a split without a document.
    """
    staging = Path(tempfile.mkdtemp(prefix=f".{out.resolve().name}.partial-", dir=anchor))
    try:
        folders = split_folders(staging, val_fraction)
        writers = {name: ShardWriter(folder, dtype, max_tokens_per_file) for name, folder in folders.items()}
        skipped = tokenize_documents(files, writers, tokenizer, text_key, val_fraction, batch_size)
        check_documents(writers, len(files), skipped, out, val_fraction)
        publish(staging, out, old_parts)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return writers, skipped
