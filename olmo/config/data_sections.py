"""The data sections of a run's configuration: ``DataConfig`` (token files, a mixture of sources, the instance
filter, how remote files are read, OLMo's custom dataset hook), each with the checks of what the config alone shows.
What only the files can show (their sizes, a mixture's feasibility) is checked when the data is built
(:mod:`olmo.data`). An evaluator's data is a ``DataConfig`` too (:mod:`olmo.config.eval_sections`).

Import them from :mod:`olmo.config`, which re-exports all of them.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..util import REMOTE_DATA_SCHEMES, missing_slash_problem, redact_url, split_remote
from .base import BaseConfig
from .bounds import MAX_TIMEOUT_SECONDS, MAX_WAIT_SECONDS
from .sections import PaddingDirection

__all__ = [
    "InstanceFilterConfig",
    "RemoteDataConfig",
    "CustomDatasetCollatorConfig",
    "CustomDatasetConfig",
    "MixtureSourceConfig",
    "MixtureConfig",
    "DataConfig",
    "MEMMAP_DTYPES",
]

log = logging.getLogger(__name__)

MEMMAP_DTYPES = ("uint8", "uint16", "uint32", "uint64")
MAX_REMOTE_CONCURRENCY = 1024
MAX_REMOTE_ATTEMPTS = 1000
"""Beyond this, the doubling backoff (``backoff_seconds * 2**attempt``) no longer fits a float."""


@dataclass
class InstanceFilterConfig:
    """OLMo's repetition filter: an instance that repeats a short pattern back to back too often is still read
    but trained on with no loss, and logged (``train/FilteredInstances``, ``data-indices/filtered/``)."""

    repetition_max_period: int = 13
    """Longest repeated pattern the filter looks for, in tokens."""
    repetition_min_period: int = 1
    """Shortest repeated pattern the filter looks for, in tokens."""
    repetition_max_count: int = 32
    """Drop an instance that repeats a pattern this many times in a row (values below 3 act as 3)."""

    def problems(self) -> list[str]:
        """One sentence per value of ``data.instance_filter`` that cannot work; a count below 3 only warns."""
        defaults = type(self)()
        out = [
            f"data.instance_filter.{name}={getattr(self, name)} must be a positive number of {unit}; set it to "
            f"one, e.g. OLMo's default {getattr(defaults, name)}."
            for name, unit in (
                ("repetition_min_period", "tokens"),
                ("repetition_max_period", "tokens"),
                ("repetition_max_count", "repeats"),
            )
            if getattr(self, name) <= 0
        ]
        if not out and self.repetition_min_period > self.repetition_max_period:
            out.append(
                f"data.instance_filter.repetition_min_period={self.repetition_min_period} is above "
                f"repetition_max_period={self.repetition_max_period}, so no pattern length is checked and nothing "
                f"is ever filtered. Swap them, or set data.instance_filter to null to turn the filter off."
            )
        elif not out and self.repetition_max_count < 3:
            log.warning(
                "data.instance_filter.repetition_max_count=%d acts as 3: the repetition detector (as in OLMo) only "
                "sees patterns repeated at least 3 times.",
                self.repetition_max_count,
            )
        return out


@dataclass
class RemoteDataConfig:
    """How token files at URLs (``http(s)://``, ``s3://``, ``r2://``, ``weka://``, ``gs://``) are read: in place,
    by byte range, fetched ahead of use (see docs/data.md, "Remote data"). Local files ignore it. Every loader
    process (the training process, or each DataLoader worker) has its own connections and budget."""

    max_concurrency: int = 64
    """Requests in flight at once per loader process, and connections kept open for reuse; also how many
    files' sizes are requested at once at startup. At 50 ms per request, 64 fetch ~1,200 instances/s."""
    prefetch_bytes: int = 64 * 2**20
    """Memory per loader process for instances fetched ahead of use (as the int64 tensors they become): the
    read-ahead window is this divided by an instance's size, at least one instance."""
    max_attempts: int = 10
    """Tries per request before the run stops with an error naming the URL and byte range. Transient
    failures (5xx, 429, resets, timeouts, short bodies) are retried; a missing file or denied access is not.
    At most 1000."""
    backoff_seconds: float = 0.5
    """Wait before the first retry (with jitter), doubled before each later one, up to ``max_backoff_seconds``.
    From 0 to 3600 (an hour)."""
    max_backoff_seconds: float = 30.0
    """The longest wait between two tries: above 0 and at most 3600 (an hour), since a process asleep in a
    backoff does not stop when asked to (SIGTERM) until it wakes."""
    timeout_seconds: float = 30.0
    """Seconds to connect, and to wait for each read of an answer, before a try counts as failed: above 0 and at
    most 86400 (a day: a server silent that long is gone). Two tries in a row that time out end the retries (a
    server that accepts connections and never answers), so a silent server is given up after about a minute."""

    def problems(self, key: str) -> list[str]:
        """One sentence per value of this section, at ``key`` (``data.remote``), that cannot work."""
        out: list[str] = []
        for name in ("max_concurrency", "prefetch_bytes", "max_attempts"):
            if getattr(self, name) < 1:
                out.append(f"{key}.{name}={getattr(self, name)} must be at least 1.")
        if self.max_concurrency > MAX_REMOTE_CONCURRENCY:
            out.append(
                f"{key}.max_concurrency={self.max_concurrency} would start that many threads and connections in "
                f"every loader process; use at most {MAX_REMOTE_CONCURRENCY} (64 already fetch ~1,200 instances/s at "
                f"50 ms)."
            )
        if self.max_attempts > MAX_REMOTE_ATTEMPTS:
            out.append(
                f"{key}.max_attempts={self.max_attempts} is more than {MAX_REMOTE_ATTEMPTS}; a file that fails that "
                f"often is not coming back (10, the default, rides out about two minutes of outage)."
            )
        if not 0 <= self.backoff_seconds <= MAX_WAIT_SECONDS:
            out.append(
                f"{key}.backoff_seconds={self.backoff_seconds} must be from 0 to {MAX_WAIT_SECONDS:g} seconds (an "
                f"hour): the wait before the first retry, doubled before each later one (0.5 is the default)."
            )
        if not 0 < self.max_backoff_seconds <= MAX_WAIT_SECONDS:
            out.append(
                f"{key}.max_backoff_seconds={self.max_backoff_seconds} must be above 0 and at most "
                f"{MAX_WAIT_SECONDS:g} seconds (an hour): the longest wait between two tries, during which the "
                f"process does not stop when asked to (30 is the default)."
            )
        if not 0 < self.timeout_seconds <= MAX_TIMEOUT_SECONDS:
            out.append(
                f"{key}.timeout_seconds={self.timeout_seconds} must be above 0 and at most {MAX_TIMEOUT_SECONDS:g} "
                f"seconds (a day): how long one request waits for the server (60 is the default)."
            )
        return out


@dataclass
class CustomDatasetCollatorConfig:
    """Field names of a custom dataset's items (OLMo's ``CustomDatasetCollatorConfig``), which
    :class:`olmo.data.CustomDatasetDataCollator` maps to the model's names (see ``DataConfig.custom_dataset``)."""

    input_id_field: str = "input_ids"
    """Item key holding the token ids."""
    attention_mask_field: Optional[str] = None
    """Item key holding the attention mask."""
    attention_bias_field: Optional[str] = None
    """Item key holding the attention bias."""
    label_mask_field: Optional[str] = None
    """Item key holding the label mask."""
    index_field: Optional[str] = None
    """Item key holding the instance index."""
    instance_mask_field: Optional[str] = None
    """Item key holding the instance mask."""
    doc_lens_field: Optional[str] = None
    """Item key holding the document lengths."""
    metadata_field: Optional[str] = None
    """Item key holding the metadata."""


@dataclass
class CustomDatasetConfig:
    """OLMo's custom dataset: a class ``name`` imported from ``module`` and built with ``args``
    (:func:`olmo.data.build_custom_dataset`); training from ``scripts/train.py`` refuses it (see
    ``DataConfig.custom_dataset``)."""

    name: str = "???"
    """The dataset class (or function) name."""
    module: Optional[str] = None
    """The module to import it from."""
    args: Optional[dict[str, Any]] = None
    """Keyword arguments for it."""
    collate_fn: Optional[str] = None
    """A collate function, by import path."""
    token_field: Optional[str] = None
    """The item key holding the tokens."""
    collate_config: Optional[CustomDatasetCollatorConfig] = field(default_factory=CustomDatasetCollatorConfig)
    """Field names of the items."""


@dataclass
class MixtureSourceConfig:
    name: str = "???"
    """The source's name: letters, digits, '.', '_' or '-' (it names the metric ``train/{name}/CrossEntropyLoss``)."""
    paths: list[str] = field(default_factory=list)
    """Its token files, as in ``data.paths`` (globs and URLs allowed)."""
    ratio: float = "???"  # type: ignore[assignment]
    """Its share of the drawn tokens; the ratios of all sources add up to 1."""
    max_repetition: float = 1.0
    """How many times over its instances may be drawn at most (1: each at most once)."""
    label_mask_paths: Optional[list[str]] = None
    """One bool memmap per token file, as ``data.label_mask_paths``; give them for every source or for none."""


@dataclass
class MixtureConfig:
    seed: int = 0
    """Seed of which instances of a source are drawn (a source drawn less than once over, or a fraction over)."""
    tokens: Optional[int] = None
    """Tokens to draw in all; null: what ``max_duration`` trains on (its steps times the global batch)."""
    sources: list[MixtureSourceConfig] = field(default_factory=list)
    """The sources, each with its token files, its ratio and its repetition allowance."""

    def problems(self, where: str, sequence_length: int, durations: list[str]) -> list[str]:
        """What makes the mixture at ``where`` (``data.mixture``) no mix whatever the files hold
        (:mod:`olmo.data.mixture` checks the rest once the files' sizes are known).

        :param sequence_length: ``model.max_sequence_length``, the tokens of one instance.
        :param durations: the lengths that train on this mixture; with a null ``tokens`` the draw is what they
            train, which cannot be known from a length in epochs.
        """
        out: list[str] = []
        if not self.sources:
            out.append(f"{where}.sources is empty: give each source's name, paths and ratio.")
            return out
        names = [s.name for s in self.sources]
        for i, src in enumerate(self.sources):
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
                    f"{at}.label_mask_paths has {len(src.label_mask_paths)} entries for {len(src.paths)} paths; give "
                    f"one label mask per token file, in the same order."
                )
        masked = [src.label_mask_paths is not None for src in self.sources]
        if any(masked) and not all(masked):
            out.append(
                f"{where}: label masks are given for {sum(masked)} of {len(masked)} sources; give them for every "
                f"source (an all-True mask trains on every token) or for none."
            )
        total = sum(src.ratio for src in self.sources)
        if all(math.isfinite(src.ratio) for src in self.sources) and abs(total - 1) > 1e-6:
            ratios = ", ".join(f"{s.name} {s.ratio}" for s in self.sources)
            out.append(
                f"{where}: the ratios add up to {total:.6g}, not 1 ({ratios}); they are shares of the drawn tokens."
            )
        if self.tokens is not None and self.tokens < sequence_length:
            out.append(
                f"{where}.tokens={self.tokens} must be at least one instance ({sequence_length} tokens), or null."
            )
        in_epochs = [x for x in durations if x.strip().endswith("ep")]
        if self.tokens is None and in_epochs:
            out.append(
                f"{where}.tokens is null, so the mixture draws what its run or stage trains, but that length is "
                f"{in_epochs[0]!r}, in epochs of this very mixture; give {where}.tokens, or the length in steps or "
                f"tokens."
            )
        if self.seed < 0:
            out.append(f"{where}.seed={self.seed} must be >= 0.")
        return out


