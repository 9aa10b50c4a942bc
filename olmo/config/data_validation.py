"""Validation of the data sections: token file dtypes and locations, label masks, the instance filter, remote
reads and mixtures. :func:`olmo.config.validation.validate_train_config` runs it with the rest; what only the files
can show (their sizes, a mixture's feasibility) is checked when the data is built (:mod:`olmo.data`).
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING, Optional

import numpy as np

from ..exceptions import OLMoConfigurationError
from ..util import REMOTE_DATA_SCHEMES, missing_slash_problem, redact_url, split_remote
from .bounds import MAX_TIMEOUT_SECONDS, MAX_WAIT_SECONDS
from .data_sections import DataConfig
from .stages import segment_lengths, stage_data_config

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = ["data_problems", "data_location_problems", "mixture_problems", "MEMMAP_DTYPES"]

log = logging.getLogger(__name__)

MEMMAP_DTYPES = ("uint8", "uint16", "uint32", "uint64")
MAX_REMOTE_CONCURRENCY = 1024
MAX_REMOTE_ATTEMPTS = 1000
"""Beyond this, the doubling backoff (``backoff_seconds * 2**attempt``) no longer fits a float."""


def data_problems(cfg: TrainConfig) -> list[str]:
    """Problems of ``data`` (and of the stages' own mixtures) that the config alone shows."""
    d = cfg.data
    out: list[str] = []
    if d.memmap_dtype not in MEMMAP_DTYPES:
        out.append(f"data.memmap_dtype={d.memmap_dtype!r} must be one of {', '.join(MEMMAP_DTYPES)}.")
    elif cfg.model.vocab_size - 1 > np.iinfo(np.dtype(d.memmap_dtype)).max:
        out.append(
            f"data.memmap_dtype={d.memmap_dtype} cannot hold token ids up to model.vocab_size-1="
            f"{cfg.model.vocab_size - 1}; use --data.memmap_dtype=uint32 (and tokenize with that dtype)."
        )
    if d.paths is not None and d.datasets is not None:
        out.append("data.paths and data.datasets are mutually exclusive; set only one.")
    if d.label_mask_paths is not None:
        n_paths = len(d.paths or [])
        if len(d.label_mask_paths) != n_paths:
            out.append(
                f"data.label_mask_paths has {len(d.label_mask_paths)} entries but data.paths has {n_paths}; "
                f"give exactly one label mask per token file, in the same order."
            )
    if d.num_workers < 0:
        out.append("data.num_workers must be >= 0.")
    if d.mixture is not None:
        out += mixture_problems(d, "data", cfg, _segment_durations(cfg, None))
    for i, stage in enumerate(cfg.stages or []):
        if stage.data is not None:
            try:
                stage_data = stage_data_config(d, stage.data, f"stages[{i}].data")
            except OLMoConfigurationError:
                continue  # reported by the stage checks
            if stage_data.mixture is not None:
                out += mixture_problems(stage_data, f"stages[{i}].data", cfg, _segment_durations(cfg, i))
    out += data_location_problems(d, "data")
    if d.instance_filter is not None:
        out += _instance_filter_problems(cfg)
    if d.custom_dataset is not None:
        out.append(
            f"data.custom_dataset ({d.custom_dataset.module or '?'}.{d.custom_dataset.name}) cannot train with "
            f"scripts/train.py: the trainer's exact data order, resume and global_indices.npy need token memmaps, "
            f"and it would import and run code named by the config (in your own Python loop, "
            f"olmo.data.build_custom_dataset and build_collator build it as OLMo does). Tokenize the data into "
            f"memmaps (dolma tokens or scripts/prepare_memmap_dataset.py), list them in data.paths, and set "
            f"data.custom_dataset to null."
        )
    return out


_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _segment_durations(cfg: TrainConfig, first: Optional[int]) -> list[str]:
    """The lengths that decide the draw of a mixture with null ``tokens`` (see :func:`segment_lengths`), and for
    the run's ``data`` in a staged run its ``max_duration`` too (the stages must add up to it)."""
    out = [str(x) for x in segment_lengths(cfg, first)]
    if cfg.stages and first is None and cfg.max_duration is not None:
        out.append(str(cfg.max_duration))
    return out


def mixture_problems(d: DataConfig, key: str, cfg: TrainConfig, durations: list[str]) -> list[str]:
    """A ``{key}.mixture`` that cannot be a mix whatever the files hold (:mod:`olmo.data.mixture` checks the rest
    once the files' sizes are known).

    :param durations: the lengths that train on this data (see :func:`_segment_durations`); with a null
        ``mixture.tokens`` the draw is what they train, which cannot be known from a length in epochs.
    """
    m, out = d.mixture, list[str]()
    assert m is not None
    where = f"{key}.mixture"
    if d.paths or d.datasets or d.label_mask_paths:
        out.append(
            f"{where} is exclusive with {key}.paths, {key}.datasets and {key}.label_mask_paths: list the files in the "
            f"mixture's sources, and set the others to null."
        )
    if not m.sources:
        out.append(f"{where}.sources is empty: give each source's name, paths and ratio.")
        return out
    names = [s.name for s in m.sources]
    for i, src in enumerate(m.sources):
        at = f"{where}.sources[{i}]"
        if not _SOURCE_NAME.match(src.name) or len(src.name) > 64:
            out.append(f"{at}.name={src.name!r} must be letters, digits, '.', '_' or '-' (it names a metric).")
        if names.count(src.name) > 1 and names.index(src.name) == i:
            out.append(
                f"{where}: the source name {src.name!r} is used {names.count(src.name)} times; names are unique."
            )
        if not src.paths:
            out.append(f"{at} ({src.name!r}) has no paths; list its token files.")
        if not (0 < src.ratio <= 1):
            out.append(f"{at}.ratio={src.ratio} must be in (0, 1].")
        if not (0 < src.max_repetition < math.inf):
            out.append(
                f"{at}.max_repetition={src.max_repetition} must be a positive number (1: each instance once)."
            )
        if src.label_mask_paths is not None and len(src.label_mask_paths) != len(src.paths):
            out.append(
                f"{at}.label_mask_paths has {len(src.label_mask_paths)} entries for {len(src.paths)} paths; give one "
                f"label mask per token file, in the same order."
            )
    masked = [src.label_mask_paths is not None for src in m.sources]
    if any(masked) and not all(masked):
        out.append(
            f"{where}: label masks are given for {sum(masked)} of {len(masked)} sources; give them for every source "
            f"(an all-True mask trains on every token) or for none."
        )
    total = sum(src.ratio for src in m.sources)
    if all(math.isfinite(src.ratio) for src in m.sources) and abs(total - 1) > 1e-6:
        out.append(
            f"{where}: the ratios add up to {total:.6g}, not 1 ({', '.join(f'{s.name} {s.ratio}' for s in m.sources)}); "
            f"they are shares of the drawn tokens."
        )
    chunk = cfg.model.max_sequence_length
    if m.tokens is not None and m.tokens < chunk:
        out.append(f"{where}.tokens={m.tokens} must be at least one instance ({chunk} tokens), or null.")
    in_epochs = [x for x in durations if x.strip().endswith("ep")]
    if m.tokens is None and in_epochs:
        out.append(
            f"{where}.tokens is null, so the mixture draws what its run or stage trains, but that length is "
            f"{in_epochs[0]!r}, in epochs of this very mixture; give {where}.tokens, or the length in steps or "
            f"tokens."
        )
    if m.seed < 0:
        out.append(f"{where}.seed={m.seed} must be >= 0.")
    return out


def data_location_problems(d: DataConfig, key: str) -> list[str]:
    """Problems with where the data config ``key`` reads its files: URL schemes that are not read by byte range,
    and ``{key}.remote`` and ``{key}.timeout`` values that cannot work."""
    out: list[str] = []
    lists = {f"{key}.paths": d.paths, f"{key}.label_mask_paths": d.label_mask_paths}
    lists.update({f"{key}.datasets.{label}": paths for label, paths in (d.datasets or {}).items()})
    for i, src in enumerate(d.mixture.sources if d.mixture is not None else []):
        lists[f"{key}.mixture.sources[{i}].paths"] = src.paths
        lists[f"{key}.mixture.sources[{i}].label_mask_paths"] = src.label_mask_paths
    for list_key, paths in lists.items():
        for i, path in enumerate(paths or []):
            typo = missing_slash_problem(str(path), f"{list_key}[{i}]")
            if typo is not None:
                out.append(typo)
                continue
            scheme = split_remote(str(path))[0]
            if scheme and scheme != "file" and scheme not in REMOTE_DATA_SCHEMES:
                out.append(
                    f"{list_key}[{i}]={redact_url(str(path))!r}: {scheme}:// URLs cannot be read by byte range. Use "
                    f"{', '.join(s + '://' for s in REMOTE_DATA_SCHEMES)}, a file:// URL or a local path (download "
                    f"the file first)."
                )
    r = d.remote
    for name in ("max_concurrency", "prefetch_bytes", "max_attempts"):
        if getattr(r, name) < 1:
            out.append(f"{key}.remote.{name}={getattr(r, name)} must be at least 1.")
    if r.max_concurrency > MAX_REMOTE_CONCURRENCY:
        out.append(
            f"{key}.remote.max_concurrency={r.max_concurrency} would start that many threads and connections in every "
            f"loader process; use at most {MAX_REMOTE_CONCURRENCY} (64 already fetch ~1,200 instances/s at 50 ms)."
        )
    if r.max_attempts > MAX_REMOTE_ATTEMPTS:
        out.append(
            f"{key}.remote.max_attempts={r.max_attempts} is more than {MAX_REMOTE_ATTEMPTS}; a file that fails that "
            f"often is not coming back (10, the default, rides out about two minutes of outage)."
        )
    if not 0 <= r.backoff_seconds <= MAX_WAIT_SECONDS:
        out.append(
            f"{key}.remote.backoff_seconds={r.backoff_seconds} must be from 0 to {MAX_WAIT_SECONDS:g} seconds (an "
            f"hour): the wait before the first retry, doubled before each later one (0.5 is the default)."
        )
    if not 0 < r.max_backoff_seconds <= MAX_WAIT_SECONDS:
        out.append(
            f"{key}.remote.max_backoff_seconds={r.max_backoff_seconds} must be above 0 and at most "
            f"{MAX_WAIT_SECONDS:g} seconds (an hour): the longest wait between two tries, during which the process "
            f"does not stop when asked to (30 is the default)."
        )
    if not 0 < r.timeout_seconds <= MAX_TIMEOUT_SECONDS:
        out.append(
            f"{key}.remote.timeout_seconds={r.timeout_seconds} must be above 0 and at most {MAX_TIMEOUT_SECONDS:g} "
            f"seconds (a day): how long one request waits for the server (60 is the default)."
        )
    if not 0 <= d.timeout <= MAX_TIMEOUT_SECONDS:
        out.append(
            f"{key}.timeout={d.timeout} must be a number of seconds from 0 (wait forever) to {MAX_TIMEOUT_SECONDS:g} "
            f"(a day): how long the DataLoader waits for a worker's batch."
        )
    return out


def _instance_filter_problems(cfg: TrainConfig) -> list[str]:
    f = cfg.data.instance_filter
    assert f is not None
    defaults = type(f)()
    out = [
        f"data.instance_filter.{name}={getattr(f, name)} must be a positive number of {unit}; set it to one, "
        f"e.g. OLMo's default {getattr(defaults, name)}."
        for name, unit in (
            ("repetition_min_period", "tokens"),
            ("repetition_max_period", "tokens"),
            ("repetition_max_count", "repeats"),
        )
        if getattr(f, name) <= 0
    ]
    if not out and f.repetition_min_period > f.repetition_max_period:
        out.append(
            f"data.instance_filter.repetition_min_period={f.repetition_min_period} is above repetition_max_period="
            f"{f.repetition_max_period}, so no pattern length is checked and nothing is ever filtered. Swap them, "
            f"or set data.instance_filter to null to turn the filter off."
        )
    elif not out and f.repetition_max_count < 3:
        log.warning(
            "data.instance_filter.repetition_max_count=%d acts as 3: the repetition detector (as in OLMo) only sees "
            "patterns repeated at least 3 times.",
            f.repetition_max_count,
        )
    return out
