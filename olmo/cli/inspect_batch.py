"""Show the instances of the global batch a run trained on at step N (as OLMo's inspect_train_data.py).

    python scripts/inspect_batch.py RUN_DIR --step N [--rank R --world-size W] [--decode] [--json]
    python scripts/inspect_batch.py CONFIG.yaml --step N [--order-file PATH] [--key.path=value ...]

RUN_DIR is a run's save_folder: its ``config.yaml`` and ``train_data/global_indices.npy`` are read (in a
staged run, a step of a stage with its own data reads ``train_data/stage{i}/``, counting from the stage's
first step).
With a config, the order file defaults to ``{save_folder}/train_data/``; ``--order-file`` names one
copied from elsewhere. Other ``--key.path=value`` options override the config (e.g. ``--data.paths=[...]``
when the token files have moved).

Step N (counted from 1) trains on global batch ``s = (N-1) mod S`` of epoch ``(N-1) div S``, where S is
the number of steps per epoch (instances // global_train_batch_size): entries ``[s*B, (s+1)*B)`` of that
epoch's order (``global_indices.npy`` for epoch 0, ``global_indices_epoch{E}.npy`` later). When an
epoch's order file is missing it is recomputed from the seed exactly as the trainer does. Rank R of W
trains on every W-th entry from offset R. This assumes the run went through the data in order from
step 1 (a fresh run, a resume, or a fine-tune with ``--reset_trainer_state``); after a resume with
``--epoch``, ``--fast_forward_batches`` or ``--restore_dataloader=false`` the positions differ, and
``{save_folder}/data-indices/`` (``olmo.data.read_data_indices``) holds what was actually trained on.

``--json`` prints the instances as a JSON list instead of a table: ``position``, ``rank`` (of ``--world-size``,
else of the ranks that wrote ``data-indices/``), ``index``, ``source`` (the ``data.mixture`` source or the
``data.datasets`` label), ``file``, ``token_offset``, ``documents`` (``{id, start, end}``: each document's token
span within the instance, from the metadata ``dolma tokens`` writes beside a token file; empty without it, and
``document_metadata`` says which), ``filtered`` (dropped by ``data.instance_filter``) and ``label_tokens``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from olmo.config import DataConfig, TrainConfig
from olmo.config.stage_sections import MAX_STEPS
from olmo.data import MemMapDataset, batches_per_epoch, build_memmap_dataset, data_order_seed, order_file_name
from olmo.data.inspect import BatchRow, launch_world_size, load_order, read_batch
from olmo.exceptions import OLMoCliError, OLMoDataError
from olmo.tokenizer import Tokenizer
from olmo.train.stability import SKIPPED_BATCHES_FILE, locate_batch, read_skip_ranges
from olmo.train.stages import check_recorded_data, plan_stages

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

    The step is located with the trainer's records (``olmo.train.stages``, ``olmo.train.stability``), which
    :mod:`olmo.data.inspect`, below them, may not import; it reads the batch."""
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

    check_recorded_data(cfg, plan, dataset_of, "inspect another run: this one never trained on it")
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
    order = load_order(path, order_file is not None, epoch, cfg, dataset, seed)
    return read_batch(
        cfg, stage.data, dataset, order, path, s, step, rank, world_size, tokenizer, max_chars, provenance
    )


def print_table(rows: list[BatchRow], title: str, show_rank_of: Optional[int]) -> None:
    table = Table(title=title, show_lines=any(r.text is not None for r in rows))
    table.add_column("pos", justify="right")
    if show_rank_of is not None:
        table.add_column("rank", justify="right")
    table.add_column("instance", justify="right")
    table.add_column("file", overflow="fold")
    table.add_column("token offset", justify="right")
    if any(r.label_tokens is not None for r in rows):
        table.add_column("label tokens", justify="right")
    if any(r.text is not None for r in rows):
        table.add_column("text", overflow="fold", ratio=1)
    for r in rows:
        cells = [str(r.position)]
        if show_rank_of is not None:
            cells.append(str(r.position % show_rank_of))
        cells += [str(r.index), r.path, str(r.offset)]
        if r.label_tokens is not None:
            cells.append(str(r.label_tokens))
        # Text, not a markup string: decoded data may hold "[...]" that rich would read as styles.
        table.add_row(*cells, *([Text(r.text)] if r.text is not None else []))
    # Off a terminal rich assumes 80 columns, too few for this table; logs and pipes get a wide one.
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def main(argv: Optional[list[str]] = None) -> list[BatchRow]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path, help="a run's save_folder, or a training config YAML")
    parser.add_argument("--step", type=int, required=True, help="training step, counted from 1")
    parser.add_argument("--rank", type=int, default=None, help="show only this rank's share (needs --world-size)")
    parser.add_argument("--world-size", type=int, default=None, help="data-parallel ranks (adds a rank column)")
    parser.add_argument("--decode", action="store_true", help="show the start of every instance's text")
    parser.add_argument("--order-file", type=Path, default=None, help="the epoch's global_indices file")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for --decode (default: the config's)")
    parser.add_argument("--max-chars", type=int, default=200, help="characters of text per instance (%(default)s)")
    parser.add_argument(
        "--json", action="store_true", help="print the instances as JSON (source, documents, filtered) instead"
    )
    args, extra = parser.parse_known_args(argv)
    bad = [a for a in extra if not a.startswith("--")]
    if bad:
        raise OLMoCliError(f"Unexpected argument(s) {bad}; config overrides look like --model.key=value.")
    if args.rank is not None and args.world_size is None:
        raise OLMoCliError("--rank needs --world-size: pass the number of ranks the run trained with.")

    if args.target.is_dir():
        config_path = args.target / "config.yaml"
        if not config_path.is_file():
            raise OLMoCliError(
                f"'{args.target}' has no config.yaml, so it is not a finished run's save_folder. Pass the run "
                f"folder, or the training config with --order-file PATH/global_indices.npy."
            )
    else:
        config_path = args.target
    # A run's config.yaml was saved resolved and may come from anyone: never resolve what it holds.
    cfg = (
        TrainConfig.load_saved(config_path, extra)
        if args.target.is_dir()
        else TrainConfig.load(config_path, extra)
    )
    batch_size, world_size = cfg.global_train_batch_size, args.world_size
    if world_size is not None and (
        world_size <= 0 or batch_size % world_size or not 0 <= (args.rank or 0) < world_size
    ):
        raise OLMoCliError(
            f"--world-size {world_size} must divide global_train_batch_size={batch_size} (the trainer requires it) "
            f"and --rank must be in [0, {world_size})."
        )
    order_dir = (args.target if args.target.is_dir() else Path(cfg.save_folder)) / "train_data"
    tokenizer = None
    if args.decode:
        identifier = args.tokenizer or cfg.tokenizer.identifier
        tokenizer = Tokenizer.from_file(identifier, cfg.model.eos_token_id, cfg.model.pad_token_id)
    rows = batch_rows(
        cfg,
        args.step,
        args.order_file,
        order_dir,
        args.rank,
        args.world_size,
        tokenizer,
        args.max_chars,
        provenance=args.json,
    )
    if args.json:
        world = args.world_size or launch_world_size(args.target)
        print(json.dumps([r.as_json(world) for r in rows], indent=1))
        return rows
    who = "all ranks" if args.rank is None else f"rank {args.rank} of {args.world_size}"
    title = (
        f"Step {args.step}: {len(rows)} instances of {cfg.model.max_sequence_length} tokens "
        f"({who}; global batch {cfg.global_train_batch_size})"
    )
    print_table(rows, title, args.world_size)
    return rows