_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""A mixture source's name: it names a metric (``train/{name}/CrossEntropyLoss``)."""


@dataclass
class DataConfig(BaseConfig):
    paths: Optional[list[str]] = None
    """Token memmaps (local paths or ``http(s)``/``s3``/``r2``/``weka``/``gs`` URLs, read in place by byte range),
    headerless, as written by ``dolma tokens``. A file written by ``np.save`` is read from after its npy header
    (whose dtype must be ``memmap_dtype``)."""
    memmap_dtype: str = "uint16"
    """numpy dtype of the token files: uint8, uint16, uint32 or uint64 (see :attr:`effective_memmap_dtype`)."""
    datasets: Optional[dict[str, list[str]]] = None
    """Label -> token files (used by evaluators); exclusive with ``paths``."""
    label_mask_paths: Optional[list[str]] = None
    """One bool memmap per path; False positions get no loss (fine-tuning)."""
    pad_direction: PaddingDirection = PaddingDirection.right
    """Where the collator pads instances shorter than the longest in a batch: ``right`` or ``left``."""
    generate_attention_mask: bool = False
    """Build an attention mask from ``pad_token_id`` positions."""
    generate_doc_lengths: bool = False
    """Give the model each instance's document lengths (split after every ``model.eos_token_id``), so that
    attention stays within a document; off by default (tokens attend across documents)."""
    num_workers: int = 0
    """DataLoader worker processes."""
    drop_last: bool = False
    """Accepted for OLMo compatibility: training always drops the last partial global batch."""
    pin_memory: Optional[bool] = None
    """Pin batches in page-locked memory so host-to-GPU copies run asynchronously (the trainer copies with
    ``non_blocking=True``). None: pin when CUDA is available. Ignored without CUDA."""
    prefetch_factor: Optional[int] = None
    """Batches each DataLoader worker loads ahead; None is PyTorch's default (ignored without workers)."""
    persistent_workers: bool = False
    """OLMo's DataLoader option. Mapped onto ours: workers live for a whole epoch either way and restart at an
    epoch boundary, so they read the new epoch's data order (persistent ones would keep the old one)."""
    timeout: int = 0
    """Seconds the DataLoader waits for a worker's batch before failing; 0 waits forever. At most 86400 (a day)."""
    seed: Optional[int] = None
    """Data-order seed; None means ``TrainConfig.seed``."""
    instance_filter: Optional[InstanceFilterConfig] = None
    """Drop instances that repeat a short pattern too often (see ``InstanceFilterConfig``); null: keep all."""
    remote: RemoteDataConfig = field(default_factory=RemoteDataConfig)
    """How files at URLs are read: concurrency, read-ahead memory, retries and timeouts (see ``RemoteDataConfig``)."""
    mixture: Optional[MixtureConfig] = None
    """Sources mixed by target token ratios (see ``MixtureConfig`` and docs/mixtures.md); exclusive with
    ``paths`` and ``datasets``. The realized mix is written to ``save_folder/train_data/mixture.json``."""
    custom_dataset: Optional[CustomDatasetConfig] = None
    """OLMo's hook for a dataset class imported from ``module`` by name. In Python it works as in OLMo
    (:func:`olmo.data.build_custom_dataset`, :func:`olmo.data.build_collator`); ``scripts/train.py`` refuses it
    (validation), since the trainer's exact order, resume and ``global_indices.npy`` need token memmaps, and it
    would run code named by a config file: convert the data to token memmaps instead."""

    @property
    def effective_memmap_dtype(self) -> type:
        """``memmap_dtype`` as the numpy type (OLMo's property).

        :raises TypeError: for a name that is not one of the four unsigned integer types.
        """
        types = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}
        if self.memmap_dtype not in types:
            raise TypeError(f"data.memmap_dtype={self.memmap_dtype!r} must be one of {', '.join(types)}.")
        return types[self.memmap_dtype]

    def problems(
        self,
        vocab_size: int,
        sequence_length: int,
        durations: list[str],
        stage_data: Sequence[tuple[str, DataConfig, list[str]]] = (),
    ) -> list[str]:
        """One sentence per problem of the run's ``data`` that the config alone shows (empty when there is none).

        :param vocab_size: ``model.vocab_size``: every token id must fit ``memmap_dtype``.
        :param sequence_length: ``model.max_sequence_length``, the tokens of one instance.
        :param durations: the lengths that train on this data (see :meth:`MixtureConfig.problems`).
        :param stage_data: ``(key, data, durations)`` of each stage that trains on a mixture of its own
            (``stages[1].data``): those mixtures are checked after this one's.
        """
        out: list[str] = []
        if self.memmap_dtype not in MEMMAP_DTYPES:
            out.append(f"data.memmap_dtype={self.memmap_dtype!r} must be one of {', '.join(MEMMAP_DTYPES)}.")
        elif vocab_size - 1 > np.iinfo(np.dtype(self.memmap_dtype)).max:
            out.append(
                f"data.memmap_dtype={self.memmap_dtype} cannot hold token ids up to model.vocab_size-1="
                f"{vocab_size - 1}; use --data.memmap_dtype=uint32 (and tokenize with that dtype)."
            )
        if self.paths is not None and self.datasets is not None:
            out.append("data.paths and data.datasets are mutually exclusive; set only one.")
        if self.label_mask_paths is not None:
            n_paths = len(self.paths or [])
            if len(self.label_mask_paths) != n_paths:
                out.append(
                    f"data.label_mask_paths has {len(self.label_mask_paths)} entries but data.paths has {n_paths}; "
                    f"give exactly one label mask per token file, in the same order."
                )
        if self.num_workers < 0:
            out.append("data.num_workers must be >= 0.")
        if self.mixture is not None:
            out += self.mixture_problems("data", sequence_length, durations)
        for key, data, stage_durations in stage_data:
            out += data.mixture_problems(key, sequence_length, stage_durations)
        out += self.location_problems("data")
        if self.instance_filter is not None:
            out += self.instance_filter.problems()
        if self.custom_dataset is not None:
            out.append(
                f"data.custom_dataset ({self.custom_dataset.module or '?'}.{self.custom_dataset.name}) cannot train "
                f"with scripts/train.py: the trainer's exact data order, resume and global_indices.npy need token "
                f"memmaps, and it would import and run code named by the config (in your own Python loop, "
                f"olmo.data.build_custom_dataset and build_collator build it as OLMo does). Tokenize the data into "
                f"memmaps (dolma tokens or scripts/prepare_memmap_dataset.py), list them in data.paths, and set "
                f"data.custom_dataset to null."
            )
        return out

    def mixture_problems(self, key: str, sequence_length: int, durations: list[str]) -> list[str]:
        """The problems of ``{key}.mixture`` (see :meth:`MixtureConfig.problems`), which excludes the other ways of
        naming files."""
        assert self.mixture is not None
        out: list[str] = []
        if self.paths or self.datasets or self.label_mask_paths:
            out.append(
                f"{key}.mixture is exclusive with {key}.paths, {key}.datasets and {key}.label_mask_paths: list the "
                f"files in the mixture's sources, and set the others to null."
            )
        return out + self.mixture.problems(f"{key}.mixture", sequence_length, durations)

    def path_lists(self, key: str) -> dict[str, Optional[list[str]]]:
        """Every list of files the data config at ``key`` names (token files, label masks, named datasets, each
        mixture source's), by its config key."""
        lists = {f"{key}.paths": self.paths, f"{key}.label_mask_paths": self.label_mask_paths}
        lists.update({f"{key}.datasets.{label}": paths for label, paths in (self.datasets or {}).items()})
        for i, src in enumerate(self.mixture.sources if self.mixture is not None else []):
            lists[f"{key}.mixture.sources[{i}].paths"] = src.paths
            lists[f"{key}.mixture.sources[{i}].label_mask_paths"] = src.label_mask_paths
        return lists

    def location_problems(self, key: str) -> list[str]:
        """Problems with where the data config at ``key`` reads its files: URL schemes that are not read by byte
        range, and ``{key}.remote`` and ``{key}.timeout`` values that cannot work."""
        out: list[str] = []
        for list_key, paths in self.path_lists(key).items():
            for i, path in enumerate(paths or []):
                typo = missing_slash_problem(str(path), f"{list_key}[{i}]")
                if typo is not None:
                    out.append(typo)
                    continue
                scheme = split_remote(str(path))[0]
                if scheme and scheme != "file" and scheme not in REMOTE_DATA_SCHEMES:
                    out.append(
                        f"{list_key}[{i}]={redact_url(str(path))!r}: {scheme}:// URLs cannot be read by byte range. "
                        f"Use {', '.join(s + '://' for s in REMOTE_DATA_SCHEMES)}, a file:// URL or a local path "
                        f"(download the file first)."
                    )
        out += self.remote.problems(f"{key}.remote")
        if not 0 <= self.timeout <= MAX_TIMEOUT_SECONDS:
            out.append(
                f"{key}.timeout={self.timeout} must be a number of seconds from 0 (wait forever) to "
                f"{MAX_TIMEOUT_SECONDS:g} (a day): how long the DataLoader waits for a worker's batch."
            )
        return out
