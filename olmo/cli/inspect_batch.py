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

An RL run's instances are its prompts (``rl.prompts``); with the run folder, each prompt's completions that step,
their rewards (the sum and each reward) and whether they were truncated are shown too (from
``{save_folder}/rl_rollouts/``), and ``--json`` adds them to each instance as ``completions``.
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

from olmo.config import TrainConfig
from olmo.data.inspect import BatchRow, launch_world_size
from olmo.exceptions import OLMoCliError
from olmo.rl.rollout_records import read_rollouts
from olmo.tokenizer import Tokenizer
from olmo.train.batch_lookup import batch_rows

log = logging.getLogger("inspect_batch")


def print_table(rows: list[BatchRow], title: str, show_rank_of: Optional[int]) -> None:
    table = Table(title=title, show_lines=any(r.text is not None for r in rows))
    table.add_column("pos", justify="right")
    if show_rank_of is not None:
        table.add_column("rank", justify="right")
    table.add_column("instance", justify="right")
    if any(r.paired for r in rows):
        table.add_column("pair", justify="right")
    table.add_column("file", overflow="fold")
    table.add_column("token offset", justify="right")
    if any(r.label_tokens is not None for r in rows):
        table.add_column("label tokens", justify="right")
    if any(r.text is not None for r in rows):
        table.add_column("text", overflow="fold", ratio=1)
    for r in rows:
        cells = [str(r.position)]
        if show_rank_of is not None:
            cells.append(str(r.rank(show_rank_of)))
        cells += [str(r.index), *([r.pair or ""] if r.paired else []), r.path, str(r.offset)]
        if r.label_tokens is not None:
            cells.append(str(r.label_tokens))
        # Text, not a markup string: decoded data may hold "[...]" that rich would read as styles.
        table.add_row(*cells, *([Text(r.text)] if r.text is not None else []))
    # Off a terminal rich assumes 80 columns, too few for this table; logs and pipes get a wide one.
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def print_rollouts(rows: list[BatchRow], rollouts: dict[int, dict], max_chars: int) -> None:
    """The completions of the step's prompts and their rewards (an RL run), one row per completion."""
    table = Table(title="Completions and rewards", show_lines=False)
    for column in ("instance", "source", "ground truth", "reward", "rewards", "tokens", "completion"):
        table.add_column(column, overflow="fold", ratio=1 if column == "completion" else None)
    for r in rows:
        found = rollouts.get(r.index)
        if found is None:
            continue
        for c in found["completions"]:
            each = " ".join(f"{name}={value:g}" for name, value in c["rewards"].items())
            length = f"{c['tokens']}{' (cut)' if c['truncated'] else ''}"
            cells = [str(r.index), found["source"], found["ground_truth"], f"{c['reward']:g}", each, length]
            table.add_row(*cells, Text(c["text"][:max_chars]))
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
    rollouts = read_rollouts(args.target, args.step) if cfg.rl.enabled and args.target.is_dir() else {}
    if args.json:
        launched = launch_world_size(args.target)  # ranks sharing instances (context_parallel) read the same ones
        world = args.world_size or (cfg.data_parallel_size(launched) if launched else None)
        shown = []
        for r in rows:
            row = r.as_json(world)
            if r.index in rollouts:
                row["completions"] = rollouts[r.index]["completions"]
            shown.append(row)
        print(json.dumps(shown, indent=1))
        return rows
    who = "all ranks" if args.rank is None else f"rank {args.rank} of {args.world_size}"
    title = (
        f"Step {args.step}: {len(rows)} instances of {cfg.model.max_sequence_length} tokens "
        f"({who}; global batch {cfg.global_train_batch_size})"
    )
    print_table(rows, title, args.world_size)
    if rollouts:
        print_rollouts(rows, rollouts, args.max_chars)
    return rows
