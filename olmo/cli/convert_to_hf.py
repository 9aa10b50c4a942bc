"""Export one of our checkpoints as a Hugging Face transformers model directory.

    python scripts/convert_to_hf.py CHECKPOINT_DIR OUTPUT_DIR [--dtype float32|bfloat16] [--max-shard-size 5GB]
                                    [--tokenizer IDENTIFIER]

CHECKPOINT_DIR is any checkpoint ``--load_path`` takes from a local directory: unsharded, or sharded by any number
of ranks. OUTPUT_DIR receives ``config.json`` (``OlmoForCausalLM``; ``Olmo2ForCausalLM`` for the OLMo-2
architecture; ``Olmo3ForCausalLM`` for it with ``model.sliding_window`` or ``model.rope_scaling``, whose windowed
layers must share one window size; ``OlmoeForCausalLM`` / ``FlexOlmoForCausalLM`` with ``model.moe``),
``model.safetensors`` (or shards and ``model.safetensors.index.json``), ``generation_config.json`` and the run's
tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``);
``AutoModelForCausalLM.from_pretrained(OUTPUT_DIR)`` loads it offline. When the run's ``tokenizer.identifier`` is
missing or larger than the embedding (a model imported without a tokenizer), the model is exported without tokenizer
files, with a warning that says so; a ``--tokenizer`` that is missing or larger is refused.

Every check (an architecture transformers cannot represent, an unusable ``--tokenizer``, an existing OUTPUT_DIR)
runs before anything is written; the files are written into a hidden
temporary sibling of OUTPUT_DIR and renamed into place at the end, so a failure leaves no partial directory.
Peak memory is about the model's fp32 weights plus one output shard.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from tokenizers import Tokenizer

from olmo.checkpoint import inspect_checkpoint, load_checkpoint
from olmo.checkpoint.save import check_new_output_dir
from olmo.config import TrainConfig
from olmo.exceptions import OLMoCliError, OLMoConfigurationError
from olmo.hf import HF_MODEL_TYPES, hf_class_listing, hf_model_type, import_transformers
from olmo.hf.conversion_checks import check_exported_config, check_finite
from olmo.hf.files import export_tokenizer, parse_size, write_hf_model
from olmo.model import OLMo
from olmo.util import is_url

log = logging.getLogger("convert_to_hf")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="convert_to_hf.py",
        description="Export a checkpoint (unsharded or sharded) as a Hugging Face transformers model directory, as the "
        f"class that holds its architecture: {hf_class_listing()}.",
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT_DIR", help="e.g. runs/x/step1000-unsharded or runs/x/step1000"
    )
    parser.add_argument("output", metavar="OUTPUT_DIR", help="where to write the model; must not exist yet")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype (default: float32)"
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="split the weights into safetensors shards of at most this size (default: 5GB)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="IDENTIFIER",
        help="the tokenizer to ship (a tokenizer.json path or OLMo tokenizer name); default: the run's "
        "tokenizer.identifier",
    )
    return parser.parse_args(argv)


def convert_to_hf(
    checkpoint_dir: str,
    output_dir: str,
    dtype: str = "float32",
    max_shard_size: str = "5GB",
    tokenizer: str | None = None,
) -> Path:
    """Write the transformers model directory ``output_dir`` for the checkpoint ``checkpoint_dir``.

    :raises OLMoConfigurationError: for an architecture transformers cannot hold, or an unusable tokenizer.
    :raises OLMoCheckpointError: for a missing or incomplete checkpoint, or an existing ``output_dir``.
    """
    if is_url(checkpoint_dir) or is_url(output_dir):
        raise OLMoCliError("convert_to_hf.py works on local directories; download the checkpoint first.")
    max_shard_bytes = parse_size(max_shard_size)
    info = inspect_checkpoint(checkpoint_dir, flag="CHECKPOINT_DIR")
    target = Path(output_dir)
    check_new_output_dir(target, inputs=[info.path])
    start = time.perf_counter()
    cfg = TrainConfig.load_saved(Path(info.path) / "config.yaml", ["compile=null"])
    check_exported_config(cfg.model, info.path)
    import_transformers()
    hf_model_type(cfg.model)  # an architecture transformers cannot hold fails before the weights are read
    base_tokenizer = _tokenizer_to_ship(tokenizer, cfg)

    log.info("Loading %s (step %d, %s).", info.path, info.step, "sharded" if info.sharded else "unsharded")
    model = OLMo(cfg.model, init_params=False)
    load_checkpoint(info, model, None, load_trainer_state=False)
    check_finite(model.state_dict(), f"checkpoint '{info.path}'", "Export an earlier checkpoint of the run.")
    files = write_hf_model(target, model.state_dict(), cfg.model, base_tokenizer, DTYPES[dtype], max_shard_bytes)
    log.info(
        "Wrote %s (%s, %s, %d weight file(s), %s) in %.1f s. Load it with "
        "transformers.AutoModelForCausalLM.from_pretrained(%r).",
        target,
        HF_MODEL_TYPES[hf_model_type(cfg.model)],
        dtype,
        sum(f.endswith(".safetensors") for f in files),
        "tokenizer files" if base_tokenizer is not None else "no tokenizer files",
        time.perf_counter() - start,
        str(target),
    )
    return target


def _tokenizer_to_ship(identifier: Optional[str], cfg: TrainConfig) -> Optional[Tokenizer]:
    """The tokenizer given with ``--tokenizer`` (refused, before anything is written, if unusable), else the run's
    ``tokenizer.identifier``, or None with a warning when that one is unusable: e.g. a model imported without a
    tokenizer, whose weights still export and load in transformers."""
    if identifier is not None:
        try:
            return export_tokenizer(identifier, cfg.model)
        except OLMoConfigurationError as e:
            raise OLMoConfigurationError(f"{e} Nothing was written.") from None
    try:
        return export_tokenizer(cfg.tokenizer.identifier, cfg.model)
    except OLMoConfigurationError as e:
        log.warning(
            "Exporting without tokenizer files (config.json, generation_config.json and the weights are written, and "
            "transformers loads the model without them): the run's tokenizer.identifier cannot be shipped. %s",
            e,
        )
        return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    convert_to_hf(args.checkpoint, args.output, args.dtype, args.max_shard_size, args.tokenizer)
    return 0
