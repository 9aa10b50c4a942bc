"""Which instances a training step trained on (``inspect_batch.py RUN --step N``): :func:`batch_rows` locates the
step as the trainer counts it (its stage, the stage's data order, epochs, and the ranges of batches rollbacks took
out) and reads that global batch (:mod:`olmo.data.inspect`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..config import DataConfig, TrainConfig
from ..config.stage_sections import MAX_STEPS
from ..data import MemMapDataset, batches_per_epoch, build_memmap_dataset, data_order_seed, order_file_name
from ..data.inspect import BatchRow, BatchSettings, load_order, read_batch
from ..exceptions import OLMoCliError, OLMoDataError
from ..tokenizer import Tokenizer
from .stability import SKIPPED_BATCHES_FILE, locate_batch, read_skip_ranges
from .stages import check_recorded_data, plan_stages

__all__ = ["batch_rows"]

log = logging.getLogger("inspect_batch")


def batch_rows(
    cfg: TrainConfig,
    step: int,
    order_file: Optional[Path],
    default_order_dir: Path,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    tokenizer: Optional[Tokenizer] = None,
    max_chars: int = 200,
    provenance: bool = False,
) -> list[BatchRow]:
    """The instances of the global batch of training step ``step`` (only rank ``rank``'s if given). In a staged
    run, a stage with its own data has its own order, in ``train_data/stage{i}/`` next to ``default_order_dir``,
    counted from the stage's first step.

    The step is located with the trainer's records (its stage plan, the ranges rollbacks skipped);
    :func:`olmo.data.inspect.read_batch` reads the batch."""
    if not 1 <= step <= MAX_STEPS:
        raise OLMoCliError(
            f"--step {step} is not a training step: steps are counted from 1, and no run has more than "
            f"{MAX_STEPS:.0e} (the most max_duration allows). Give a step of the run."
        )
    plan = plan_stages(cfg)
    stage = plan.at(step)
    dataset = build_memmap_dataset(cfg, stage.data)
    # Data that changed since the run recorded it (a glob that matches more files) would give other instances.
    opened = {id(stage.data): dataset}

    def dataset_of(data: DataConfig) -> MemMapDataset:
        if id(data) not in opened:
            opened[id(data)] = build_memmap_dataset(cfg, data)
        return opened[id(data)]

    check_recorded_data(
        cfg.save_folder, cfg.seed, plan, dataset_of, "inspect another run: this one never trained on it"
    )
    batch_size = cfg.global_train_batch_size
    steps_per_epoch = batches_per_epoch(len(dataset), batch_size)
    if steps_per_epoch == 0:
        raise OLMoDataError(
            f"The config's data holds {len(dataset)} instances, less than one global batch of {batch_size}; "
            f"check data.paths and model.max_sequence_length against the run's."
        )
    if step > plan.total_steps:
        log.warning(
            "Step %d is past the run's last step (%d, from max_duration); it was never trained.",
            step,
            plan.total_steps,
        )
    start = plan.segment_start(stage)
    if plan.staged:
        log.info(
            "Step %d is step %d of stage %d (%s), and step %d of the data order in %s.",
            step,
            step - stage.start_step,
            stage.index,
            stage.name,
            step - start,
            stage.order_dir,
        )
    skipped = [r for r in read_skip_ranges(default_order_dir.parent) if r.order_dir == stage.order_dir]
    epoch, s = locate_batch(step - start, steps_per_epoch, skipped, batch_size)
    after = (
        f", after the {len(skipped)} range(s) of {SKIPPED_BATCHES_FILE} that rollbacks skipped" if skipped else ""
    )
    log.info(
        "Step %d trains on batch %d (from 0) of the %d of epoch %d%s.", step, s, steps_per_epoch, epoch, after
    )
    order_dir = default_order_dir.parent / stage.order_dir
    path = order_file if order_file is not None else order_dir / order_file_name(epoch)
    seed = data_order_seed(stage.data, cfg.seed)
    run = BatchSettings(cfg.global_train_batch_size, cfg.dpo.enabled, cfg.model.max_sequence_length)
    order = load_order(path, order_file is not None, epoch, run, dataset, seed)
    return read_batch(
        run, stage.data, dataset, order, path, s, step, rank, world_size, tokenizer, max_chars, provenance
    )
