"""Checkpoints: atomic save, verified load, discovery and retention.

Layouts (inside ``save_folder``):

* ``stepN-unsharded/``: ``config.yaml``, ``model.pt``, ``optim.pt``, ``train.pt`` (OLMo's layout; keys
  like ``transformer.blocks.0.att_proj.weight``). ``model.safetensors`` is accepted on load.
* ``stepN/``: sharded, written with ``torch.distributed.checkpoint`` under ``model_and_optim/`` plus
  ``train/rank{R}.pt``; loadable with a different world size.

Commit protocol: everything is written into a hidden temporary directory next to the target, each
file is fsynced, the marker ``.olmo-checkpoint.json`` (kind, step, file sizes) is written last, and
the directory is renamed into place. A directory without the marker is never discovered, and an
explicit ``load_path`` to one is refused unless it is a complete original-OLMo checkpoint. Nothing
is ever written into a committed directory. Loads use ``weights_only=True``; the trainer state holds
only plain Python values and tensors.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from ..distributed.tensor_parallel import order_fused_rows
from ..exceptions import OLMoCheckpointError, OLMoError
from ..util import is_url, redact_url
from ..util.checkpoint_dirs import STEP_DIR, CheckpointInfo, find_latest_checkpoint, list_checkpoints
from ..util.remote_files import RemoteAccessDenied, RemoteTimeoutError
from .dcp_reader import DirectFileSystemReader
from .kept_inputs import canonical_entry
from .olmo_formats import (
    CONVERT_COMMAND,
    clean_model_state,
    convert_optim_state,
    convert_trainer_state,
    describe_dir,
    detect_layout,
    load_train_state,
)
from .safe_reads import (
    MARKER,
    ModelMismatchError,
    SafeLoadPlanner,
    check_shapes,
    check_trainer_state,
    fetch,
    load_state_file,
    read_dcp_metadata,
    read_marker,
    root_cause,
    safe_torch_load,
)
from .save import (
    FORMAT_VERSION,
    FULL_STATE,
    PendingCheckpoint,
    begin_checkpoint,
    commit_checkpoint,
    model_and_optim_state,
    plain_tensors,
    rank,
    save_checkpoint,
)

__all__ = [
    "MARKER",
    "CheckpointInfo",
    "ModelMismatchError",
    "find_latest_checkpoint",
    "list_checkpoints",
    "check_shapes",
    "sharded_model_shapes",
    "trainer_state",
    "delete_checkpoint",
    "inspect_checkpoint",
    "save_checkpoint",
    "begin_checkpoint",
    "model_and_optim_state",
    "commit_checkpoint",
    "PendingCheckpoint",
    "FORMAT_VERSION",
    "load_checkpoint",
    "prune_checkpoints",
    "remove_ephemeral_checkpoints",
]

log = logging.getLogger(__name__)


def _where_checkpoints_are(path: Path, flag: str) -> str:
    """Advice for a checkpoint path that is not there: the checkpoints that are beside it, if any."""
    near = [c.path for c in list_checkpoints(path.parent)][-3:]
    if near:
        return f"Checkpoints beside it: {', '.join(near)}; point {flag} at one of them."
    resume = (
        " (or, in train.py, resume a run's newest with --try_load_latest_save)" if flag == "--load_path" else ""
    )
    return (
        f"'{path.parent}' holds no committed checkpoint; point {flag} at a step*/ directory with a {MARKER} file, "
        f"as runs/RUN_NAME/step1000-unsharded{resume}."
    )


def inspect_checkpoint(path: str, flag: str = "--load_path", convertible: bool = False) -> CheckpointInfo:
    """Check that ``path`` is a complete, committed checkpoint, before anything is built or written.

    :param flag: how the user gave ``path`` (``--load_path``, ``CHECKPOINT_DIR``), for the messages.
    :param convertible: also accept an original OLMo ``olmo_core`` checkpoint, which only
        ``scripts/convert_olmo_checkpoint.py`` reads.
    :raises OLMoCheckpointError: for a missing, temporary, partial, damaged or unrecognised directory.
    """
    name = path.rstrip("/").split("/")[-1]
    match = STEP_DIR.match(name)
    if is_url(path):
        return _inspect_remote(path, match)
    root = Path(path)
    if not root.is_dir():
        raise OLMoCheckpointError(
            f"{flag} '{path}' does not exist or is not a directory. {_where_checkpoints_are(root, flag)}"
        )
    if ".tmp-" in name:
        raise OLMoCheckpointError(
            f"{flag} '{path}' is a temporary directory left by an interrupted save; it is incomplete. "
            f"Use the newest step*/ directory instead (or --try_load_latest_save) and delete this one."
        )
    marker = root / MARKER
    if marker.is_file():
        meta = read_marker(marker)
        for rel, size in meta["files"].items():
            f = root / rel
            if not f.is_file() or f.stat().st_size != size:
                raise OLMoCheckpointError(
                    f"Checkpoint '{path}' is damaged: '{rel}' is missing or has the wrong size (expected "
                    f"{size} bytes). It may have been copied incompletely; copy it again or pick another."
                )
        if match and (int(match.group(1)), match.group(2) is None) != (meta["step"], meta["sharded"]):
            kind = "sharded" if meta["sharded"] else "unsharded"
            named = f"step{meta['step']}" + ("" if meta["sharded"] else "-unsharded")
            raise OLMoCheckpointError(
                f"Checkpoint '{path}' does not match its own marker ({MARKER} says step {meta['step']}, {kind}): it "
                f"was renamed or copied over another. Rename it back to {named}, or pick another checkpoint."
            )
        return CheckpointInfo(str(root), meta["step"], meta["sharded"], True)
    return _inspect_original(root, path, flag, int(match.group(1)) if match else 0, convertible)


def _inspect_original(root: Path, path: str, flag: str, step: int, convertible: bool) -> CheckpointInfo:
    """A directory without our marker: a complete checkpoint of the original OLMo trainer, or an error saying
    what the directory holds and what a checkpoint must hold."""
    from .olmo_core_v3 import is_olmo_core_checkpoint

    if is_olmo_core_checkpoint(root):
        raise OLMoCheckpointError(
            f"{flag} '{path}' is a checkpoint of OLMo-core's trainer (model_and_optim/ with its config.json). Convert "
            f"it once into a checkpoint this trainer loads (weights, AdamW state, model config):\n"
            f"    {CONVERT_COMMAND} {path} {path.rstrip('/')}-converted\n"
            f"then pass {flag}={path.rstrip('/')}-converted --reset_trainer_state."
        )
    layout = detect_layout(root)
    complete = (root / "config.yaml").is_file()  # the original trainer writes it last
    if layout is None:
        raise OLMoCheckpointError(
            f"{flag} '{path}' is not a checkpoint: it holds {describe_dir(root)}. Expected a directory written by "
            f"this trainer (stepN/ or stepN-unsharded/ with a {MARKER} marker; one without it is a save that did "
            f"not finish), or one written by the original OLMo trainer (config.yaml with model.pt, "
            f"model_and_optim/, or model/ + optim/). Pick another step*/ directory or use --try_load_latest_save."
        )
    if not complete:
        raise OLMoCheckpointError(
            f"{flag} '{path}' is not a committed checkpoint: it has neither our {MARKER} marker nor the "
            f"config.yaml the original OLMo trainer writes last ({layout} layout), so the save that wrote it did not "
            f"finish or the copy is incomplete (it holds {describe_dir(root)}). Copy it again or pick an earlier "
            f"step*/ directory (or use --try_load_latest_save)."
        )
    if layout == "olmo_core" and not convertible:
        raise OLMoCheckpointError(
            f"{flag} '{path}' is an original OLMo sharded checkpoint in the olmo_core layout (model/, optim/, "
            f"train/). Convert it once into a checkpoint this trainer loads directly:\n"
            f"    {CONVERT_COMMAND} {path} {path.rstrip('/')}-converted\n"
            f"then pass {flag}={path.rstrip('/')}-converted."
        )
    if layout in ("local", "torch_legacy"):
        raise OLMoCheckpointError(
            f"{flag} '{path}' is an original OLMo sharded checkpoint in the {layout} layout, which can be read only "
            f"with the torch version and world size that wrote it. Unshard it with the original OLMo "
            f"(`python scripts/unshard.py {path} OUT --type {layout}` in its repository), then pass "
            f"{flag}=OUT (an unsharded checkpoint loads here directly)."
        )
    log.warning(
        "'%s' has no %s marker; loading it as an original OLMo checkpoint (%s layout).", path, MARKER, layout
    )
    return CheckpointInfo(str(root), step, layout in ("torch_new", "olmo_core"), False, layout=layout)


def _inspect_remote(url: str, match: Optional[re.Match]) -> CheckpointInfo:
    base = url.rstrip("/")
    try:
        marker = fetch(base, MARKER)
    except (RemoteTimeoutError, RemoteAccessDenied) as e:
        raise OLMoCheckpointError(f"--load_path '{redact_url(url)}' cannot be read: {e}") from None
    except OLMoError:
        try:
            fetch(base, "config.yaml")  # the original trainer writes it last; our uploads send it next to last
        except (RemoteTimeoutError, RemoteAccessDenied) as e:
            raise OLMoCheckpointError(f"--load_path '{redact_url(url)}' cannot be read: {e}") from None
        except OLMoError:
            raise OLMoCheckpointError(
                f"--load_path '{redact_url(url)}' has neither our {MARKER} marker nor a config.yaml: it is not a checkpoint, "
                f"or its upload did not finish. Point --load_path at a complete stepN-unsharded folder."
            ) from None
        log.warning("No %s marker at %s; treating it as an original OLMo unsharded checkpoint.", MARKER, url)
        return CheckpointInfo(base, int(match.group(1)) if match else 0, False, False, layout="unsharded")
    meta = read_marker(marker)
    if meta["sharded"]:
        raise OLMoCheckpointError(
            f"'{url}' is a sharded checkpoint; sharded checkpoints load from local directories only. Download "
            f"it (the whole directory) and give its local path, or use an unsharded (stepN-unsharded) checkpoint."
        )
    return CheckpointInfo(base, meta["step"], False, True)


def load_checkpoint(
    info: CheckpointInfo,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    load_trainer_state: bool = True,
) -> Optional[dict[str, Any]]:
    """Restore model (and optimizer unless None) in place; return this rank's trainer state or None.

    Every file is read without executing code from it (see :mod:`olmo.checkpoint.safe_reads`).

    :raises OLMoCheckpointError: if a file is refused or the tensors do not match the model's shapes.
    """
    if info.sharded:
        return _load_sharded(info, model, optimizer, load_trainer_state)
    original = info.layout != "olmo-trainer"
    model_sd = load_state_file(info.path, "model")
    if original:
        model_sd = clean_model_state(model_sd)
    model_sd = _held(model, model_sd)
    check_shapes(info.path, model_sd, get_model_state_dict(model))
    set_model_state_dict(model, model_sd, options=FULL_STATE)
    if optimizer is not None:
        optim_sd = load_state_file(info.path, "optim")
        if original:
            optim_sd = convert_optim_state(optim_sd, model, optimizer, info.path)
        if getattr(model, "holds_part", False) and isinstance(optim_sd.get("state"), dict):
            # This stage's parameters' state, under this run's groups (as a sharded load keeps them).
            current = get_optimizer_state_dict(model, optimizer, options=FULL_STATE)
            names = set(model_sd)
            held = {k: v for k, v in optim_sd["state"].items() if k in names}
            optim_sd = {"state": held, "param_groups": current["param_groups"]}
        try:
            set_optimizer_state_dict(model, optimizer, optim_sd, options=FULL_STATE)
        except (KeyError, ValueError, RuntimeError) as e:
            raise OLMoCheckpointError(
                f"The optimizer state in '{info.path}' does not fit this optimizer ({e}). Pass "
                f"--reset_optimizer_state to load the model weights only."
            ) from None
        _unmap_optimizer_state(optimizer, optim_sd)
    order_fused_rows(model, optimizer)  # canonical rows to tensor parallelism's rank-major ones
    if not load_trainer_state:
        return None
    return trainer_state(info)


def _held(model: nn.Module, saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (a checkpoint's model entries) restricted to the parameters ``model`` holds when it is a pipeline
    stage's part of the model (the others are the other stages'; the launch checked them against the whole model)."""
    if not getattr(model, "holds_part", False):
        return saved
    names = set(get_model_state_dict(model))
    return {k: v for k, v in saved.items() if k in names}


