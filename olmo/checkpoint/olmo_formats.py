"""Checkpoints written by the original OLMo trainer (ai2-olmo): recognise their layouts, convert their state.

The original trainer writes no commit marker; a finished checkpoint is a directory named ``stepN`` or
``stepN-unsharded`` holding ``config.yaml`` (written last, inside a temporary directory that is renamed into
place). Its layouts (``sharded_checkpointer``):

==============  ================================================================  ===========================
layout          files                                                             here
==============  ================================================================  ===========================
``unsharded``   ``model.pt`` (or ``.safetensors``), ``optim.pt``, ``train.pt``     loads directly
``torch_new``   ``model_and_optim/`` (torch.distributed.checkpoint), ``train/``   loads directly, any world size
``olmo_core``   ``model/`` + ``optim/`` (olmo-core 0.1 safetensors shards),       converts once:
                ``train/``                                                        ``scripts/convert_olmo_checkpoint.py``
``torch_legacy`` ``rank{R}.pt``                                                   unshard with OLMo first
``local``       ``model/rank{R}.pt``, ``metadata.yaml``                           unshard with OLMo first
==============  ================================================================  ===========================

What differs from our own state, and how it is converted:

* parameter names: DDP prefixes ``module.``, FSDP1 may leave ``_fsdp_wrapped_module.`` (and activation
  checkpointing ``_checkpoint_wrapped_module.``, compile ``_orig_mod.``) in names; they are removed.
* optimizer state: keyed by parameter index (DDP ``optim.state_dict()``) or by name (FSDP), with OLMo's extra
  param-group fields (``sharded``, ``param_names``, ``max_grad_norm``...). The per-parameter tensors (``step``,
  ``exp_avg``, ``exp_avg_sq``) move over by name into this run's optimizer; its param groups and
  hyperparameters stay this run's, as in OLMo, where the learning rate and weight decay on resume come from
  the config, not the checkpoint.
* ``train.pt``: a pickle holding ``pathlib`` paths and numpy's RNG state besides plain values. It is read with
  ``weights_only=True`` and an allowlist of exactly those classes; anything else is refused.
* olmo-core optimizer param groups are pickles stored as byte tensors; they are read with an unpickler that
  admits no class at all (plain containers, numbers and strings only).
"""

from __future__ import annotations

import io
import json
import logging
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..exceptions import OLMoCheckpointError
from .safe_reads import check_shapes, safe_torch_load

__all__ = [
    "detect_layout",
    "describe_dir",
    "clean_name",
    "clean_model_state",
    "load_train_state",
    "convert_trainer_state",
    "convert_optim_state",
    "read_olmo_core",
]

log = logging.getLogger(__name__)

CONVERT_COMMAND = "python scripts/convert_olmo_checkpoint.py"
_WRAPPER_PARTS = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def detect_layout(root: Path) -> Optional[str]:
    """The original trainer's layout of directory ``root`` (see the module docs), or None if it is none of them."""
    if (root / "model.pt").is_file() or (root / "model.safetensors").is_file():
        return "unsharded"
    if (root / "model_and_optim" / ".metadata").is_file():
        return "torch_new"
    if (root / "model" / "metadata.json").is_file() or (root / "optim" / "metadata.json").is_file():
        return "olmo_core"
    if (root / "metadata.yaml").is_file() or (root / "model" / "rank0.pt").is_file():
        return "local"
    if (root / "rank0.pt").is_file():
        return "torch_legacy"
    return None


def describe_dir(root: Path, limit: int = 8) -> str:
    """A short listing of what ``root`` holds, for error messages."""
    try:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())
    except OSError as e:
        return f"(unreadable: {e.strerror or e})"
    if not entries:
        return "nothing (an empty directory)"
    shown = ", ".join(entries[:limit])
    return shown + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


def clean_name(name: str) -> str:
    """A parameter name without DDP's ``module.`` prefix and FSDP1/checkpointing/compile wrapper parts."""
    name = _WRAPPER_PARTS.sub("", name)
    return name[len("module.") :] if name.startswith("module.") else name


