"""Convert a checkpoint written by the original OLMo trainer (ai2-olmo) or by OLMo-core's trainer (ai2-olmo-core 3.x,
OLMo 2 / OLMo 3) into this trainer's unsharded layout.

    python scripts/convert_olmo_checkpoint.py INPUT_DIR OUTPUT_DIR [--model-only] [--safetensors]

An OLMo-core checkpoint (``stepN/`` with ``model_and_optim/``, ``config.json`` and ``.metadata.json``) becomes our
``model.pt`` with the architecture of its ``config.json`` reproduced exactly (sliding windows and RoPE scaling
included; anything else is refused, see :mod:`olmo.checkpoint.olmo_core_v3_config`), its AdamW moments in
``optim.pt`` and a trainer state at step 0: continue or fine-tune with ``--load_path=OUTPUT_DIR
--reset_trainer_state``.

For the original OLMo trainer, INPUT_DIR is any checkpoint this trainer can read: the ``olmo_core`` sharded layout
(``model/``, ``optim/``, ``train/``; the only one that must be converted before ``--load_path`` takes it),
``torch_new`` (``model_and_optim/``) or unsharded (``model.pt``, ``optim.pt``, ``train.pt``). OUTPUT_DIR receives
``model.pt`` (or ``model.safetensors``), ``optim.pt``, ``train.pt`` and the original ``config.yaml``,
committed with our ``.olmo-checkpoint.json`` marker; then ``--load_path=OUTPUT_DIR`` resumes exactly where
the original stopped (model, AdamW moments and step counts, step, tokens and data position, and every
rank's RNG when the world size matches).

One process, no torchrun: the model and optimizer are built on the CPU from INPUT_DIR's ``config.yaml``, so
peak memory is about the training state's full size (fp32 weights + optimizer moments).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from olmo.checkpoint import inspect_checkpoint, load_checkpoint
from olmo.checkpoint.olmo_core_v3 import convert_olmo_core_checkpoint, is_olmo_core_checkpoint
from olmo.checkpoint.olmo_formats import load_olmo_core, merged_train_state
from olmo.checkpoint.save import check_new_output_dir, write_unsharded_checkpoint
from olmo.config import TrainConfig
from olmo.distributed import DistEnv, ParallelizeOptions, ParallelLayout, build_model
from olmo.exceptions import OLMoCheckpointError, OLMoCliError
from olmo.optim import build_optimizer
from olmo.util import is_url

log = logging.getLogger("convert_olmo_checkpoint")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="convert_olmo_checkpoint.py",
        description="Convert an original OLMo checkpoint (olmo_core, torch_new or unsharded layout) or an OLMo-core "
        "(ai2-olmo-core 3.x) checkpoint into this trainer's unsharded layout, which --load_path loads directly.",
    )
    parser.add_argument(
        "input", metavar="INPUT_DIR", help="the original or OLMo-core checkpoint, e.g. .../step1000"
    )
    parser.add_argument("output", metavar="OUTPUT_DIR", help="where to write it; must not exist yet")
    parser.add_argument(
        "--model-only", action="store_true", help="skip optim.pt (resume with --reset_optimizer_state)"
    )
    parser.add_argument("--safetensors", action="store_true", help="write model.safetensors instead of model.pt")
    return parser.parse_args(argv)


def convert(input_dir: str, output_dir: str, model_only: bool = False, safetensors: bool = False) -> Path:
    """Convert the original OLMo or OLMo-core checkpoint ``input_dir`` into our committed unsharded checkpoint
    ``output_dir``."""
    if is_url(input_dir) or is_url(output_dir):
        raise OLMoCliError("convert_olmo_checkpoint.py works on local directories; download the checkpoint first.")
    if is_olmo_core_checkpoint(Path(input_dir)):
        check_new_output_dir(Path(output_dir), inputs=[input_dir])
        return convert_olmo_core_checkpoint(Path(input_dir), Path(output_dir), model_only, safetensors)
    info = inspect_checkpoint(input_dir, flag="INPUT_DIR", convertible=True)
    if info.marked:
        raise OLMoCheckpointError(
            f"INPUT_DIR '{input_dir}' was written by this trainer, not the original OLMo; there is nothing to "
            f"convert. Load it with --load_path={input_dir} (or unshard a sharded one with scripts/unshard.py)."
        )
    root, target = Path(info.path), Path(output_dir)
    check_new_output_dir(target, inputs=[info.path])
    start = time.perf_counter()
    cfg = TrainConfig.load_saved(root / "config.yaml", ["compile=null"])
    log.info("Converting %s (original OLMo, %s layout, step %d).", root, info.layout, info.step)
    cpu = DistEnv(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)
    model = build_model(cfg.model, ParallelLayout.of_run(cfg, cpu), ParallelizeOptions.from_train_config(cfg))
    optimizer = None if model_only else build_optimizer(cfg.optimizer, model)
    if info.layout == "olmo_core":
        train_state = load_olmo_core(root, model, optimizer)
    else:
        state = load_checkpoint(info, model, optimizer, load_trainer_state=True)
        assert state is not None
        train_state = merged_train_state(root) if info.sharded else state
    train_state["format_version"] = 1
    write_unsharded_checkpoint(target, model, optimizer, train_state, root / "config.yaml", info.step, safetensors)
    log.info(
        "Wrote %s in %.1f s: step %d, %d instances into epoch %d. Resume with --load_path=%s.",
        target,
        time.perf_counter() - start,
        train_state["global_step"],
        train_state["global_train_examples_seen_this_epoch"],
        train_state["epoch"],
        target,
    )
    return target


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    convert(args.input, args.output, model_only=args.model_only, safetensors=args.safetensors)
    return 0
