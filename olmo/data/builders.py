"""The data builders, each taking its sections: ``data`` (a :class:`DataConfig`), ``model`` (the instance length and
the special tokens) and a :class:`DataContext`, the few run-wide settings OLMo's config keeps at its top level.
OLMo's own signatures, which take the whole :class:`~olmo.config.TrainConfig`, are the thin wrappers of
:mod:`olmo.data` (``build_memmap_dataset(cfg, cfg.data)``, ``build_train_dataloader(cfg)``, ...)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..config import DEFAULT_MAX_DURATION, DataConfig, ModelConfig, TrainConfig
from ..config.stage_sections import parse_duration_steps, segment_lengths
from ..exceptions import OLMoConfigurationError, OLMoDataError
from ..util import env_rank, env_world_size, is_url
from .collator import CustomDatasetDataCollator, DataCollator
from .custom_datasets import import_by_name
from .iterable_dataset import IterableDataset, data_order_seed
from .memmap_dataset import MemMapDataset
from .mixture import mixture_selection, plan_mixture
from .remote import METADATA_CACHE_NAME

__all__ = [
    "DataContext",
    "build_data_collator",
    "build_dataset",
    "build_eval_loader",
    "build_train_loader",
]


@dataclass(frozen=True, kw_only=True)
class DataContext:
    """The run-wide settings the data builders read besides their ``data`` and ``model`` sections (top-level keys of
    OLMo's config); :meth:`from_train_config` takes them from a config."""

    save_folder: str
    """``save_folder``: its ``train_data/`` holds the record of remote files and, by default, the data order."""
    seed: int
    """``seed``: it seeds the data order unless ``data.seed`` is set."""
    global_train_batch_size: int
    """Instances per optimizer step over all ranks (``global_train_batch_size``)."""
    epoch: Optional[int]
    """``epoch``: the epoch the training loader starts at (null: 0)."""
    save_overwrite: bool
    """``save_overwrite``: an order file that differs from the one computed now is replaced, not an error."""
    reuse_metadata_cache: bool
    """Read the run's record of its remote files; False for a new run replacing an old one (``save_overwrite``
    without resuming), which starts a new record."""
    data_durations: tuple[Union[int, str], ...]
    """The lengths the run trains its ``data`` for (``max_duration``, or those of the stages of its first data
    segment): what a mixture without ``mixture.tokens`` draws."""
    pairs: bool = False
    """``dpo.enabled``: the data are preference pairs, shuffled and dealt to ranks whole (:class:`IterableDataset`)."""

    @classmethod
    def from_train_config(cls, cfg: TrainConfig) -> DataContext:
        """The data settings of ``cfg``."""
        return cls(
            save_folder=cfg.save_folder,
            seed=cfg.seed,
            global_train_batch_size=cfg.global_train_batch_size,
            epoch=cfg.epoch,
            save_overwrite=cfg.save_overwrite,
            reuse_metadata_cache=not cfg.save_overwrite or cfg.try_load_latest_save or cfg.load_path is not None,
            data_durations=tuple(segment_lengths(cfg, None) or [DEFAULT_MAX_DURATION]),
            pairs=cfg.dpo.enabled,
        )

    @property
    def train_data_folder(self) -> Path:
        """``{save_folder}/train_data``."""
        return Path(self.save_folder) / "train_data"


def build_data_collator(data: DataConfig, pad_token_id: int) -> Any:
    """The collator of ``data``: with a ``custom_dataset``, its ``collate_fn`` (imported by name) or a
    :class:`CustomDatasetDataCollator` mapping its ``collate_config`` field names; otherwise the
    :class:`DataCollator` of ``data.pad_direction``.

    :param pad_token_id: the id that pads ``input_ids`` (``model.pad_token_id``).
    """
    custom = data.custom_dataset
    if custom is None:
        return DataCollator(pad_direction=data.pad_direction, pad_token_id=pad_token_id)
    if custom.collate_fn is not None:
        return import_by_name(custom.collate_fn, key="data.custom_dataset.collate_fn")
    return CustomDatasetDataCollator(
        pad_direction=data.pad_direction,
        pad_token_id=pad_token_id,
        **({"collate_config": custom.collate_config} if custom.collate_config is not None else {}),
    )


def build_dataset(
    data: DataConfig,
    model: ModelConfig,
    context: DataContext,
    include_instance_metadata: bool = True,
    key: str = "data",
) -> MemMapDataset:
    """The instances of ``data`` (``paths``, ``datasets`` with sorted labels, or a ``mixture``), cut into
    ``model.max_sequence_length`` tokens.

    Local paths may be glob patterns; their matches are used in sorted order, so the instance numbering does not
    depend on the file system.

    :param key: where the section is in the config (``evaluators[0].data``), for errors.
    :raises OLMoConfigurationError: when neither ``paths`` nor ``datasets`` is set.
    :raises OLMoDataError: when a glob pattern matches no file.
    """
    if data.mixture is not None:
        return _build_mixture_dataset(data, model, context, include_instance_metadata, key)
    paths: list[str] = []
    metadata: list[dict[str, Any]] = []
    if data.paths and data.datasets:
        raise OLMoConfigurationError(f"{key}.paths and {key}.datasets are mutually exclusive; set only one.")
    if data.paths:
        paths = _expand(data.paths, f"{key}.paths")
        metadata = [{} for _ in paths]
    elif data.datasets:
        for label in sorted(data.datasets):
            label_paths = _expand(data.datasets[label], f"{key}.datasets.{label}")
            paths += label_paths
            metadata += [{"label": label} for _ in label_paths]
    else:
        raise OLMoConfigurationError(
            f"No data: set {key}.paths to the token files (e.g. --{key}.paths=[tokens.npy]), or "
            f"{key}.datasets to label -> files."
        )
    masks = None if data.label_mask_paths is None else _expand(data.label_mask_paths, f"{key}.label_mask_paths")
    return _memmap_dataset(data, model, context, paths, metadata, masks, include_instance_metadata, key)


def _memmap_dataset(
    data: DataConfig,
    model: ModelConfig,
    context: DataContext,
    paths: list[str],
    metadata: list[dict[str, Any]],
    masks: list[str] | None,
    include_instance_metadata: bool,
    key: str,
) -> MemMapDataset:
    """The dataset of these files with the model's and ``data``'s settings."""
    return MemMapDataset(
        *paths,
        chunk_size=model.max_sequence_length,
        memmap_dtype=data.memmap_dtype,
        metadata=metadata,
        include_instance_metadata=include_instance_metadata,
        generate_attention_mask=data.generate_attention_mask,
        pad_token_id=model.pad_token_id,
        label_mask_paths=masks,
        generate_doc_lengths=data.generate_doc_lengths,
        eos_token_id=model.eos_token_id,
        instance_filter_config=data.instance_filter,
        vocab_size=model.vocab_size,
        remote=data.remote,
        metadata_cache=context.train_data_folder / METADATA_CACHE_NAME,
        reuse_metadata_cache=context.reuse_metadata_cache,
        config_key=key,
    )


def _mixture_instances(data: DataConfig, model: ModelConfig, context: DataContext) -> int:
    """Instances a mixture draws: ``mixture.tokens`` cut into instances, else what the run trains on its ``data``
    (``context.data_durations``). A stage's own mixture gets its segment's length from the stage plan
    (:func:`olmo.train.stages.plan_stages`), which fills in its ``tokens``."""
    assert data.mixture is not None
    if data.mixture.tokens is not None:
        return data.mixture.tokens // model.max_sequence_length
    # Validation refuses a null mixture.tokens with a length in epochs (of the mixture itself).
    batch = context.global_train_batch_size
    tokens_per_batch = batch * model.max_sequence_length
    return batch * sum(parse_duration_steps(x, batch, tokens_per_batch, 0) for x in context.data_durations)


def _build_mixture_dataset(
    data: DataConfig, model: ModelConfig, context: DataContext, include_instance_metadata: bool, key: str
) -> MemMapDataset:
    """All sources' files as one dataset whose instances are the mixture's selection (:mod:`olmo.data.mixture`)."""
    mixture = data.mixture
    assert mixture is not None
    paths: list[str] = []
    masks: list[str] = []
    metadata: list[dict[str, Any]] = []
    files_per_source = []
    path_keys: dict[str, str] = {}
    for i, src in enumerate(mixture.sources):
        where = f"{key}.mixture.sources[{i}]"
        source_paths = _expand(src.paths, f"{where}.paths")
        files_per_source.append(len(source_paths))
        paths += source_paths
        metadata += [{"source": src.name} for _ in source_paths]
        path_keys.update({p: f"{where}.paths" for p in source_paths})
        if src.label_mask_paths is not None:
            source_masks = _expand(src.label_mask_paths, f"{where}.label_mask_paths")
            masks += source_masks
            path_keys.update({p: f"{where}.label_mask_paths" for p in source_masks})
    dataset = _memmap_dataset(
        data, model, context, paths, metadata, masks or None, include_instance_metadata, f"{key}.mixture"
    )
    dataset.path_keys = path_keys
    bounds = dataset.instance_bounds()
    ends = np.cumsum(files_per_source)
    starts = ends - np.asarray(files_per_source)
    offsets = [int(bounds[a]) for a in starts]
    available = [int(bounds[b] - bounds[a]) for a, b in zip(starts, ends)]
    total = _mixture_instances(data, model, context)
    plan = plan_mixture(mixture, available, total, model.max_sequence_length, f"{key}.mixture")
    dataset.selection = mixture_selection(plan, offsets)
    dataset.mixture_plan = plan
    dataset.file_sources = np.repeat(np.arange(len(files_per_source)), files_per_source)
    return dataset


def _world(world_size: Optional[int], rank: Optional[int]) -> tuple[int, int]:
    """``(world_size, rank)``, each by default the process group's when one is initialized, else the launcher's."""
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else env_world_size()
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else env_rank()
    return world_size, rank


def build_eval_loader(
    data: DataConfig, model: ModelConfig, context: DataContext, batch_size: int, shuffle: bool = True
) -> DataLoader:
    """OLMo's evaluation loader: the instances of ``data`` (with metadata), split over the ranks by a
    ``DistributedSampler`` seeded with ``context.seed`` (``data.drop_last`` as its ``drop_last``), in batches of
    ``batch_size`` per rank. The in-loop evaluators do not use it (they deal instances to ranks by a fixed seeded
    order, :func:`olmo.eval.evaluator.rank_order`); it is for scripts written against OLMo."""
    from torch.utils.data import DistributedSampler

    dataset = build_dataset(data, model, context, include_instance_metadata=True)
    world_size, rank = _world(None, None)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=context.seed, drop_last=data.drop_last
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=DataCollator(pad_direction=data.pad_direction, pad_token_id=model.pad_token_id),
        num_workers=data.num_workers,
        pin_memory=data.pin_memory is not False and torch.cuda.is_available(),
        prefetch_factor=data.prefetch_factor if data.num_workers > 0 else None,
        persistent_workers=False,
        timeout=data.timeout,
    )


