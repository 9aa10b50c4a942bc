"""Scan token files fully, report their statistics, and exit non-zero if training would reject them.

    python scripts/validate_data.py CONFIG.yaml [--key.path=value ...]
    python scripts/validate_data.py TOKENS.npy [...] [--dtype uint16] [--vocab-size V] [--eos ID] \\
        [--seq-len T] [--label-masks MASK.npy ...]

With a config, the files are its ``data.paths`` (or ``data.datasets``) and ``data.label_mask_paths``, and
dtype, vocabulary size, EOS id and sequence length come from ``data.memmap_dtype`` and ``model.*``; the
flags override them. Without a vocabulary size, ids are only checked against the dtype.

Per file and in total: tokens; the smallest dtype that holds the ids; id range and the count of ids
>= the vocabulary size; EOS count and frequency; document lengths (tokens up to and including each EOS:
percentiles, plus a histogram of all files); instances of ``--seq-len`` tokens and the tail tokens
dropped; for label masks, the fraction True.

Files are read exactly as training reads them (through :class:`olmo.data.MemMapDataset`): a file written
by ``np.save`` is noted in the log and read from after its npy header. The checks training makes before
it starts are those of :meth:`olmo.data.MemMapDataset.validate` (missing or unreadable files and
directories, file sizes, dtype and npy headers, empty files, ids, mask lengths, masks without a True):
a label mask without a True is a warning; every problem, no True in any label mask included, is listed
and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from olmo.config import TrainConfig
from olmo.config.data_sections import MEMMAP_DTYPES
from olmo.data import MemMapDataset, build_memmap_dataset
from olmo.exceptions import OLMoCliError, OLMoDataError, OLMoError

log = logging.getLogger("validate_data")

CHUNK_TOKENS = 2**23
"""Tokens (or mask entries) read per step where validate() does not read them (bounds memory; large enough that
numpy's per-call cost is negligible)."""
PERCENTILES = (10, 50, 90, 99)


@dataclass
class FileStats:
    path: str
    tokens: int = 0
    min_id: int = 0
    max_id: int = 0
    over_vocab: int = 0
    zeros: int = 0
    eos: int = 0
    doc_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Tokens of every document that ends with EOS (the EOS included)."""
    mask_true: Optional[int] = None
    mask_tokens: Optional[int] = None


class Scan:
    """The statistics of every file, gathered while :meth:`MemMapDataset.validate` reads the ids.

    validate() calls it (as ``on_chunk``) with every chunk of ids it reads, so the checks and the statistics
    read the files once; :meth:`finish` reads only what validate() did not: files it rejects before reading
    their ids (which training never reads either), and the label masks.

    :param total: tokens plus label mask entries to read, for the progress bar.
    """

    def __init__(self, dataset: MemMapDataset, vocab: int, eos: int, total: int):
        self.dataset, self.vocab, self.eos, self.total = dataset, vocab, eos, total
        self.files: dict[int, FileStats] = {}
        self.eos_offsets: dict[int, list[np.ndarray]] = {}
        self.progress: Optional[tqdm] = None

    def __call__(self, i: int, start: int, chunk: np.ndarray) -> None:
        """Count the ids ``chunk`` of file ``i``, which start at its token ``start`` (a file's chunks come in order)."""
        s = self._file(i)
        s.tokens += len(chunk)
        s.min_id, s.max_id = min(s.min_id, int(chunk.min())), max(s.max_id, int(chunk.max()))
        if s.max_id >= self.vocab:
            s.over_vocab += int(np.count_nonzero(chunk >= self.vocab))
        s.zeros += len(chunk) - int(np.count_nonzero(chunk))
        self.eos_offsets[i].append(np.flatnonzero(chunk == self.eos) + start)
        self._advance(len(chunk))

    def finish(self) -> list[FileStats]:
        """The statistics of every file whose ids can be read, in order, with its label mask's."""
        out = []
        for i in range(len(self.dataset.paths)):
            if i not in self.files and not self._read(i):
                continue
            s = self.files[i]
            ends = np.concatenate(self.eos_offsets[i]) if self.eos_offsets[i] else np.zeros(0, np.int64)
            s.eos, s.doc_lengths = len(ends), np.diff(ends, prepend=-1)
            if self.dataset.label_mask_paths is not None:
                with contextlib.suppress(OSError, OLMoError):
                    mask = self.dataset.label_mask(i)
                    s.mask_tokens, s.mask_true = len(mask), 0
                    for start in range(0, len(mask), CHUNK_TOKENS):
                        s.mask_true += int(np.count_nonzero(mask[start : start + CHUNK_TOKENS]))
                        self._advance(min(CHUNK_TOKENS, len(mask) - start))
            out.append(s)
        if self.progress is not None:
            self.progress.close()
        return out

    def _file(self, i: int) -> FileStats:
        if i not in self.files:
            self.files[i] = FileStats(self.dataset.paths[i], min_id=int(np.iinfo(self.dataset.dtype).max))
            self.eos_offsets[i] = []
        return self.files[i]

    def _read(self, i: int) -> bool:
        """Scan file ``i``, which validate() did not read; False when its ids cannot be read (validate() says why)."""
        try:
            tokens = self.dataset.tokens(i)
        except (OSError, OLMoError):
            return False
        self._file(i)
        for start in range(0, len(tokens), CHUNK_TOKENS):
            self(i, start, np.asarray(tokens[start : start + CHUNK_TOKENS]))
        return True

    def _advance(self, n: int) -> None:
        # Shown from the first chunk on, so the warnings validate() logs before it reads ids stay readable.
        if self.progress is None:
            self.progress = tqdm(total=self.total, desc="scanning", unit="tok", unit_scale=True)
        self.progress.update(n)


def smallest_dtype(max_id: int) -> str:
    return next(d for d in MEMMAP_DTYPES if max_id <= np.iinfo(d).max)


def histogram(lengths: np.ndarray, width: int = 40) -> list[str]:
    """Document lengths in power-of-two buckets, one text bar per bucket."""
    top = max(1, int(np.ceil(np.log2(lengths.max() + 1))))
    counts, edges = np.histogram(lengths, bins=2 ** np.arange(top + 1))
    lines = []
    for count, lo, hi in zip(counts, edges[:-1], edges[1:]):
        bar = "█" * round(width * count / counts.max())
        label = f"{lo:,}" if hi - lo == 1 else f"{lo:,}–{hi - 1:,}"
        lines.append(f"{label:>17} {bar:<{width}} {100 * count / len(lengths):5.1f}% ({count:,})")
    return lines


def combine(all_stats: list[FileStats], dtype: np.dtype) -> FileStats:
    """The statistics of all files together."""
    total = FileStats("TOTAL", min_id=int(np.iinfo(dtype).max))
    for s in all_stats:
        total.min_id, total.max_id = min(total.min_id, s.min_id), max(total.max_id, s.max_id)
        for name in ("tokens", "over_vocab", "zeros", "eos"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        if s.mask_tokens is not None:
            total.mask_tokens = (total.mask_tokens or 0) + s.mask_tokens
            total.mask_true = (total.mask_true or 0) + (s.mask_true or 0)
    if all_stats:
        total.doc_lengths = np.concatenate([s.doc_lengths for s in all_stats])
    return total


def report(all_stats: list[FileStats], dtype: np.dtype, vocab: Optional[int], eos: int, seq_len: int) -> None:
    """Print a table of every file and the total, then the document lengths of all files."""
    table = Table(title=f"dtype {dtype.name}, vocab {vocab or 'unchecked'}, eos {eos}, seq_len {seq_len}")
    columns = ["file", "tokens", "fits", "ids", ">= vocab", "EOS (1 per)", "docs p50/p90/max"]
    for name in [*columns, "instances", "tail dropped", "label True"]:
        table.add_column(name, justify="left" if name == "file" else "right", overflow="fold")
    total = combine(all_stats, dtype)
    for s in [*all_stats, total]:
        docs = "-"
        if len(s.doc_lengths):
            docs = "/".join(f"{v:,.0f}" for v in np.percentile(s.doc_lengths, [50, 90, 100]))
        per_file = all_stats if s is total else [s]
        table.add_row(
            s.path,
            f"{s.tokens:,}",
            smallest_dtype(s.max_id) if s.tokens else "-",
            f"{s.min_id:,}–{s.max_id:,}" if s.tokens else "-",
            f"{s.over_vocab:,}" if vocab else "-",
            f"{s.eos:,} ({s.tokens / s.eos:,.0f})" if s.eos else "0",
            docs,
            f"{sum(f.tokens // seq_len for f in per_file):,}",
            f"{sum(f.tokens % seq_len for f in per_file):,}",
            f"{100 * (s.mask_true or 0) / s.mask_tokens:.1f}%" if s.mask_tokens else "-",
            end_section=bool(all_stats) and s is all_stats[-1],
        )
    # Off a terminal rich assumes 80 columns, too few for this table; logs and pipes get a wide one.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    lengths = total.doc_lengths
    if len(lengths):
        stats = ", ".join(f"p{p} {v:,.0f}" for p, v in zip(PERCENTILES, np.percentile(lengths, PERCENTILES)))
        console.print(
            f"{len(lengths):,} documents ending in EOS: min {lengths.min():,}, {stats}, max {lengths.max():,}, "
            f"mean {lengths.mean():,.1f} tokens",
            highlight=False,
        )
        console.print("\n".join(histogram(lengths)), highlight=False)


def warnings_about(s: FileStats, dtype: np.dtype, eos: int) -> list[str]:
    """Signs of a mistake that training would not reject."""
    out = []
    if s.tokens and not s.eos:
        out.append(f"'{s.path}' holds no EOS token (id {eos}): documents run together, or --eos is wrong.")
    if s.tokens and s.zeros > s.tokens / 4:
        out.append(
            f"{100 * s.zeros / s.tokens:.0f}% of the ids in '{s.path}' are 0: it may have been written with a "
            f"wider dtype than {dtype.name} (set --dtype / data.memmap_dtype to the one it was written with)."
        )
    return out


def build_dataset(args: argparse.Namespace, extra: list[str]) -> tuple[MemMapDataset, Optional[int], int]:
    """The files to check as a MemMapDataset, with the vocabulary size and EOS id to check them against."""
    first = Path(args.inputs[0])
    if first.suffix in (".yaml", ".yml"):
        if len(args.inputs) > 1 or args.label_masks:
            raise OLMoCliError("Pass either one config YAML or token files (with --label-masks), not both.")
        cfg = TrainConfig.load(first, extra)
        files = build_memmap_dataset(cfg, cfg.data, include_instance_metadata=False)
        paths, masks = files.paths, files.label_mask_paths
        dtype, seq_len = args.dtype or cfg.data.memmap_dtype, args.seq_len or cfg.model.max_sequence_length
        vocab = args.vocab_size or cfg.model.vocab_size
        eos = args.eos if args.eos is not None else cfg.model.eos_token_id
    else:
        if extra:
            raise OLMoCliError(f"Unknown option(s) {extra}; config overrides (--key=value) need a config YAML.")
        if args.label_masks and len(args.label_masks) != len(args.inputs):
            raise OLMoCliError(
                f"--label-masks lists {len(args.label_masks)} files for {len(args.inputs)} token files; give one "
                f"mask per token file, in the same order."
            )
        paths, masks, dtype = args.inputs, args.label_masks, args.dtype or "uint16"
        seq_len, vocab, eos = args.seq_len or 2048, args.vocab_size, 50279 if args.eos is None else args.eos
    dataset = MemMapDataset(*paths, chunk_size=seq_len, memmap_dtype=dtype, label_mask_paths=masks)
    return dataset, vocab, eos


def _file_tokens(dataset: MemMapDataset, i: int) -> int:
    """Tokens in file ``i`` for the progress bar (0 when it cannot be read; validate() says why)."""
    try:
        return len(dataset.tokens(i))
    except (OSError, OLMoError):
        return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="a training config YAML, or token files")
    parser.add_argument("--dtype", choices=MEMMAP_DTYPES, default=None, help="token dtype (default uint16)")
    parser.add_argument("--vocab-size", type=int, default=None, help="ids must be below this")
    parser.add_argument("--eos", type=int, default=None, help="EOS id that ends documents (default 50279)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per instance (default 2048)")
    parser.add_argument("--label-masks", nargs="+", default=None, help="one bool mask per token file")
    args, extra = parser.parse_known_args(argv)
    if any(not a.startswith("--") for a in extra):
        raise OLMoCliError(f"Unexpected argument(s) {extra}; put options after the file names.")
    if args.seq_len is not None and args.seq_len <= 0:
        raise OLMoCliError(f"--seq-len {args.seq_len} must be positive.")
    dataset, vocab, eos = build_dataset(args, extra)
    dtype = dataset.dtype
    # Without a vocabulary the ids are only bounded by the dtype (2**63 keeps uint64 comparisons exact).
    check_vocab = vocab if vocab is not None else min(int(np.iinfo(dtype).max) + 1, 2**63)
    log.info(
        "Checking %d file(s) as training does (MemMapDataset.validate), reading them fully.", len(dataset.paths)
    )
    sizes = [_file_tokens(dataset, i) for i in range(len(dataset.paths))]
    scan = Scan(dataset, check_vocab, eos, sum(sizes) * (2 if dataset.label_mask_paths else 1))
    problems = None
    try:
        dataset.validate(check_vocab, scan_max_tokens=2**62, on_chunk=scan, scan_remote=True)
    except OLMoDataError as e:
        problems = str(e)
    all_stats = scan.finish()
    report(all_stats, dtype, vocab, eos, dataset.chunk_size)
    for warning in (w for stats in all_stats for w in warnings_about(stats, dtype, eos)):
        log.warning(warning)
    if vocab is not None and vocab - 1 > np.iinfo(dtype).max:
        log.warning(
            "The vocabulary has %d ids but %s holds ids only up to %d: the files cannot hold this tokenizer's ids. "
            "Use the dtype they were written with (--dtype / data.memmap_dtype).",
            vocab,
            dtype.name,
            np.iinfo(dtype).max,
        )
    if problems is not None:
        if Path(args.inputs[0]).suffix not in (".yaml", ".yml"):
            problems += (
                " (For token files given directly: model.vocab_size is --vocab-size, data.memmap_dtype is --dtype, "
                "model.max_sequence_length is --seq-len and data.label_mask_paths is --label-masks.)"
            )
        raise OLMoDataError(problems)
    log.info("%d file(s), %s tokens: valid.", len(all_stats), f"{sum(s.tokens for s in all_stats):,}")
    return 0
