"""Tokenize documents into headerless token memmaps that training reads directly.

    python scripts/prepare_memmap_dataset.py INPUT [INPUT ...] -o OUTPUT_DIR [--val-fraction 0.05]

INPUT is a file, a directory (searched recursively with --glob) or a glob. Formats, by suffix:
plain text (``.txt``, ``.md``, ``.py``, ``.rst`` ...: one document per file) and JSON lines
(``.jsonl``, ``.json``, optionally ``.gz``, one JSON object per line whose ``text`` field, or
``--text-key``, is the document: the dolma format). Like ``dolma tokens``, each document is stripped of
surrounding whitespace and followed by EOS. Output files are raw ``np.memmap`` dumps named
``part-00000.npy`` ... (no .npy header, exactly as ``dolma tokens`` writes them); read them with
``np.memmap(path, dtype=..., mode="r")``. With ``--val-fraction`` each document goes, by a hash of
its source, to ``OUTPUT_DIR/train/`` or ``OUTPUT_DIR/val/``.

Every JSON line must be an object holding a string under the text key, and every input must be
readable (``.gz`` files gzip, JSON lines UTF-8); otherwise the run stops with an error naming the file
and line. A run that finds no document, or leaves a split empty, fails too.

Nothing half-made is left behind: the parts are written into a hidden folder next to OUTPUT_DIR (inside
it when it exists) and moved into place only once every input has been read, so a failed run leaves
OUTPUT_DIR as it was (only a killed run leaves its hidden ``.NAME.partial-*`` folder, safe to delete).
OUTPUT_DIR may not already hold ``part-*.npy`` files (in it or in its ``train/``
and ``val/``), which a ``*.npy`` glob would mix with the new ones; ``--overwrite`` deletes those files,
and only those, once the new run has succeeded (so both sets are on disk for a moment).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import logging
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from olmo.exceptions import OLMoCliError, OLMoDataError
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer
from olmo.util import nearest_existing, unwritable_reason
from olmo.util.json_lines import json_type, read_json_lines

log = logging.getLogger("prepare_memmap_dataset")

JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
SPLIT_FOLDERS = ("train", "val")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="files, directories or globs")
    parser.add_argument("-o", "--output", required=True, help="output directory")
    parser.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        help="tokenizer.json path or a file name shipped in ai2-olmo-eval (default: %(default)s)",
    )
    parser.add_argument("--dtype", default="uint16", choices=["uint16", "uint32"])
    parser.add_argument(
        "--glob", default="*.py", help="file pattern inside input directories (default: %(default)s)"
    )
    parser.add_argument(
        "--text-key",
        default="text",
        help="the key of each JSON line that holds its document (default: %(default)s)",
    )
    parser.add_argument(
        "--val-fraction", type=float, default=0.0, help="documents held out to OUTPUT/val/, in [0, 1)"
    )
    parser.add_argument("--max-tokens-per-file", type=int, default=2**29)
    parser.add_argument("--batch-size", type=int, default=64, help="documents tokenized together")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the part-*.npy files an earlier run left in OUTPUT_DIR"
    )
    args = parser.parse_args(argv)
    problems = []
    if not 0 <= args.val_fraction < 1:
        problems.append(f"--val-fraction {args.val_fraction} is not in [0, 1); pass e.g. 0.05 to hold out 5%")
    for flag, value in (("--max-tokens-per-file", args.max_tokens_per_file), ("--batch-size", args.batch_size)):
        if value < 1:
            problems.append(f"{flag} {value} is not a positive number")
    if not args.glob:
        problems.append("--glob is empty; pass a file pattern such as '*.jsonl.gz'")
    if problems:
        parser.error("; ".join(problems))
    return args


def check_output(out: Path, overwrite: bool) -> tuple[Path, list[Path]]:
    """The existing folder to write the run in before it is moved to ``out``, and the part files of an
    earlier run in ``out`` (allowed only with ``--overwrite``)."""
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


def read_documents(path: Path, text_key: str) -> Iterator[tuple[str, str]]:
    """(source id, text) for every document in ``path``."""
    if not path.name.endswith(JSON_SUFFIXES):
        try:
            yield str(path), path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise OLMoDataError(
                f"Cannot read '{path}' ({e.strerror or e}). Check that it is a readable file."
            ) from None
        return
    for line_no, doc in read_json_lines(path):
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


def tokenize(
    files: list[Path], writers: dict[str, ShardWriter], tokenizer: Tokenizer, args: argparse.Namespace
) -> int:
    """Tokenize every document of ``files`` into the writer of its split; return the empty documents skipped."""

    def split_of(source: str) -> str:
        bucket = int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) / 2**32
        return "val" if bucket < args.val_fraction else "train"

    skipped = 0
    pending: list[tuple[str, str]] = []

    def encode_pending() -> None:
        for (source, _), ids in zip(pending, tokenizer.encode_batch([t for _, t in pending])):
            writers[split_of(source)].add(ids)
        pending.clear()

    for path in tqdm(files, desc="tokenizing", unit="file"):
        for source, text in read_documents(path, args.text_key):
            if not text.strip():
                skipped += 1
                continue
            pending.append((source, text.strip()))  # as `dolma tokens` does, so both give the same tokens
            if len(pending) >= args.batch_size:
                encode_pending()
    encode_pending()
    for writer in writers.values():
        writer.flush()
    return skipped


def check_documents(writers: dict[str, ShardWriter], n_files: int, skipped: int, args: argparse.Namespace) -> None:
    """Refuse a run that would leave its output, or one of its splits, without a document."""
    total = sum(w.documents for w in writers.values())
    if total == 0:
        raise OLMoDataError(
            f"The {n_files} input file(s) hold no document ({skipped} empty ones skipped), so nothing was written "
            f"to '{args.output}'. Check the inputs, and --text-key for JSON lines."
        )
    for name, writer in writers.items():
        if writer.documents == 0:
            raise OLMoDataError(
                f"--val-fraction {args.val_fraction} put none of the {total} documents in {name}/, so nothing was "
                f"written to '{args.output}'. Pass a {'larger' if name == 'val' else 'smaller'} --val-fraction, "
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


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.output)
    anchor, old_parts = check_output(out, args.overwrite)
    files = find_inputs(args.inputs, args.glob)
    tokenizer = Tokenizer.from_file(args.tokenizer)
    dtype = np.dtype(args.dtype)
    if tokenizer.vocab_size - 1 > np.iinfo(dtype).max:
        raise OLMoCliError(f"--dtype {args.dtype} cannot hold ids up to {tokenizer.vocab_size - 1}; use uint32.")

    start = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f".{out.resolve().name}.partial-", dir=anchor))
    try:
        folders = {s: staging / s for s in SPLIT_FOLDERS} if args.val_fraction > 0 else {"train": staging}
        writers = {name: ShardWriter(folder, dtype, args.max_tokens_per_file) for name, folder in folders.items()}
        skipped = tokenize(files, writers, tokenizer, args)
        check_documents(writers, len(files), skipped, args)
        publish(staging, out, old_parts)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    elapsed = time.monotonic() - start
    total = sum(w.tokens for w in writers.values())
    for name, w in writers.items():
        log.info(
            "%s: %d documents, %s tokens in %d file(s) under %s",
            name,
            w.documents,
            f"{w.tokens:,}",
            len(w.files),
            out / w.folder.relative_to(staging),
        )
    if old_parts:
        log.info("Replaced %d part file(s) of an earlier run (--overwrite).", len(old_parts))
    log.info(
        "Done: %d input files, %d empty documents skipped, %s tokens (%s) in %.1f s (%s tokens/s).",
        len(files),
        skipped,
        f"{total:,}",
        args.dtype,
        elapsed,
        f"{total / max(elapsed, 1e-9):,.0f}",
    )
    return 0
