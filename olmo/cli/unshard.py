"""Convert a sharded checkpoint (``stepN/``, saved by any number of ranks) into OLMo's unsharded layout.

    python scripts/unshard.py INPUT_DIR OUTPUT_DIR [--model-only] [--safetensors]

OUTPUT_DIR receives ``config.yaml``, ``model.pt`` (or ``model.safetensors``), ``optim.pt`` (unless
``--model-only``) and ``train.pt``, committed like every trainer checkpoint: written into a hidden
temporary directory, fsynced, the ``.olmo-checkpoint.json`` marker last, then renamed into place. Name it
``stepN-unsharded`` inside a run's ``save_folder`` if the trainer should discover it there.

One process, no torchrun: the model and optimizer are built on the CPU from the checkpoint's own
``config.yaml``, the sharded state is loaded into them (DCP reshards to one process), and the full state
dicts are written, so peak memory is about the training state's full size (fp32 weights + optimizer).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from olmo.checkpoint import MARKER, inspect_checkpoint, load_checkpoint
from olmo.checkpoint.olmo_formats import merged_train_state
from olmo.checkpoint.restore import RestorePlan, preflight_restore
from olmo.checkpoint.save import check_new_output_dir, write_unsharded_checkpoint
from olmo.config import TrainConfig
from olmo.distributed import DistEnv, ParallelizeOptions, ParallelLayout, build_model
from olmo.exceptions import OLMoCheckpointError, OLMoCliError
from olmo.optim import build_optimizer
from olmo.util import is_url

log = logging.getLogger("unshard")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="unshard.py",
        description="Convert a sharded OLMo checkpoint (stepN/) into the unsharded layout (model.pt, ...).",
    )
    parser.add_argument("input", metavar="INPUT_DIR", help="a committed sharded checkpoint, e.g. runs/x/step1000")
    parser.add_argument("output", metavar="OUTPUT_DIR", help="where to write it; must not exist yet")
    parser.add_argument(
        "--model-only", action="store_true", help="skip optim.pt (resume needs --reset_optimizer_state)"
    )
    parser.add_argument("--safetensors", action="store_true", help="write model.safetensors instead of model.pt")
    return parser.parse_args(argv)


def _size(n_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes} B"


def unshard(input_dir: str, output_dir: str, model_only: bool = False, safetensors: bool = False) -> Path:
    """Convert the sharded checkpoint ``input_dir`` into the unsharded checkpoint ``output_dir``.

    :raises OLMoCheckpointError: if the input is not a committed sharded checkpoint or the output exists.
    """
    if is_url(input_dir) or is_url(output_dir):
        raise OLMoCliError("unshard.py works on local directories; download the sharded checkpoint first.")
    info = inspect_checkpoint(input_dir, flag="INPUT_DIR")
    if not info.sharded:
        raise OLMoCheckpointError(
            f"'{input_dir}' is already an unsharded checkpoint (model.pt/optim.pt/train.pt); there is nothing "
            f"to convert. Load it directly with --load_path={input_dir}."
        )
    target = Path(output_dir)
    check_new_output_dir(target, f" (e.g. {Path(info.path).parent}/step{info.step}-unsharded)", [info.path])
    start = time.perf_counter()
    root = Path(info.path)
    # Built exactly as the trainer builds it for one CPU process; compiling would only cost time here.
    cfg = TrainConfig.load_saved(root / "config.yaml", ["compile=null"])
    preflight_restore(RestorePlan(info, load_optimizer_state=not model_only, load_trainer_state=True), cfg.model)
    n_ranks = len(list((root / "train").glob("rank*.pt")))
    log.info("Loading sharded checkpoint %s (step %d, saved by %d rank(s)).", root, info.step, n_ranks)
    cpu = DistEnv(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)
    model = build_model(cfg.model, ParallelLayout.of_run(cfg, cpu), ParallelizeOptions.from_train_config(cfg))
    optimizer = None if model_only else build_optimizer(cfg.optimizer, model)
    load_checkpoint(info, model, optimizer, load_trainer_state=False)
    train_state = merged_train_state(root, original=info.layout != "olmo-trainer")
    write_unsharded_checkpoint(target, model, optimizer, train_state, root / "config.yaml", info.step, safetensors)
    for path in sorted(p for p in target.iterdir() if p.name != MARKER):
        log.info("  %-17s %s", path.name, _size(path.stat().st_size))
    log.info("Wrote unsharded checkpoint %s in %.1f s.", target, time.perf_counter() - start)
    return target


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    unshard(args.input, args.output, model_only=args.model_only, safetensors=args.safetensors)
    return 0
