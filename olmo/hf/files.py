"""Reading and writing Hugging Face model directories for :mod:`olmo.hf`: ``config.json``, safetensors weights
(sharded with ``model.safetensors.index.json`` above a size), ``generation_config.json`` and tokenizer files.

A directory is written into a hidden temporary sibling and renamed into place at the end, so a conversion
that fails leaves nothing behind. Weights are read with safetensors (or ``torch.load(weights_only=True)`` for
``pytorch_model.bin``): no code from the directory ever runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from tokenizers import Tokenizer as HFTokenizer

from ..checkpoint.safe_reads import safe_torch_load
from ..checkpoint.save import replace_dir
from ..config import ModelConfig
from ..exceptions import OLMoCheckpointError, OLMoConfigurationError
from ..util import default_file_mode
from ..util.bounded_files import open_regular, read_bounded
from ..util.progress import ProgressLog
from ..util.tokenizer_files import load_base_tokenizer
from .conversion_checks import IMPORT_WEIGHTS_FIX, check_finite
from .mapping import (
    HF_MODEL_TYPES,
    build_hf_config,
    hf_config_class,
    hf_model_type,
    import_transformers,
    to_hf_state,
)

__all__ = [
    "check_hf_export",
    "export_tokenizer",
    "write_hf_model",
    "parse_size",
    "staging_dir",
    "write_safetensors",
    "write_tokenizer_files",
    "read_hf_config",
    "read_hf_weights",
    "hf_tokenizer_vocab_size",
]

log = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
JSON_FILE_LIMIT = 64 << 20
"""The largest config.json or safetensors index read (a few KB for a real model; an index names every tensor, about
100 bytes each: 64 MiB is over half a million tensors)."""
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def export_tokenizer(identifier: str, model_cfg: ModelConfig, flag: str = "--tokenizer") -> HFTokenizer:
    """The tokenizer to ship with an export, checked to fit the model's embedding.

    :param flag: What the user sets to ship another tokenizer, named in the refusal (which says nothing of what was
        or was not written: the caller knows).
    :raises OLMoConfigurationError: if it does not resolve, or has more tokens than the embedding has rows.
    """
    try:
        tokenizer = load_base_tokenizer(identifier)
    except OLMoConfigurationError as e:
        raise OLMoConfigurationError(f"{e} Or pass {flag} to ship another tokenizer.") from None
    if tokenizer.get_vocab_size() > model_cfg.effective_embedding_size:
        raise OLMoConfigurationError(
            f"The tokenizer {identifier!r} has {tokenizer.get_vocab_size()} tokens, more than the model's "
            f"{model_cfg.effective_embedding_size} embedding rows, so it is not the run's tokenizer. Set {flag} "
            f"to the tokenizer the model was trained with."
        )
    return tokenizer


def check_hf_export(model_cfg: ModelConfig, tokenizer_identifier: str) -> None:
    """What ``hf_export.enabled`` needs, checked at start-up: transformers installed, an architecture it can hold,
    and a tokenizer that fits the embedding.

    :raises OLMoConfigurationError: naming the option, or :class:`~olmo.exceptions.OLMoError` for a missing
        transformers.
    """
    import_transformers()
    try:
        hf_model_type(model_cfg)
    except OLMoConfigurationError as e:
        sep = "\n" if "\n" in str(e) else " "  # a listing of problems, or one paragraph
        raise OLMoConfigurationError(f"hf_export.enabled=true: {e}{sep}Or set hf_export.enabled=false.") from None
    export_tokenizer(tokenizer_identifier, model_cfg, "tokenizer.identifier")


def write_hf_model(
    target: Path,
    model_state: Mapping[str, torch.Tensor],
    model_cfg: ModelConfig,
    tokenizer: Optional[HFTokenizer],
    dtype: torch.dtype,
    max_shard_bytes: int,
) -> list[str]:
    """Write the transformers model directory ``target`` from our model's full state dict: ``config.json``,
    ``generation_config.json``, the weights (sharded above ``max_shard_bytes``) and the tokenizer files (none when
    ``tokenizer`` is None). Written
    into a hidden sibling and renamed into place; returns the file names.

    :raises OLMoConfigurationError: for an architecture transformers cannot hold (before anything is written).
    """
    hf_config = build_hf_config(model_cfg, dtype)
    state = to_hf_state(model_state, model_cfg)
    generation = import_transformers().GenerationConfig(
        bos_token_id=None, eos_token_id=model_cfg.eos_token_id, pad_token_id=model_cfg.pad_token_id
    )
    with staging_dir(target) as tmp:
        hf_config.save_pretrained(str(tmp))
        generation.save_pretrained(str(tmp))
        files = write_safetensors(tmp, state, dtype, max_shard_bytes)
        if tokenizer is not None:
            files += write_tokenizer_files(
                tmp, tokenizer, model_cfg.eos_token_id, model_cfg.pad_token_id, model_cfg.max_sequence_length
            )
    return files


def parse_size(text: str) -> int:
    """Bytes in ``"5GB"``, ``"500MB"``, ``"2GiB"`` or ``"1000000"`` (decimal units, as transformers reads them).

    :raises OLMoConfigurationError: for anything else.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise OLMoConfigurationError(
            f"--max-shard-size={text!r} is not a size; give a positive number of bytes or one with a unit, "
            f"e.g. 5GB, 500MB or 2GiB."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """A hidden temporary sibling of ``target`` to write into; renamed to ``target`` when the block succeeds,
    removed when it fails.

    :raises OLMoCheckpointError: if ``target`` exists, now or by the time the rename would happen.
    """
    if os.path.lexists(target):  # a dangling symlink too: the rename would follow it
        raise OLMoCheckpointError(f"OUTPUT_DIR '{target}' already exists; pick a new path or delete it first.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                default_file_mode(file)  # safetensors writes its files for their owner only
        if target.exists():
            raise OLMoCheckpointError(f"'{target}' appeared while it was being written; nothing was written.")
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_safetensors(
    folder: Path, state: Mapping[str, torch.Tensor], dtype: torch.dtype, max_shard_bytes: int
) -> list[str]:
    """Write ``state`` in ``dtype`` as ``model.safetensors``, or as ``model-0000i-of-0000n.safetensors`` shards of at
    most ``max_shard_bytes`` each (a larger single tensor gets a shard of its own) plus the index; return the
    file names. One shard's tensors are converted at a time, so memory grows by at most one shard."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        n = tensor.numel() * dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    progress = ProgressLog("Writing safetensors", len(files), "files", log)
    for i, (file, names) in enumerate(zip(files, shards)):
        progress.update(i)
        tensors = {name: state[name].detach().to(dtype=dtype, device="cpu").contiguous() for name in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    progress.update(len(files))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * dtype.itemsize for t in state.values())},
            "weight_map": {name: file for file, names in zip(files, shards) for name in names},
        }
        (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(SAFETENSORS_INDEX)
    return files


def write_tokenizer_files(
    folder: Path, tokenizer: HFTokenizer, eos_token_id: int, pad_token_id: int, max_length: int
) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` for ``tokenizer``,
    with the model's EOS and padding tokens (OLMo has no BOS token); return the file names."""
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {
        key: token
        for key, token in (
            ("eos_token", tokenizer.id_to_token(eos_token_id)),
            ("pad_token", tokenizer.id_to_token(pad_token_id)),
        )
        if token is not None
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        **special,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _not_a_model(path: Path, why: str) -> OLMoConfigurationError:
    return OLMoConfigurationError(
        f"HF_DIR '{path}' is not a Hugging Face OLMo model directory: {why}. Give a directory written by "
        f"transformers' save_pretrained for an OLMo, OLMo-2, OLMo-3, OLMoE, FlexOlmo or OLMo Hybrid model ({', '.join(HF_MODEL_TYPES.values())}): "
        f"config.json with model_type {', '.join(repr(t) for t in HF_MODEL_TYPES)}, and model.safetensors "
        f"(or its shards and {SAFETENSORS_INDEX}, or pytorch_model.bin). Nothing was written."
    )


def read_hf_config(path: Path) -> Any:
    """The transformers config (``OlmoConfig``, ``Olmo2Config`` or ``Olmo3Config``) in ``path/config.json``, read
    offline.

    :raises OLMoConfigurationError: if ``path`` is not an OLMo model directory.
    """
    if not path.is_dir():
        raise _not_a_model(path, "it does not exist" if not os.path.lexists(path) else "it is not a directory")
    if not os.path.lexists(path / "config.json"):
        raise _not_a_model(path, "it has no config.json")
    raw = read_bounded(
        path / "config.json", JSON_FILE_LIMIT, f"The config.json of '{path}'", OLMoConfigurationError
    )
    try:
        model_type = json.loads(raw).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError) as e:
        raise _not_a_model(path, f"its config.json is not a JSON object ({e})") from None
    if model_type not in HF_MODEL_TYPES:
        raise _not_a_model(path, f"its config.json has model_type={model_type!r}")
    try:
        return hf_config_class(model_type).from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers validates fields with several exception types of its own
        why = " ".join(str(e).split())
        raise OLMoConfigurationError(
            f"The config.json of this {model_type} model in '{path}' is damaged; nothing was written: {why}. Fix the "
            f"field it names, or save the model again with transformers' save_pretrained."
        ) from None


def read_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model in ``path``: ``model.safetensors``, the shards its index names, or
    ``pytorch_model.bin`` (weights-only); each floating-point one checked to be finite as its file is read.

    :raises OLMoConfigurationError: if there are no weights.
    :raises OLMoCheckpointError: for a file that does not read, or a tensor with a NaN or infinite value (naming
        the tensor and its file).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if os.path.lexists(path / SAFETENSORS_INDEX):
        files = _index_files(path / SAFETENSORS_INDEX)
    elif os.path.lexists(path / "model.safetensors"):
        files = ["model.safetensors"]
    elif os.path.lexists(path / "pytorch_model.bin"):
        _check_regular(path / "pytorch_model.bin")
        state = safe_torch_load(path / "pytorch_model.bin")
        if not isinstance(state, dict):
            raise _not_a_model(path, "pytorch_model.bin holds no state dict")
        check_finite(state, f"'{path / 'pytorch_model.bin'}'", IMPORT_WEIGHTS_FIX)
        return state
    else:
        raise _not_a_model(path, "it has no model.safetensors, safetensors index or pytorch_model.bin")
    state = {}
    progress = ProgressLog(f"Reading {path}", len(files), "files", log)
    for i, file in enumerate(files):
        progress.update(i)
        _check_regular(path / file)
        try:
            tensors = load_file(str(path / file))
        except (SafetensorError, OSError) as e:
            raise OLMoCheckpointError(f"Could not read '{path / file}' ({e}); it is damaged or missing.") from None
        check_finite(tensors, f"'{path / file}'", IMPORT_WEIGHTS_FIX)
        state.update(tensors)
    progress.update(len(files))
    return state


def _check_regular(file: Path) -> None:
    """Refuse a weight file that is not a regular file (a FIFO would block the read forever, ``/dev/zero`` never
    end); any size is read, memory-mapped."""
    with open_regular(file, 1 << 62, f"The weight file '{file}'", OLMoCheckpointError):
        pass


def _index_files(index: Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` names (plain names in its folder, nothing else).

    :raises OLMoCheckpointError: for an index that is not JSON with a ``weight_map`` of names to file names.
    """
    raw = read_bounded(index, JSON_FILE_LIMIT, f"The safetensors index '{index}'", OLMoCheckpointError)
    try:
        weight_map = json.loads(raw)["weight_map"]
        files = sorted(set(weight_map.values()))
        if not files or not all(isinstance(f, str) and f == Path(f).name and f not in (".", "..") for f in files):
            raise ValueError(f"its files must be plain names in its folder, got {files[:3]}")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        raise OLMoCheckpointError(
            f"'{index}' is not a safetensors index ({type(e).__name__}: {e}); it must be JSON with a \"weight_map\" from "
            f"each weight's name to its shard's file name. Re-save the model with transformers' save_pretrained."
        ) from None
    return files


def hf_tokenizer_vocab_size(path: Path) -> Optional[int]:
    """The vocabulary of ``path/tokenizer.json`` (added tokens included), or None without one."""
    file = path / "tokenizer.json"
    if not os.path.lexists(file):
        return None
    try:  # a regular file of bounded size, read as a run reads its tokenizer
        return load_base_tokenizer(str(file)).get_vocab_size()
    except OLMoConfigurationError as e:
        log.warning("Ignoring '%s', which does not load (%s).", file, e)
        return None
