"""The data sections of a run's configuration: ``DataConfig`` (token files, a mixture of sources, the instance
filter, how remote files are read, OLMo's custom dataset hook) and ``EvaluatorConfig``, whose data is one too.

Import them from :mod:`olmo.config`, which re-exports all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .base import BaseConfig
from .sections import EvaluatorType, PaddingDirection


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


@dataclass
class EvaluatorConfig:
    label: str = "???"
    """Name of the evaluator: the metric prefix, and for ``downstream`` the ai2-olmo-eval task label."""
    type: EvaluatorType = EvaluatorType.lm
    """``lm`` (cross entropy and perplexity over token files), ``downstream`` (multiple-choice task) or
    ``generate`` (text sampled from ``prompts``, logged; see :mod:`olmo.eval.generation`)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The token files an ``lm`` evaluator scores (``paths``, or ``datasets``: label -> files)."""
    device_eval_batch_size: Optional[int] = None
    """Instances per batch on each rank; None uses the top-level ``device_eval_batch_size``."""
    subset_num_batches: Optional[int] = None
    """Batches per rank to score; None uses ``eval_subset_num_batches``."""
    definitions: str = "olmo_eval"
    """``downstream`` only: whose metric definitions. ``olmo_eval`` (the default: ai2-olmo-eval's, which OLMES and
    current AI2 evaluations use): ``len_norm`` divides by the continuation's length in characters with its leading
    space, and queries longer than ``model.max_sequence_length`` lose tokens on the left. ``olmo-0.6``: the
    original OLMo trainer's (0.6), for comparing with numbers it logged: the length without the leading space,
    and queries cut only past 2048 tokens, its default, whatever the model's length."""
    prompts: list[str] = field(default_factory=list)
    """``generate`` only: the texts to continue at every evaluation."""
    max_new_tokens: int = 32
    """``generate`` only: most tokens generated per prompt."""
    temperature: float = 0.0
    """``generate`` only: 0 is greedy decoding; above 0 (finite) samples (seeded by ``seed``: the same draw each
    time)."""
    top_k: Optional[int] = None
    """``generate`` only: sample from the ``top_k`` most likely tokens (1 to ``model.vocab_size``)."""
    top_p: Optional[float] = None
    """``generate`` only: sample from the nucleus of probability ``top_p``, in (0, 1]."""