def _unmap_optimizer_state(optimizer: torch.optim.Optimizer, loaded: Any) -> None:
    """Give the optimizer its own copy of every state tensor it took over from the memory-mapped ``optim.pt``.

    ``load_state_file`` maps the file (no read up front), and on CPU the optimizer adopts those tensors as they are.
    Its first step then writes every page of a private file mapping, and each write faults in a copy of its 4 KiB
    page: 8-9 s for OLMo-300M's 3 GB of moments on the 2-core VM, paid by the first step after a restart
    (RESEARCH_LOG 2026-11-26). A copy now, into ordinary memory, costs a fraction of that."""
    mapped: set[int] = set()

    def collect(obj: Any) -> None:
        if type(obj) is torch.Tensor:  # a plain tensor (not a DTensor: those are built from copies)
            if obj.device.type == "cpu" and obj.numel():
                mapped.add(obj.untyped_storage().data_ptr())
        elif isinstance(obj, dict):
            for value in obj.values():
                collect(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                collect(value)

    collect(loaded)
    for state in optimizer.state.values():
        for key, value in state.items():
            if type(value) is torch.Tensor and value.numel() and value.untyped_storage().data_ptr() in mapped:
                state[key] = value.clone()


def trainer_state(info: CheckpointInfo) -> dict[str, Any]:
    """This rank's trainer state (rank 0's when the checkpoint was saved by fewer ranks)."""
    if not info.sharded:
        path = fetch(info.path, "train.pt")
    else:
        own = Path(info.path) / "train" / f"rank{rank()}.pt"
        path = own if own.is_file() else Path(info.path) / "train" / "rank0.pt"
    if info.layout != "olmo-trainer":
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        own_rng = info.sharded and path.name == f"rank{rank()}.pt"
        original = load_train_state(path)
        check_trainer_state(path, original, ours=False)
        return convert_trainer_state(original, rank(), world_size, own_rng)
    shown = f"{info.path.rstrip('/')}/train.pt" if not info.sharded else str(path)
    state = safe_torch_load(path, name=shown)
    if not isinstance(state, dict):
        raise OLMoCheckpointError(f"'{shown}' holds a {type(state).__name__}, not a trainer state.")
    return state


def _load_sharded(
    info: CheckpointInfo, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], load_trainer_state: bool
) -> Optional[dict[str, Any]]:
    folder = str(Path(info.path) / "model_and_optim")
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if info.layout != "olmo-trainer":
            # The original (torch_new) stores the same names, but its param groups carry OLMo's own fields: load
            # the per-parameter tensors only and keep this run's groups and hyperparameters, as OLMo does.
            state["optim"] = {"state": optim_sd["state"]}
            _check_original_optim_keys(info.path, folder, optim_sd["state"])  # type: ignore[arg-type]
    else:
        state = {"model": get_model_state_dict(model)}
    plain_tensors(state)  # float8 weights read into their plain memory, as they were written (save.plain_tensors)
    check_shapes(info.path, _held(model, sharded_model_shapes(folder)), state["model"])
    try:
        dcp.load(state, storage_reader=DirectFileSystemReader(folder), planner=SafeLoadPlanner())
    except CheckpointException as e:
        cause = root_cause(e)
        if isinstance(cause, OLMoError):
            raise cause from None
        raise OLMoCheckpointError(
            f"Could not load the sharded checkpoint '{info.path}' ({type(cause).__name__}: {cause}). It is "
            f"damaged or was not written by this trainer; load another checkpoint."
        ) from None
    if optimizer is not None:
        optim_loaded = {"state": state["optim"]["state"], "param_groups": optim_sd["param_groups"]}
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_loaded)
    else:
        set_model_state_dict(model, state["model"])
    order_fused_rows(model, optimizer)
    if not load_trainer_state:
        return None
    return trainer_state(info)