def clean_model_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every key passed through :func:`clean_name`."""
    cleaned = {clean_name(k): v for k, v in state.items()}
    if len(cleaned) != len(state):
        raise OLMoCheckpointError(
            "The model state holds two parameters whose names differ only by wrapper prefixes."
        )
    return cleaned


# --------------------------------------------------------------------------------------------------
# train.pt


def _train_state_globals() -> list[Any]:
    """The classes an original ``train.pt`` may hold besides tensors and plain values."""
    from numpy.core import multiarray  # numpy<2 wrote this name; numpy>=2 still resolves it

    allowed: list[Any] = [np.ndarray, np.dtype, (multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        allowed.append(getattr(pathlib, name))
    if hasattr(np, "_core"):
        allowed.append((np._core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"))
    # numpy>=1.25 pickles a dtype as its class in numpy.dtypes (e.g. UInt32DType) when written by numpy 2.
    for dtype_class in vars(getattr(np, "dtypes", object())).values():
        if isinstance(dtype_class, type) and issubclass(dtype_class, np.dtype):
            allowed.append(dtype_class)
    return allowed


def load_train_state(path: Path) -> dict[str, Any]:
    """Read an original ``train.pt`` weights-only, admitting only paths and numpy RNG arrays besides plain values.

    :raises OLMoCheckpointError: for a missing or unreadable file, or one holding any other object.
    """
    state = safe_torch_load(path, mmap=False, allowed_globals=_train_state_globals())
    if not isinstance(state, dict) or "global_step" not in state:
        raise OLMoCheckpointError(
            f"'{path}' is not an OLMo trainer state (no 'global_step'); resume with --reset_trainer_state."
        )
    return state


def _convert_rng(rng: Any) -> Optional[dict[str, Any]]:
    """OLMo's ``{"python": random.getstate(), "numpy": np.random.get_state(), "torch": ..., "cuda": ...}`` in our
    RNG-state format (:mod:`olmo.util.rng`), or None when it is absent or not in that shape."""
    try:
        version, internal, gauss = rng["python"]
        name, keys, pos, has_gauss, cached = rng["numpy"]
        state: dict[str, Any] = {
            "python": {"version": int(version), "internal": [int(x) for x in internal], "gauss": gauss},
            "numpy": {
                "name": str(name),
                "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": rng["torch"],
        }
        if isinstance(rng.get("cuda"), torch.Tensor):
            state["cuda"] = rng["cuda"]
        return state
    except (KeyError, TypeError, ValueError):
        return None


def convert_trainer_state(state: dict[str, Any], rank: int, world_size: int, sharded: bool) -> dict[str, Any]:
    """An original trainer state (``train.pt`` / ``train/rank{R}.pt``) as ours.

    The data position is the global count of instances seen this epoch (legacy ``global_train_examples_seen``
    when that is what the checkpoint has). The RNG of an unsharded checkpoint is rank 0's, and OLMo gives it to
    every rank; a sharded one holds each rank's own.

    :raises OLMoCheckpointError: for a state without a data position.
    """
    examples = state.get("global_train_examples_seen_this_epoch", state.get("global_train_examples_seen"))
    if examples is None:
        raise OLMoCheckpointError(
            "This original OLMo trainer state predates its data-position counter (no "
            "'global_train_examples_seen_this_epoch'), so where the data stopped is unknown. Resume with "
            "--reset_trainer_state plus --fast_forward_batches=<the step it stopped at>."
        )
    rng = _convert_rng(state.get("rng"))
    saved_world_size = int(state.get("world_size", 0)) or None
    return {
        "global_step": int(state["global_step"]),
        "epoch": int(state.get("epoch") or 0),
        "global_train_examples_seen_this_epoch": int(examples),
        "global_train_tokens_seen": int(state.get("global_train_tokens_seen", 0)),
        "world_size": saved_world_size,
        "rng": {} if rng is None else ({rank: rng} if sharded else {r: rng for r in range(world_size)}),
    }


# --------------------------------------------------------------------------------------------------
# optimizer state


def _optim_state_by_name(osd: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
    """``{clean parameter name: {state key: value}}`` from an original optimizer state dict, keyed by index or name."""
    try:
        groups, state = osd["param_groups"], osd["state"]
        by_id: dict[Any, str] = {}
        for group in groups:
            names = group.get("param_names", group["params"])
            for name, pid in zip(names, group["params"]):
                if not isinstance(name, str):
                    raise ValueError("param group without parameter names")
                by_id[pid] = clean_name(name)
        return {by_id.get(pid, clean_name(str(pid))): dict(values) for pid, values in state.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise OLMoCheckpointError(
            f"The optimizer state in '{path}' is not an OLMo optimizer state ({type(e).__name__}: {e}). Pass "
            f"--reset_optimizer_state to load the model weights only."
        ) from None


# The per-parameter state each of our optimizers keeps (torch's AdamW without amsgrad, our LionW).
_STATE_KEYS = {"AdamW": {"step", "exp_avg", "exp_avg_sq"}, "LionW": {"exp_avg"}}


def convert_optim_state(
    osd: Optional[dict[str, Any]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str,
    by_name: Optional[dict[str, dict[str, Any]]] = None,
) -> dict[str, Any]:
    """The original optimizer state ``osd`` (or its per-name state ``by_name``) as a full optimizer state dict
    of ``optimizer`` (the form ``set_optimizer_state_dict(..., full_state_dict=True)`` takes).

    The per-parameter tensors come from the checkpoint, matched by name; the param groups and their
    hyperparameters are this run's.

    :raises OLMoCheckpointError: when parameters, state keys (another optimizer) or sizes do not match.
    """
    theirs = by_name if by_name is not None else _optim_state_by_name(osd or {}, path)
    names = {param: clean_name(name) for name, param in model.named_parameters()}
    shapes = {clean_name(name): tuple(param.shape) for name, param in model.named_parameters()}
    missing = sorted(set(shapes) - set(theirs))
    unexpected = sorted(set(theirs) - set(shapes))
    if missing or unexpected:
        raise OLMoCheckpointError(
            f"The optimizer state in '{path}' does not cover this model's parameters (missing: {missing[:4]}, "
            f"unexpected: {unexpected[:4]}). Check model.* against the checkpoint's config.yaml, or pass "
            f"--reset_optimizer_state to load the model weights only."
        )
    keys = _STATE_KEYS.get(type(optimizer).__name__)
    state: dict[str, dict[str, Any]] = {}
    for name, values in theirs.items():
        if keys is not None and set(values) != keys:
            raise OLMoCheckpointError(
                f"The optimizer state in '{path}' holds {sorted(values)} for '{name}', but this run's "
                f"{type(optimizer).__name__} keeps {sorted(keys)}: the checkpoint was written with another "
                f"optimizer. Set optimizer.name to the checkpoint's (see its config.yaml) or pass "
                f"--reset_optimizer_state."
            )
        converted: dict[str, Any] = {}
        for key, value in values.items():
            value = torch.as_tensor(value)
            if key != "step":
                numel = int(np.prod(shapes[name], dtype=np.int64))
                if value.numel() != numel:
                    raise OLMoCheckpointError(
                        f"The optimizer state in '{path}' has {key} of '{name}' with {value.numel()} elements; this "
                        f"model's parameter has {numel}. Check model.* against the checkpoint's config.yaml, or "
                        f"pass --reset_optimizer_state."
                    )
                value = value.reshape(shapes[name])
            converted[key] = value
        state[name] = converted
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------------------------------
# olmo-core 0.1 sharded layout


class _PlainUnpickler(pickle.Unpickler):
    """Admits no class or function: only containers, numbers, strings, bytes, booleans and None."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _unpickle_plain(data: torch.Tensor, what: str) -> Any:
    try:
        return _PlainUnpickler(io.BytesIO(data.numpy().tobytes())).load()
    except Exception as e:
        raise OLMoCheckpointError(f"Refusing to load {what}: it is not a plain pickled value ({e}).") from None


