"""Import a Hugging Face transformers model of the OLMo family as one of our unsharded checkpoints.

    python scripts/convert_from_hf.py HF_DIR OUTPUT_DIR [--safetensors]

HF_DIR is a local directory written by transformers' ``save_pretrained`` of one of the classes
:data:`olmo.hf.HF_MODEL_TYPES` lists (``--help`` prints them): OLMo, OLMo-2, OLMo-3 (its sliding-window layers become
``model.sliding_window``, the shortest pattern that gives them, and YaRN or llama3 RoPE scaling
``model.rope_scaling``), OLMoE and FlexOlmo (``model.moe``). OUTPUT_DIR receives ``model.pt`` (or
``model.safetensors``), ``train.pt`` (step 0) and a ``config.yaml`` whose ``model`` section reproduces the
architecture exactly (its ``tokenizer.identifier`` points at HF_DIR's ``tokenizer.json`` when there is one),
committed like every trainer checkpoint. There is no optimizer state (the trainer then starts a fresh optimizer by
itself), so fine-tune with

    python scripts/train.py CONFIG --load_path=OUTPUT_DIR --reset_trainer_state

where CONFIG carries the ``model`` section of OUTPUT_DIR/config.yaml. Everything is checked before anything is
written: an unknown model type, options our model does not implement, a config the trainer's own validation refuses
(a NaN or infinite RoPE factor or loss weight, a scale past a million), weights that do not match config.json, and
any weight with a NaN or infinite value (named with its file).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path
from typing import Optional

from olmo.checkpoint.save import check_new_output_dir, write_imported_checkpoint
from olmo.config import DataConfig, TokenizerConfig, TrainConfig
from olmo.config.validation import config_problems
from olmo.exceptions import OLMoCliError, OLMoConfigurationError
from olmo.hf import from_hf_state, hf_class_listing, model_config_from_hf
from olmo.hf.conversion_checks import check_imported_config
from olmo.hf.files import hf_tokenizer_vocab_size, read_hf_config, read_hf_weights
from olmo.model import OLMo
from olmo.util import is_url
from olmo.util.tokenizer_files import DEFAULT_TOKENIZER

log = logging.getLogger("convert_from_hf")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="convert_from_hf.py",
        description=f"Convert a Hugging Face transformers model directory of the OLMo family ({hf_class_listing()}) "
        "into an unsharded checkpoint of ours.",
    )
    parser.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        help="a local transformers model directory (config.json, ...), or a hub id such as allenai/OLMo-2-0425-1B "
        "or allenai/Olmo-3-7B-Instruct "
        "(downloaded into the Hugging Face cache when the network allows)",
    )
    parser.add_argument("output", metavar="OUTPUT_DIR", help="where to write the checkpoint; must not exist yet")
    parser.add_argument("--safetensors", action="store_true", help="write model.safetensors instead of model.pt")
    return parser.parse_args(argv)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""``owner/name``: what a Hugging Face hub id looks like."""


def _local_model_dir(hf_dir: str) -> Path:
    """``hf_dir`` itself, or for a hub id that is not a local path, its snapshot in the Hugging Face cache
    (config, weights and tokenizer files only; downloaded if the network allows and it is not cached)."""
    if Path(hf_dir).exists() or not _HUB_ID.fullmatch(hf_dir):
        return Path(hf_dir)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(hf_dir, allow_patterns=patterns))
    except Exception as e:  # offline, unknown id, gated model: one message, whatever the hub client raised
        raise OLMoConfigurationError(
            f"HF_DIR {hf_dir!r} is not a local directory, and as a hub id it could not be fetched "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Download the model where the network "
            f"allows (e.g. huggingface-cli download {hf_dir} --local-dir DIR) and pass DIR. Nothing was written."
        ) from None


def convert_from_hf(hf_dir: str, output_dir: str, safetensors: bool = False) -> Path:
    """Write our committed unsharded checkpoint ``output_dir`` for the transformers model in ``hf_dir``.

    :raises OLMoConfigurationError: if ``hf_dir`` is not an OLMo model directory or uses an option we lack.
    :raises OLMoCheckpointError: if ``output_dir`` exists or cannot be written.
    """
    if is_url(hf_dir) or is_url(output_dir):
        raise OLMoCliError("convert_from_hf.py works on local directories and hub ids; download the model first.")
    check_new_output_dir(Path(output_dir))
    source, target = _local_model_dir(hf_dir), Path(output_dir)
    check_new_output_dir(target, inputs=[source])
    hf_config = read_hf_config(source)
    start = time.perf_counter()
    tokenizer_vocab = hf_tokenizer_vocab_size(source)  # None without a tokenizer.json that loads
    model_cfg = model_config_from_hf(hf_config, tokenizer_vocab)
    tokenizer_file = source / "tokenizer.json"
    identifier = str(tokenizer_file.resolve()) if tokenizer_vocab is not None else DEFAULT_TOKENIZER
    data = DataConfig(memmap_dtype="uint16" if model_cfg.vocab_size <= 2**16 else "uint32")  # OLMo 2/3: 100,278
    tokenizer = TokenizerConfig(identifier=identifier)
    cfg = TrainConfig(run_name=target.name, model=model_cfg, tokenizer=tokenizer, data=data)
    # A config the trainer refuses is refused here.
    check_imported_config(config_problems(cfg, 1), hf_config.model_type, source)
    state = from_hf_state(read_hf_weights(source), model_cfg, str(source))
    model = OLMo(model_cfg, init_params=False)
    model.load_state_dict(state, strict=True)  # casts to the model's fp32
    del state

    if tokenizer_vocab is None:
        log.warning(
            "'%s' has no tokenizer.json that loads; config.yaml names %s, which may not match (set "
            "tokenizer.identifier when you fine-tune; convert_to_hf.py then exports without tokenizer files unless "
            "given --tokenizer).",
            source,
            DEFAULT_TOKENIZER,
        )
    write_imported_checkpoint(target, cfg, model, None, safetensors)
    log.info(
        "Wrote %s (%s, %d parameters) in %.1f s. Fine-tune with the model section of its config.yaml and "
        "--load_path=%s --reset_trainer_state.",
        target,
        hf_config.model_type,
        model.num_params(),
        time.perf_counter() - start,
        target,
    )
    return target


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    convert_from_hf(args.hf_dir, args.output, safetensors=args.safetensors)
    return 0