def _check_original_optim_keys(path: str, folder: str, wanted: dict[str, dict[str, Any]]) -> None:
    """Every per-parameter optimizer tensor this run needs is in the original sharded checkpoint."""
    saved = set(read_dcp_metadata(folder).state_dict_metadata)
    missing = [
        f"{name}.{key}"
        for name, values in wanted.items()
        for key in values
        if f"optim.state.{name}.{key}" not in saved
    ]
    if missing:
        raise OLMoCheckpointError(
            f"The optimizer state in '{path}' lacks {len(missing)} of this run's optimizer tensors (e.g. "
            f"{missing[:3]}): it was written with another optimizer or model. Set optimizer.name and model.* to the "
            f"checkpoint's (see its config.yaml), or pass --reset_optimizer_state to load the model weights only."
        )


def sharded_model_shapes(folder: str) -> dict[str, tuple]:
    metadata = read_dcp_metadata(folder)
    return {
        k[len("model.") :]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


def prune_checkpoints(
    folder: os.PathLike | str, sharded: bool, keep: int, kept: Collection[Path] = ()
) -> list[Path]:
    """Delete the oldest committed checkpoints of one kind so that ``keep`` remain (-1 keeps all).

    :param kept: checkpoints never deleted, nor counted (as :func:`~olmo.checkpoint.kept_inputs.kept_checkpoints`
        gives them: what the run reads)."""
    if keep < 0 or rank() != 0:
        return []
    mine = [c for c in _deletable(folder, kept) if c.sharded == sharded and not c.ephemeral]
    doomed = mine[: max(0, len(mine) - max(keep, 1))]
    for c in doomed:
        delete_checkpoint(c)
    return [Path(c.path) for c in doomed]


def remove_ephemeral_checkpoints(
    folder: os.PathLike | str, keep_step: Optional[int] = None, kept: Collection[Path] = ()
) -> list[Path]:
    """Delete ephemeral checkpoints except the one at ``keep_step`` and those in ``kept`` (rank 0 does the work)."""
    if rank() != 0:
        return []
    doomed = [c for c in _deletable(folder, kept) if c.ephemeral and c.step != keep_step]
    for c in doomed:
        delete_checkpoint(c)
    return [Path(c.path) for c in doomed]


def _deletable(folder: os.PathLike | str, kept: Collection[Path]) -> list[CheckpointInfo]:
    """The committed checkpoints of ``folder``, oldest first, without those in ``kept``."""
    found = list_checkpoints(folder)
    if not kept:
        return found
    mine = [c for c in found if canonical_entry(Path(c.path)) not in kept]
    for c in found:
        if c not in mine:
            log.warning("Keeping checkpoint %s: this run reads it (a reference or data inside it).", c.path)
    return mine


def delete_checkpoint(checkpoint: CheckpointInfo) -> None:
    """Delete a committed checkpoint of this run. A symlink is removed as a link: what it points to (perhaps another
    run's checkpoint) is never touched."""
    path = Path(checkpoint.path)
    if path.is_symlink():
        path.unlink()
        return
    # Un-commit first (remove the marker), so a crash mid-delete never leaves a half-deleted checkpoint
    # that still looks committed.
    (path / MARKER).unlink()
    shutil.rmtree(path)
