"""Checkpoints written by OLMo-core's trainer (ai2-olmo-core 3.x, OLMo 2 / OLMo 3): recognise them, read their
weights and AdamW moments with torch's DCP reader, and map them onto our model.

OLMo-core's ``Checkpointer`` writes ``stepN/`` as::

    model_and_optim/.metadata, __{rank}_{thread}.distcp   torch.distributed.checkpoint: "model.<name>" tensors,
                                                          "optim.state.<name>.<step|exp_avg|exp_avg_sq>" (flattened)
                                                          and "optim.param_groups.<name>.<field>" pickles
    train/rank{R}.pt                                      its trainer and data-loader state
    .metadata.json                                        written once the state above is complete
    config.json                                           the experiment config (``ConfigSaverCallback``), last

Its DCP ``.metadata`` names OLMo-core's own ``_StorageInfo`` class (path, offset, length per entry; the fields of
torch's class of that name), so it is unpickled with our allowlist plus that one name, read as torch's. The
``optim.param_groups`` pickles and ``train/`` are never read: the hyperparameters and the trainer state of the
converted checkpoint are ours (OLMo-core's data order does not carry over), as for a transformers import.

Parameters map one to one except our two fused projections (see :mod:`olmo.hf.mapping`): ``att_proj`` is
``w_q``, ``w_k``, ``w_v`` stacked in that order, and ``ff_proj`` is ``w3`` (up) then ``w1`` (gate), since our
SwiGLU computes ``silu(second half) * first half`` and OLMo-core's ``w2(silu(w1(x)) * w3(x))``. AdamW's moments
are stacked the same way; their step counts must agree.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ..config import ModelConfig, OptimizerType
from ..exceptions import OLMoCheckpointError, OLMoError
from ..model import OLMo
from ..optim import build_optimizer
from .dcp_reader import DirectFileSystemReader
from .olmo_core_v3_config import train_config_from_olmo_core
from .olmo_formats import convert_optim_state, describe_dir
from .safe_reads import SafeLoadPlanner, _MetadataUnpickler, read_dcp_metadata, root_cause
from .save import FULL_STATE, write_imported_checkpoint

__all__ = ["is_olmo_core_checkpoint", "read_olmo_core_state", "convert_olmo_core_checkpoint"]

log = logging.getLogger(__name__)

_ADAMW_KEYS = ("step", "exp_avg", "exp_avg_sq")


def read_config_json(path: Path) -> dict[str, Any]:
    """OLMo-core's ``config.json`` as a dict.

    :raises OLMoCheckpointError: for a missing or damaged file.
    """
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise OLMoCheckpointError(
            f"'{path}' is missing: OLMo-core's ConfigSaverCallback writes it into every checkpoint, and without it "
            f"the architecture is unknown. Copy it from the run's other checkpoints (it is the same in each). Nothing "
            f"was written."
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise OLMoCheckpointError(
            f"'{path}' is damaged ({type(e).__name__}: {e}); it is not the JSON OLMo-core writes. Copy it again from "
            f"the run's other checkpoints (it is the same in each). Nothing was written."
        ) from None
    if not isinstance(cfg, dict):
        raise OLMoCheckpointError(
            f"'{path}' holds a JSON {type(cfg).__name__}, not OLMo-core's config object. Nothing was written."
        )
    return cfg


def is_olmo_core_checkpoint(root: Path) -> bool:
    """Whether ``root`` looks like a checkpoint of OLMo-core's trainer (complete or not): ``model_and_optim/`` with
    OLMo-core's ``config.json`` or ``.metadata.json`` and without the original OLMo trainer's ``config.yaml``."""
    return (
        (root / "model_and_optim").is_dir()
        and not (root / "config.yaml").exists()
        and ((root / "config.json").exists() or (root / ".metadata.json").exists())
    )


class _OLMoCoreMetadataUnpickler(_MetadataUnpickler):
    """DCP metadata as OLMo-core pickles it: its ``_StorageInfo`` is read as torch's (same fields)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"):
            return _StorageInfo
        return super().find_class(module, name)


def _read_metadata(folder: Path) -> Metadata:
    """``folder/.metadata``, unpickled with the allowlist of DCP's metadata types (plus OLMo-core's one).

    :raises OLMoCheckpointError: for a missing or damaged file, or one holding anything else.
    """
    advice = "Copy OLMo-core's checkpoint again or convert an earlier step. Nothing was written."
    return read_dcp_metadata(folder, _OLMoCoreMetadataUnpickler, "read", advice)