def _flat_ranges(spec: dict[str, Any], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The flattened index ranges of the full tensor that one file's shard holds."""
    if spec.get("flattened_offsets") is not None:
        return [(int(a), int(b)) for a, b in spec["flattened_offsets"]]
    local, offset = spec.get("local_shape"), spec.get("global_offset")
    if local is None or offset is None:
        raise ValueError("a shard spec without offsets")
    if len(shape) == 1:
        return [(offset[0], offset[0] + local[0])]
    if len(shape) == 2:
        return [
            (r * shape[1] + offset[1], r * shape[1] + offset[1] + local[1])
            for r in range(offset[0], offset[0] + local[0])
        ]
    raise ValueError(f"a {len(shape)}-d tensor sharded by shape (only 1-d and 2-d are written by olmo-core 0.1)")


def read_olmo_core(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an olmo-core ``model/`` or ``optim/`` folder, unsharded (full tensors on the CPU).

    :raises OLMoCheckpointError: for a missing or damaged ``metadata.json`` or shard file, or a tensor whose shards
        do not cover it.
    """
    from safetensors import SafetensorError, safe_open

    meta_path = folder / "metadata.json"
    try:
        tensors = json.loads(meta_path.read_text())["tensors"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise OLMoCheckpointError(
            f"'{meta_path}' is missing or damaged ({type(e).__name__}: {e}); the olmo_core checkpoint is incomplete."
        ) from None
    out: dict[str, torch.Tensor] = {}
    handles: dict[str, Any] = {}
    try:
        for key, meta in tensors.items():
            shape = tuple(int(s) for s in meta["shape"])
            if any(s < 0 for s in shape):
                raise ValueError(f"'{key}' has the shape {list(shape)}")
            numel = int(np.prod(shape, dtype=np.int64))
            # Every shard is read and matched against the ranges it claims before the full tensor is allocated, so
            # a damaged or crafted shape can never ask for more memory than the files hold.
            pieces: list[tuple[list[tuple[int, int]], torch.Tensor]] = []
            for fname, spec in meta["shard_spec_per_file"].items():
                ranges = [(a, b) for a, b in _flat_ranges(spec, shape) if b > a]
                if not ranges:
                    continue  # this rank held none of it (and wrote nothing)
                if fname not in handles:
                    handles[fname] = safe_open(str(folder / fname), framework="pt")
                local = handles[fname].get_tensor(key).reshape(-1)
                claimed = sum(end - start for start, end in ranges)
                if claimed != local.numel() or not all(0 <= a and b <= numel for a, b in ranges):
                    raise ValueError(
                        f"{fname} holds {local.numel()} elements of '{key}' (shape {list(shape)}) but its metadata "
                        f"places {claimed} at {ranges[:3]}"
                    )
                pieces.append((ranges, local))
                if not meta.get("is_sharded", True):
                    break  # replicated: every rank wrote the whole tensor
            if not pieces:
                raise ValueError(f"no file holds '{key}'")
            covered = sum(local.numel() for _, local in pieces)
            if covered < numel:
                raise ValueError(f"its shards cover {covered} of the {numel} elements of '{key}'")
            flat = torch.empty(numel, dtype=pieces[0][1].dtype)
            for ranges, local in pieces:
                pos = 0
                for start, end in ranges:
                    flat[start:end] = local[pos : pos + end - start]
                    pos += end - start
            out[key] = flat.reshape(shape)
    except (OSError, SafetensorError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise OLMoCheckpointError(
            f"Could not read the olmo_core checkpoint folder '{folder}' ({type(e).__name__}: {e}). It is incomplete "
            f"or damaged; copy it again."
        ) from None
    return out


def olmo_core_optim_by_name(flat: dict[str, torch.Tensor], folder: Path) -> dict[str, dict[str, Any]]:
    """``{parameter name: {state key: tensor}}`` from the tensors of an olmo-core ``optim/`` folder."""
    try:
        state_keys = _unpickle_plain(flat["state_keys"], f"{folder}/state_keys")
        n_groups = int(flat["num_param_groups"].item())
        names: list[str] = []
        for i in range(n_groups):
            group = _unpickle_plain(flat[f"param_group{i}"], f"{folder}/param_group{i}")
            names.extend(str(n) for n in group["_param_names"])
    except (KeyError, TypeError) as e:
        raise OLMoCheckpointError(f"'{folder}' is not an olmo-core optimizer state (no {e}).") from None
    by_name: dict[str, dict[str, Any]] = {}
    for name in names:
        values = {k: flat[f"state.{name}.__{k}"] for k in state_keys if f"state.{name}.__{k}" in flat}
        if values:
            by_name[clean_name(name)] = values
    return by_name


def load_olmo_core(
    root: Path, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]
) -> dict[str, Any]:
    """Load an olmo_core-layout checkpoint into ``model`` (and ``optimizer``) in one process; return its trainer
    state with every rank's RNG (as our unsharded ``train.pt`` holds it).

    Reads the full tensors into memory: meant for ``scripts/convert_olmo_checkpoint.py``, not for every rank of
    a training run.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from .save import FULL_STATE

    model_sd = clean_model_state(read_olmo_core(root / "model"))
    check_shapes(str(root / "model"), model_sd, {clean_name(k): v for k, v in model.state_dict().items()})
    set_model_state_dict(model, model_sd, options=FULL_STATE)
    if optimizer is not None:
        by_name = olmo_core_optim_by_name(read_olmo_core(root / "optim"), root / "optim")
        converted = convert_optim_state(None, model, optimizer, str(root / "optim"), by_name=by_name)
        set_optimizer_state_dict(model, optimizer, converted, options=FULL_STATE)
    return merged_train_state(root)


def merged_train_state(root: Path, original: bool = True) -> dict[str, Any]:
    """The trainer state of a sharded checkpoint as an unsharded ``train.pt`` holds it: rank 0's, with every rank's
    RNG from its ``train/rank{R}.pt``, so a resume with the saving world size restores each rank's RNG exactly.

    :param original: the checkpoint was written by the original OLMo trainer (its states are converted to ours);
        False for one written by this trainer.
    :raises OLMoCheckpointError: when ``train/`` holds no ``rank{R}.pt``, or one cannot be read.
    """
    ranks = {int(p.stem[4:]): p for p in (root / "train").glob("rank*.pt") if p.stem[4:].isdigit()}
    if not ranks:
        raise OLMoCheckpointError(
            f"'{root}/train/' holds no rank*.pt trainer state; the checkpoint is incomplete."
        )
    states = []
    for rank, path in sorted(ranks.items()):
        if original:
            state = convert_trainer_state(load_train_state(path), rank, 1, sharded=True)
        else:
            state = safe_torch_load(path)
            if not isinstance(state, dict):
                raise OLMoCheckpointError(f"'{path}' holds a {type(state).__name__}, not a trainer state.")
        states.append(state)
    rng: dict[Any, Any] = {}
    for state in states:
        rng.update(state.get("rng", {}))
    return {**states[0], "rng": rng}