def build_train_loader(
    data: DataConfig,
    model: ModelConfig,
    context: DataContext,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    include_instance_metadata: bool = False,
    work_dir: str | os.PathLike[str] | None = None,
    dataset: MemMapDataset | None = None,
) -> DataLoader:
    """The training DataLoader of this rank over ``data``, at epoch ``context.epoch or 0``.

    Rank 0 writes the epoch's order to ``work_dir`` (default ``{save_folder}/train_data``). The data is not
    validated here; call :meth:`MemMapDataset.validate` once before (``scripts/train.py`` does). Set
    ``loader.dataset.start_index`` (a global instance count) before iterating to resume, and call
    ``loader.dataset.reshuffle(epoch)`` for a new epoch.

    :param world_size: data-parallel ranks; by default the process group's size when one is initialized,
        otherwise the launcher's (torchrun's or srun's variables; 1 without a launcher).
    :param rank: this process's rank, by default found the same way as ``world_size``.
    :param include_instance_metadata: also collate each instance's ``metadata`` (e.g. its dataset label).
    :param dataset: ``build_dataset(data, model, context, include_instance_metadata)``, when the caller has opened
        it already (its files are then not probed again).
    """
    world_size, rank = _world(world_size, rank)
    if dataset is None:
        dataset = build_dataset(data, model, context, include_instance_metadata=include_instance_metadata)
    seed = data_order_seed(data, context.seed)
    batch = context.global_train_batch_size
    order = IterableDataset(
        dataset,
        batch,
        seed=seed,
        epoch=context.epoch or 0,
        world_size=world_size,
        rank=rank,
        work_dir=work_dir if work_dir is not None else context.train_data_folder,
        overwrite=context.save_overwrite,
        pairs=context.pairs,
    )
    if rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0):  # not the CP/TP peers of data rank 0 too
        dataset.save_remote_records()
    return DataLoader(
        order,
        batch_size=batch // world_size,
        collate_fn=DataCollator(pad_direction=data.pad_direction, pad_token_id=model.pad_token_id),
        num_workers=data.num_workers,
        pin_memory=data.pin_memory is not False and torch.cuda.is_available(),
        prefetch_factor=data.prefetch_factor if data.num_workers > 0 else None,
        # Workers restart with every epoch so they see the new order (a persistent worker would keep
        # its pickled copy of the old one); data.persistent_workers is accepted but has no effect.
        persistent_workers=False,
        timeout=data.timeout,
        # Creating an iterator draws a seed; from the global RNG that would shift dropout draws
        # after a resume (which creates its iterator later than an uninterrupted run).
        generator=torch.Generator().manual_seed(seed),
    )


def _expand(patterns: list[str], key: str) -> list[str]:
    """Replace each local glob pattern by its sorted matches; URLs and other paths pass through."""
    out: list[str] = []
    for pattern in map(str, patterns):
        if is_url(pattern) or not any(c in pattern for c in "*?["):
            out.append(pattern)
            continue
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise OLMoDataError(
                f"{key} entry '{pattern}' matches no file. Check the pattern and the directory, or run the "
                f"data preparation script that writes the files."
            )
        out += matches
    return out
