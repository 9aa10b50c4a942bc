"""Training data: token memmaps -> global order per epoch -> DataLoader batches.

The builders of ``builders`` take only the config sections they need (``build_dataset(cfg.data, cfg.model,
DataContext.from_train_config(cfg))``); the ones here keep OLMo's signatures, which take the whole config, and call
them. Inspect the batch of any step ``s`` with::

    cfg = TrainConfig.load(train_config_path)
    dataset = build_memmap_dataset(cfg, cfg.data)
    global_indices = np.memmap(f"{cfg.save_folder}/train_data/global_indices.npy", mode="r", dtype=np.uint32)
    for index in global_indices[s * cfg.global_train_batch_size:(s + 1) * cfg.global_train_batch_size]:
        token_ids = dataset[index]["input_ids"].tolist()

Modules: ``builders`` (datasets and loaders from the config's sections), ``memmap_dataset`` (instances cut
from token files, local or remote), ``remote`` (byte-range reads of ``http(s)``/``s3``/``r2``/``weka``/``gs``
files), ``read_ahead`` (fetching ahead along the order), ``order_file`` and
``iterable_dataset`` (the epoch's order, split over ranks and workers), ``collator``, ``instance_filter``,
``data_indices`` (``save_folder/data-indices``), ``inspect`` (the instances of one global batch), and the data
preparation of the commands: ``memmap_writer`` (documents into token memmaps) and ``sft`` (chat conversations into
SFT instances with a label mask).

May import: ``olmo.distributed`` (collectives only), ``olmo.config``, ``olmo.tokenizer`` (its type only),
``olmo.util``, ``olmo.exceptions``.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from ..config import DataConfig, TrainConfig
    from .builders import (
        DataContext,
        build_data_collator,
        build_dataset,
        build_eval_loader,
        build_train_loader,
    )
    from .collator import CustomDatasetDataCollator, DataCollator, check_token_ids
    from .custom_datasets import build_custom_dataset
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
    from .remote import FetchStats

_LAZY = {
    **dict.fromkeys(
        ["DataContext", "build_data_collator", "build_dataset", "build_eval_loader", "build_train_loader"],
        "builders",
    ),
    **dict.fromkeys(["CustomDatasetDataCollator", "DataCollator", "check_token_ids"], "collator"),
    "build_custom_dataset": "custom_datasets",
    **dict.fromkeys(["DataIndexLog", "read_data_indices"], "data_indices"),
    **dict.fromkeys(["FilteredInstanceCounter", "is_repetitive"], "instance_filter"),
    **dict.fromkeys(
        [
            "InstanceStream",
            "IterableDataset",
            "batches_per_epoch",
            "data_order_seed",
            "order_file_name",
            "rank_slice",
            "read_instances",
            "worker_share",
        ],
        "iterable_dataset",
    ),
    "MemMapDataset": "memmap_dataset",
    "FetchStats": "remote",
}
"""Where each name of the package lives. They are imported on first use, so that the data preparation commands
(``memmap_writer``, ``sft``: numpy and tokenizers only) start without torch (3 s of a 4 s ``--help``)."""


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "DataCollator",
    "CustomDatasetDataCollator",
    "DataContext",
    "build_collator",
    "build_data_collator",
    "build_dataset",
    "build_eval_loader",
    "build_train_loader",
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
    """OLMo's ``build_collator(train_config)``: :func:`build_data_collator` of its ``data`` and
    ``model.pad_token_id``."""
    from .builders import build_data_collator

    return build_data_collator(train_config.data, train_config.model.pad_token_id)


def build_memmap_dataset(
    train_config: TrainConfig, data_config: DataConfig, include_instance_metadata: bool = True, key: str = "data"
) -> MemMapDataset:
    """OLMo's ``build_memmap_dataset(train_config, data_config)``: :func:`build_dataset` of ``data_config`` with
    ``train_config``'s model and :class:`DataContext`.

    :param key: where the section is in the config (``evaluators[0].data``), for errors.
    """
    from .builders import DataContext, build_dataset

    context = DataContext.from_train_config(train_config)
    return build_dataset(data_config, train_config.model, context, include_instance_metadata, key)


def build_eval_dataloader(
    train_config: TrainConfig, data_config: DataConfig, batch_size: int, shuffle: bool = True
) -> DataLoader:
    """OLMo's ``build_eval_dataloader(train_config, data_config, batch_size)``: :func:`build_eval_loader` of
    ``data_config`` with ``train_config``'s model and :class:`DataContext`."""
    from .builders import DataContext, build_eval_loader

    context = DataContext.from_train_config(train_config)
    return build_eval_loader(data_config, train_config.model, context, batch_size, shuffle)


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
    """OLMo's ``build_train_dataloader(train_config)``: :func:`build_train_loader` of ``train_config.data`` with its
    model and :class:`DataContext`, over epoch ``train_config.epoch or 0`` (the parameters are that function's).

    :param fs_local_rank: accepted for OLMo's API and ignored: only rank 0 writes the order file (the other ranks
        wait for it), and a rank on a file system that does not see it computes the order in its own memory.
    """
    from .builders import DataContext, build_train_loader

    if fs_local_rank is not None:
        log.warning(
            "build_train_dataloader(fs_local_rank=%d) has no effect: only rank 0 writes the data order.",
            fs_local_rank,
        )
    return build_train_loader(
        train_config.data,
        train_config.model,
        DataContext.from_train_config(train_config),
        world_size=world_size,
        rank=rank,
        include_instance_metadata=include_instance_metadata,
        work_dir=work_dir,
        dataset=dataset,
    )
