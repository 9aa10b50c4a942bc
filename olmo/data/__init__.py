"""Training data: token memmaps -> global order per epoch -> DataLoader batches.

Each builder takes only the config sections it needs. Inspect the batch of any step ``s`` with::

    cfg = TrainConfig.load(train_config_path)
    dataset = build_memmap_dataset(cfg, cfg.data)
    global_indices = np.memmap(f"{cfg.save_folder}/train_data/global_indices.npy", mode="r", dtype=np.uint32)
    for index in global_indices[s * cfg.global_train_batch_size:(s + 1) * cfg.global_train_batch_size]:
        token_ids = dataset[index]["input_ids"].tolist()

Modules: ``memmap_dataset`` (instances cut from token files, local or remote), ``remote`` (byte-range reads of
``http(s)``/``s3``/``r2``/``weka``/``gs`` files), ``read_ahead`` (fetching ahead along the order), ``order_file`` and
``iterable_dataset`` (the epoch's order, split over ranks and workers), ``collator``, ``instance_filter``,
``data_indices`` (``save_folder/data-indices``).

May import: ``olmo.distributed`` (collectives only), ``olmo.config``, ``olmo.util``, ``olmo.exceptions``.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..config import DEFAULT_MAX_DURATION, DataConfig, TrainConfig
from ..config.stages import parse_duration_steps, segment_lengths
from ..exceptions import OLMoConfigurationError, OLMoDataError
from ..util import env_rank, env_world_size, is_url
from .collator import CustomDatasetDataCollator, DataCollator, check_token_ids
from .custom_datasets import build_custom_dataset, import_by_name
from .data_indices import DataIndexLog, read_data_indices
from .instance_filter import FilteredInstanceCounter, is_repetitive
from .iterable_dataset import (
    InstanceStream,
    IterableDataset,
    batches_per_epoch,
    data_order_seed,
    order_file_name,
    rank_slice,
    read_instances,
    worker_share,
)
from .memmap_dataset import MemMapDataset
from .mixture import mixture_selection, plan_mixture
from .remote import METADATA_CACHE_NAME, FetchStats

__all__ = [
    "DataCollator",
    "CustomDatasetDataCollator",
    "build_collator",
    "build_eval_dataloader",
    "build_custom_dataset",
    "DataIndexLog",
    "FetchStats",
    "FilteredInstanceCounter",
    "InstanceStream",
    "IterableDataset",
    "MemMapDataset",
    "batches_per_epoch",
    "build_memmap_dataset",
    "build_train_dataloader",
    "check_token_ids",
    "data_order_seed",
    "is_repetitive",
    "order_file_name",
    "rank_slice",
    "read_data_indices",
    "read_instances",
    "worker_share",
]

log = logging.getLogger(__name__)


def build_collator(train_config: TrainConfig) -> Any:
    """The collator of ``train_config``'s data (OLMo's ``build_collator``): with a ``data.custom_dataset``, its
    ``collate_fn`` (imported by name) or a :class:`CustomDatasetDataCollator` mapping its ``collate_config`` field
    names; otherwise the :class:`DataCollator` of ``data.pad_direction`` and ``model.pad_token_id``."""
    custom = train_config.data.custom_dataset
    if custom is None:
        return DataCollator.from_train_config(train_config)
    if custom.collate_fn is not None:
        return import_by_name(custom.collate_fn, key="data.custom_dataset.collate_fn")
    return CustomDatasetDataCollator(
        pad_direction=train_config.data.pad_direction,
        pad_token_id=train_config.model.pad_token_id,
        **({"collate_config": custom.collate_config} if custom.collate_config is not None else {}),
    )


def build_memmap_dataset(
    train_config: TrainConfig, data_config: DataConfig, include_instance_metadata: bool = True, key: str = "data"
) -> MemMapDataset:
    """The instances of ``data_config`` (``data.paths``, or ``data.datasets`` with sorted labels).

    :param key: where the section is in the config (``evaluators[0].data``), for errors.

    Chunk size and the pad and EOS tokens come from ``train_config.model``. Local paths may be glob
    patterns; their matches are used in sorted order, so the instance numbering does not depend on the file
    system.

    :raises OLMoConfigurationError: when neither ``data.paths`` nor ``data.datasets`` is set.
    :raises OLMoDataError: when a glob pattern matches no file.
    """
    if data_config.mixture is not None:
        return _build_mixture_dataset(train_config, data_config, include_instance_metadata, key)
    paths: list[str] = []
    metadata: list[dict[str, Any]] = []
    if data_config.paths and data_config.datasets:
        raise OLMoConfigurationError(f"{key}.paths and {key}.datasets are mutually exclusive; set only one.")
    if data_config.paths:
        paths = _expand(data_config.paths, f"{key}.paths")
        metadata = [{} for _ in paths]
    elif data_config.datasets:
        for label in sorted(data_config.datasets):
            label_paths = _expand(data_config.datasets[label], f"{key}.datasets.{label}")
            paths += label_paths
            metadata += [{"label": label} for _ in label_paths]
    else:
        raise OLMoConfigurationError(
            f"No data: set {key}.paths to the token files (e.g. --{key}.paths=[tokens.npy]), or "
            f"{key}.datasets to label -> files."
        )
    label_masks = data_config.label_mask_paths
    masks = None if label_masks is None else _expand(label_masks, f"{key}.label_mask_paths")
    return _memmap_dataset(train_config, data_config, paths, metadata, masks, include_instance_metadata, key)


def _memmap_dataset(
    cfg: TrainConfig,
    data_config: DataConfig,
    paths: list[str],
    metadata: list[dict[str, Any]],
    masks: list[str] | None,
    include_instance_metadata: bool,
    key: str,
) -> MemMapDataset:
    """The dataset of these files with the model's and ``data_config``'s settings."""
    return MemMapDataset(
        *paths,
        chunk_size=cfg.model.max_sequence_length,
        memmap_dtype=data_config.memmap_dtype,
        metadata=metadata,
        include_instance_metadata=include_instance_metadata,
        generate_attention_mask=data_config.generate_attention_mask,
        pad_token_id=cfg.model.pad_token_id,
        label_mask_paths=masks,
        generate_doc_lengths=data_config.generate_doc_lengths,
        eos_token_id=cfg.model.eos_token_id,
        instance_filter_config=data_config.instance_filter,
        vocab_size=cfg.model.vocab_size,
        remote=data_config.remote,
        metadata_cache=Path(cfg.save_folder) / "train_data" / METADATA_CACHE_NAME,
        # A new run that replaces an old one (--save_overwrite without resuming) starts a new record.
        reuse_metadata_cache=not cfg.save_overwrite or cfg.try_load_latest_save or cfg.load_path is not None,
        config_key=key,
    )


def mixture_total_instances(train_config: TrainConfig, data_config: DataConfig) -> int:
    """Instances a mixture draws: ``mixture.tokens`` cut into instances, else what the run (or, in a staged run,
    the stages that train on the run's ``data``) trains: a stage's own mixture gets its segment's length from the
    stage plan (:func:`olmo.train.stages.plan_stages`), which fills in its ``tokens``."""
    assert data_config.mixture is not None
    cfg = train_config
    if data_config.mixture.tokens is not None:
        return data_config.mixture.tokens // cfg.model.max_sequence_length
    # Validation refuses a null mixture.tokens with a length in epochs (of the mixture itself).
    lengths = segment_lengths(cfg, None) or [DEFAULT_MAX_DURATION]
    steps = sum(parse_duration_steps(x, cfg.global_train_batch_size, cfg.tokens_per_batch, 0) for x in lengths)
    return steps * cfg.global_train_batch_size


def _build_mixture_dataset(
    train_config: TrainConfig, data_config: DataConfig, include_instance_metadata: bool, key: str
) -> MemMapDataset:
    """All sources' files as one dataset whose instances are the mixture's selection (:mod:`olmo.data.mixture`)."""
    mixture = data_config.mixture
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
    cfg = train_config
    dataset = _memmap_dataset(
        cfg, data_config, paths, metadata, masks or None, include_instance_metadata, f"{key}.mixture"
    )
    dataset.path_keys = path_keys
    bounds = dataset.instance_bounds()
    ends = np.cumsum(files_per_source)
    starts = ends - np.asarray(files_per_source)
    offsets = [int(bounds[a]) for a in starts]
    available = [int(bounds[b] - bounds[a]) for a, b in zip(starts, ends)]
    plan = plan_mixture(
        mixture,
        available,
        mixture_total_instances(cfg, data_config),
        cfg.model.max_sequence_length,
        f"{key}.mixture",
    )
    dataset.selection = mixture_selection(plan, offsets)
    dataset.mixture_plan = plan
    dataset.file_sources = np.repeat(np.arange(len(files_per_source)), files_per_source)
    return dataset


def build_eval_dataloader(
    train_config: TrainConfig, data_config: DataConfig, batch_size: int, shuffle: bool = True
) -> DataLoader:
    """OLMo's evaluation loader: the instances of ``data_config`` (with metadata), split over the ranks by a
    ``DistributedSampler`` seeded with the run's seed (``data_config.drop_last`` as its ``drop_last``), in
    batches of ``batch_size`` per rank. The in-loop evaluators do not use it (they deal instances to ranks by a
    fixed seeded order, :func:`olmo.eval.evaluator.rank_order`); it is for scripts written against OLMo."""
    from torch.utils.data import DistributedSampler

    dataset = build_memmap_dataset(train_config, data_config, include_instance_metadata=True)
    world_size = dist.get_world_size() if dist.is_initialized() else env_world_size()
    rank = dist.get_rank() if dist.is_initialized() else env_rank()
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=train_config.seed,
        drop_last=data_config.drop_last,
    )
    workers = data_config.num_workers
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=DataCollator(
            pad_direction=data_config.pad_direction, pad_token_id=train_config.model.pad_token_id
        ),
        num_workers=workers,
        pin_memory=data_config.pin_memory is not False and torch.cuda.is_available(),
        prefetch_factor=data_config.prefetch_factor if workers > 0 else None,
        persistent_workers=False,
        timeout=data_config.timeout,
    )


def build_train_dataloader(
    train_config: TrainConfig,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    fs_local_rank: int | None = None,
    include_instance_metadata: bool = False,
    work_dir: str | os.PathLike[str] | None = None,
    dataset: MemMapDataset | None = None,
) -> DataLoader:
    """The training DataLoader of this rank, over epoch ``train_config.epoch or 0``.

    Rank 0 writes the epoch's order to ``work_dir`` (default ``{save_folder}/train_data``). The data is not
    validated here; call :meth:`MemMapDataset.validate` once before (``scripts/train.py`` does). Set
    ``loader.dataset.start_index`` (a global instance count) before iterating to resume, and call
    ``loader.dataset.reshuffle(epoch)`` for a new epoch.

    :param world_size: data-parallel ranks; by default the process group's size when one is initialized,
        otherwise the launcher's (torchrun's or srun's variables; 1 without a launcher).
    :param rank: this process's rank, by default found the same way as ``world_size``.
    :param fs_local_rank: accepted for OLMo's API and ignored: only rank 0 writes the order file (the other ranks
        wait for it), and a rank on a file system that does not see it computes the order in its own memory.
    :param include_instance_metadata: also collate each instance's ``metadata`` (e.g. its dataset label).
    :param dataset: ``build_memmap_dataset(train_config, train_config.data, include_instance_metadata)``, when the
        caller has opened it already (its files are then not probed again).
    """
    if fs_local_rank is not None:
        log.warning(
            "build_train_dataloader(fs_local_rank=%d) has no effect: only rank 0 writes the data order.",
            fs_local_rank,
        )
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else env_world_size()
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else env_rank()
    cfg = train_config
    if dataset is None:
        dataset = build_memmap_dataset(cfg, cfg.data, include_instance_metadata=include_instance_metadata)
    seed = data_order_seed(cfg.data, cfg.seed)
    order = IterableDataset(
        dataset,
        cfg.global_train_batch_size,
        seed=seed,
        epoch=cfg.epoch or 0,
        world_size=world_size,
        rank=rank,
        work_dir=work_dir if work_dir is not None else Path(cfg.save_folder) / "train_data",
        overwrite=cfg.save_overwrite,
    )
    if rank == 0:
        dataset.save_remote_records()
    workers = cfg.data.num_workers
    return DataLoader(
        order,
        batch_size=cfg.device_batch_size(world_size),
        collate_fn=DataCollator.from_train_config(cfg),
        num_workers=workers,
        pin_memory=cfg.data.pin_memory is not False and torch.cuda.is_available(),
        prefetch_factor=cfg.data.prefetch_factor if workers > 0 else None,
        # Workers restart with every epoch so they see the new order (a persistent worker would keep
        # its pickled copy of the old one); data.persistent_workers is accepted but has no effect.
        persistent_workers=False,
        timeout=cfg.data.timeout,
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