class _Reader(DirectFileSystemReader):
    """Our direct DCP file reader, for OLMo-core's metadata."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read_metadata(Path(self.path))
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def read_olmo_core_state(root: Path, optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The full tensors of an OLMo-core checkpoint on the CPU: ``(model, optim)``, keyed by OLMo-core's parameter
    names (``blocks.0.attention.w_q.weight``) and, for the optimizer, ``<name>.<step|exp_avg|exp_avg_sq>``.

    :param optimizer: also read the optimizer's per-parameter state (empty when the checkpoint has none).
    :raises OLMoCheckpointError: for missing, truncated or damaged files.
    """
    folder = root / "model_and_optim"
    metadata = _read_metadata(folder)
    prefixes = ("model.", "optim.state.") if optimizer else ("model.",)
    wanted = {
        fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata) and fqn.startswith(prefixes)
    }
    # A damaged or crafted .metadata could ask for any size: never more than the shard files hold.
    needed = sum(t.numel() * t.element_size() for t in wanted.values())
    stored = sum(p.stat().st_size for p in folder.glob("*.distcp"))
    if needed > stored:
        raise OLMoCheckpointError(
            f"'{folder}' is incomplete: its .metadata describes {needed} bytes of tensors but its shard files hold "
            f"{stored} (it holds {describe_dir(folder)}). Copy the checkpoint again. Nothing was written."
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", "torch.distributed is disabled", UserWarning
            )  # one process: intended
            dcp.load(wanted, storage_reader=_Reader(folder), planner=SafeLoadPlanner(), no_dist=True)
    except (CheckpointException, OSError, RuntimeError, pickle.UnpicklingError) as e:
        cause = root_cause(e)
        if isinstance(cause, OLMoError):
            raise cause from None
        raise OLMoCheckpointError(
            f"Could not read OLMo-core's checkpoint '{folder}' ({type(cause).__name__}: {cause}). A shard file is "
            f"missing, truncated or damaged; copy the checkpoint again. Nothing was written."
        ) from None
    model = {k[len("model.") :]: v for k, v in wanted.items() if k.startswith("model.")}
    optim = {k[len("optim.state.") :]: v for k, v in wanted.items() if k.startswith("optim.state.")}
    return model, optim


def _sources(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the OLMo-core parameters stacked (along dim 0) into it, weights and biases."""
    weights = {"transformer.wte.weight": ["embeddings.weight"], "transformer.ln_f.weight": ["lm_head.norm.weight"]}
    if not cfg.weight_tying:
        weights["transformer.ff_out.weight"] = ["lm_head.w_out.weight"]
    for i in range(cfg.n_layers):
        ours, theirs = f"transformer.blocks.{i}.", f"blocks.{i}."
        attention = theirs + "attention."
        weights[ours + "att_proj.weight"] = [attention + f"w_{x}.weight" for x in "qkv"]
        weights[ours + "attn_out.weight"] = [attention + "w_out.weight"]
        weights[ours + "q_norm.weight"] = [attention + "q_norm.weight"]
        weights[ours + "k_norm.weight"] = [attention + "k_norm.weight"]
        weights[ours + "attn_norm.weight"] = [theirs + "attention_norm.weight"]
        weights[ours + "ff_norm.weight"] = [theirs + "feed_forward_norm.weight"]
        weights[ours + "ff_proj.weight"] = [theirs + "feed_forward.w3.weight", theirs + "feed_forward.w1.weight"]
        weights[ours + "ff_out.weight"] = [theirs + "feed_forward.w2.weight"]
    biases = {k[: -len("weight")] + "bias": [n[: -len("weight")] + "bias" for n in v] for k, v in weights.items()}
    return {**weights, **biases}


def map_model_state(theirs: dict[str, torch.Tensor], model: OLMo, where: str) -> dict[str, torch.Tensor]:
    """Our model state dict from OLMo-core's model tensors ``theirs`` (fp32, as our model keeps it).

    :raises OLMoCheckpointError: when the tensors do not match the model config.json describes.
    """
    sources = _sources(model.config)
    expected = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    missing, wrong = [], []
    for name, target in expected.items():
        names = sources.get(name, [])
        if not names or any(n not in theirs for n in names):
            missing.append(next((n for n in names if n not in theirs), name))
            continue
        value = torch.cat([theirs[n].float() for n in names]) if len(names) > 1 else theirs[names[0]].float()
        if value.shape != target.shape:
            wrong.append(f"{' + '.join(names)} {list(value.shape)} for our {name} {list(target.shape)}")
        out[name] = value
    used = {n for name in expected for n in sources.get(name, [])}
    if model.config.weight_tying:
        used.add("lm_head.w_out.weight")  # tied: the embedding's own tensor, when listed at all
    unexpected = sorted(set(theirs) - used)
    if missing or wrong or unexpected:
        raise OLMoCheckpointError(
            f"The weights in '{where}' do not match the model its config.json describes (missing: {missing[:4]}, "
            f"wrong shapes: {wrong[:3]}, not in the model: {unexpected[:4]}): the checkpoint and its config.json come "
            f"from different runs, or the files are damaged. Nothing was written."
        )
    return out


def map_optim_state(theirs: dict[str, torch.Tensor], model: OLMo, where: str) -> dict[str, dict[str, Any]]:
    """``{our parameter name: {step, exp_avg, exp_avg_sq}}`` from OLMo-core's flattened AdamW state ``theirs``.

    :raises OLMoCheckpointError: for state that is not AdamW's, or whose parts do not fit together.
    """
    sources = _sources(model.config)
    out: dict[str, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        state: dict[str, Any] = {}
        for key in _ADAMW_KEYS:
            parts = [theirs.get(f"{n}.{key}") for n in sources.get(name, [])]
            if not parts or any(p is None for p in parts):
                raise OLMoCheckpointError(
                    f"The optimizer state in '{where}' has no {key} for {sources.get(name, [name])}: it is not AdamW's "
                    f"or is incomplete. Convert with --model-only (the trainer then starts a fresh optimizer)."
                )
            if key == "step":
                if any(not torch.equal(p, parts[0]) for p in parts):  # type: ignore[arg-type]
                    raise OLMoCheckpointError(
                        f"The optimizer state in '{where}' counts different steps for {sources[name]}, which our "
                        f"fused {name} updates together. Convert with --model-only."
                    )
                state[key] = parts[0]
            else:
                state[key] = torch.cat([p.float().reshape(-1) for p in parts]).reshape(param.shape)  # type: ignore[union-attr]
        out[name] = state
    return out


def convert_olmo_core_checkpoint(
    root: Path, target: Path, model_only: bool = False, safetensors: bool = False
) -> Path:
    """Write our committed unsharded checkpoint ``target`` from OLMo-core's checkpoint ``root`` (``stepN/``): the
    model exactly, AdamW's moments when OLMo-core trained with AdamW (unless ``model_only``), our config.yaml, and
    a trainer state at step 0 (fine-tune or continue with ``--load_path=target --reset_trainer_state``).

    Everything is read and checked before anything is written; the caller checks ``target`` is new.

    :raises OLMoConfigurationError: for a model option ours cannot reproduce exactly.
    :raises OLMoCheckpointError: for missing, incomplete or damaged files.
    """
    start = time.perf_counter()
    if not (root / ".metadata.json").is_file():
        raise OLMoCheckpointError(
            f"'{root}' has no .metadata.json, which OLMo-core's checkpointer writes once the state is complete: the "
            f"save did not finish or the copy is incomplete. Copy it again or convert an earlier step. Nothing was "
            f"written."
        )
    cfg = train_config_from_olmo_core(read_config_json(root / "config.json"), run_name=target.name)
    adamw = cfg.optimizer.name == OptimizerType.adamw
    if not model_only and not adamw:
        log.warning("OLMo-core's optimizer in '%s' is not AdamW; converting the model only.", root / "config.json")
    theirs, optim = read_olmo_core_state(root, optimizer=adamw and not model_only)
    model = OLMo(cfg.model, init_params=False)
    model.load_state_dict(map_model_state(theirs, model, str(root)), strict=True)
    del theirs
    optimizer = None
    if optim:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        optimizer = build_optimizer(cfg.optimizer, model)
        by_name = map_optim_state(optim, model, str(root))
        converted = convert_optim_state(None, model, optimizer, str(root), by_name=by_name)
        set_optimizer_state_dict(model, optimizer, converted, options=FULL_STATE)
    elif adamw and not model_only:
        log.warning("'%s' holds no optimizer state; converting the model only.", root / "model_and_optim")
    write_imported_checkpoint(target, cfg, model, optimizer, safetensors)
    log.info(
        "Wrote %s from OLMo-core's %s (%d parameters%s) in %.1f s. Fine-tune or continue with the model section of "
        "its config.yaml and --load_path=%s --reset_trainer_state.",
        target,
        root,
        model.num_params(),
        ", AdamW moments" if optimizer is not None else "",
        time.perf_counter() - start,
        target,
    )
    return target
