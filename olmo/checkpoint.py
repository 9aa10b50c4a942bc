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

import json
import logging
import os
import re
import shutil
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from .checkpoint_io import (
    MARKER,
    SafeFileSystemReader,
    SafeLoadPlanner,
    describe_os_error,
    fetch,
    load_state_file,
    read_dcp_metadata,
    read_marker,
    root_cause,
    safe_torch_load,
)
from .config import TrainConfig
from .exceptions import OLMoCheckpointError, OLMoError
from .util import is_url

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
    "commit_checkpoint",
    "PendingCheckpoint",
    "FORMAT_VERSION",
    "load_checkpoint",
    "prune_checkpoints",
    "remove_ephemeral_checkpoints",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step(\d+)(-unsharded)?$")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class ModelMismatchError(OLMoCheckpointError):
    """A sound checkpoint of another model shape: the config is wrong, not the checkpoint."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory is, as far as we can tell without loading it."""

    path: str
    step: int
    sharded: bool
    marked: bool
    ephemeral: bool = False


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> dict[str, int]:
    """fsync every file under ``root`` and return their sizes (relative path -> bytes)."""
    sizes = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        sizes[str(path.relative_to(root))] = path.stat().st_size
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        _fsync_dir(d)
    return sizes


def list_checkpoints(folder: os.PathLike | str) -> list[CheckpointInfo]:
    """Committed checkpoints directly inside ``folder``, oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / MARKER).is_file():
            try:
                ephemeral = bool(read_marker(child / MARKER).get("ephemeral", False))
            except OLMoCheckpointError as e:
                log.warning("Ignoring checkpoint %s: %s", child, e)
                continue
            found.append(CheckpointInfo(str(child), int(match.group(1)), match.group(2) is None, True, ephemeral))
    # At equal steps the sharded checkpoint sorts last (it is the one resumes prefer, as in OLMo).
    return sorted(found, key=lambda c: (c.step, c.sharded))


def _is_committed(path: Path) -> bool:
    try:
        read_marker(path / MARKER)
        return True
    except OLMoCheckpointError:
        return False


def find_latest_checkpoint(folder: os.PathLike | str) -> Optional[Path]:
    """The newest committed checkpoint in ``folder`` (sharded wins a tie), or None."""
    checkpoints = list_checkpoints(folder)
    return Path(checkpoints[-1].path) if checkpoints else None


def inspect_checkpoint(path: str, flag: str = "--load_path") -> CheckpointInfo:
    """Check that ``path`` is a complete, committed checkpoint, before anything is built or written.

    :param flag: how the user gave ``path`` (``--load_path``, ``CHECKPOINT_DIR``), for the messages.
    :raises OLMoCheckpointError: for a missing, temporary, partial, damaged or unrecognised directory.
    """
    name = path.rstrip("/").split("/")[-1]
    match = _STEP_DIR.match(name)
    if is_url(path):
        return _inspect_remote(path, match)
    root = Path(path)
    if not root.is_dir():
        raise OLMoCheckpointError(
            f"{flag} '{path}' does not exist or is not a directory. Point {flag} at a checkpoint directory such "
            f"as {Path(path).parent}/step1000-unsharded (or resume with --try_load_latest_save)."
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
        return CheckpointInfo(str(root), meta["step"], meta["sharded"], True)
    # No marker: accept only a complete checkpoint written by the original OLMo trainer.
    has_model = (root / "model.pt").is_file() or (root / "model.safetensors").is_file()
    if (root / "config.yaml").is_file() and has_model:
        log.warning("'%s' has no %s marker; loading it as an original OLMo unsharded checkpoint.", path, MARKER)
        return CheckpointInfo(str(root), int(match.group(1)) if match else 0, False, False)
    raise OLMoCheckpointError(
        f"{flag} '{path}' is not a committed checkpoint: it has no {MARKER} marker (the save that wrote "
        f"it did not finish) and is not a complete OLMo checkpoint (config.yaml + model.pt). Pick an "
        f"earlier step*/ directory or use --try_load_latest_save."
    )


def _inspect_remote(url: str, match: Optional[re.Match]) -> CheckpointInfo:
    base = url.rstrip("/")
    try:
        marker = fetch(base, MARKER)
    except OLMoError:
        log.warning("No %s marker at %s; treating it as an original OLMo unsharded checkpoint.", MARKER, url)
        return CheckpointInfo(base, int(match.group(1)) if match else 0, False, False)
    meta = read_marker(marker)
    if meta["sharded"]:
        raise OLMoCheckpointError(
            f"'{url}' is a sharded checkpoint; sharded checkpoints load from local directories only. Download "
            f"it (the whole directory) and give its local path, or use an unsharded (stepN-unsharded) checkpoint."
        )
    return CheckpointInfo(base, meta["step"], False, True)


@dataclass
class PendingCheckpoint:
    """A checkpoint whose files are written (or being written in the background) into a temporary
    directory but not yet committed; :func:`commit_checkpoint` finishes it."""

    target: Path
    tmp: Path
    meta: dict[str, Any]
    config: Optional[TrainConfig]
    """Written as ``config.yaml`` at commit; None when the caller already put one in ``tmp``."""
    future: Optional[Future] = None

    def is_written(self) -> bool:
        """True when this rank's background write (if any) has finished."""
        return self.future is None or self.future.done()


def save_checkpoint(
    folder: os.PathLike | str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    config: TrainConfig,
    sharded: bool,
    overwrite: bool = False,
    ephemeral: bool = False,
) -> Path:
    """Write ``stepN/`` (sharded) or ``stepN-unsharded/`` atomically; every rank must call this.

    :param train_state: this rank's trainer state (plain values and tensors).
    :param overwrite: replace an existing committed checkpoint of the same step.
    :param ephemeral: mark a sharded checkpoint as ephemeral (see :func:`remove_ephemeral_checkpoints`).
    :raises OLMoCheckpointError: if the target exists and ``overwrite`` is false.
    """
    pending = begin_checkpoint(folder, step, model, optimizer, train_state, config, sharded, overwrite, ephemeral)
    return commit_checkpoint(pending)


def begin_checkpoint(
    folder: os.PathLike | str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    config: TrainConfig,
    sharded: bool,
    overwrite: bool = False,
    ephemeral: bool = False,
    background: bool = False,
) -> PendingCheckpoint:
    """Write a checkpoint's files into a temporary directory; every rank must call this.

    With ``background`` (sharded only), the model and optimizer state is first copied into fresh CPU
    buffers (so later optimizer steps cannot leak into this checkpoint) and then written by a background
    thread with ``torch.distributed.checkpoint.async_save``; the call returns once the copy is done.
    """
    root = Path(folder)
    target = root / (f"step{step}" if sharded else f"step{step}-unsharded")
    # A folder of that name that is not a committed checkpoint (a damaged marker) is invisible to
    # discovery; the commit replaces it.
    if _is_committed(target) and not overwrite:
        raise OLMoCheckpointError(
            f"Checkpoint '{target}' already exists. Resume from it with --try_load_latest_save, or pass "
            f"--save_overwrite to replace it."
        )
    # Every rank derives the same temporary name from rank 0's choice.
    token = [uuid.uuid4().hex[:8]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    tmp = root / f".{target.name}.tmp-{token[0]}"
    try:
        if _rank() == 0:
            tmp.mkdir(parents=True)
        _barrier()
        future = _write_state(tmp, model, optimizer, train_state, sharded, background)
    except (OSError, RuntimeError, CheckpointException) as e:  # torch.save reports a full disk as RuntimeError
        raise _save_failed(tmp, target, e) from None
    meta = {"format_version": FORMAT_VERSION, "step": step, "sharded": sharded, "ephemeral": ephemeral}
    return PendingCheckpoint(target, tmp, meta, config, future)


def _write_state(
    tmp: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    sharded: bool,
    background: bool,
) -> Optional[Future]:
    future: Any = None
    if sharded:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if background:
            stager = _stager(pinned=any(t.is_cuda for t in model.parameters()))
            if stager.in_flight is not None:
                stager.in_flight.result()  # its buffers are about to be reused
            response: Any = dcp.async_save(
                state,
                checkpoint_id=str(tmp / "model_and_optim"),
                process_group=_save_group(),
                async_stager=stager.stager,
            )
            future = stager.in_flight = getattr(response, "upload_completion", response)
        else:
            dcp.save(state, checkpoint_id=str(tmp / "model_and_optim"))
        (tmp / "train").mkdir(exist_ok=True)
        torch.save(train_state, tmp / "train" / f"rank{_rank()}.pt")
    else:
        model_sd = get_model_state_dict(model, options=_FULL)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=_FULL)
        if _rank() == 0:
            torch.save(model_sd, tmp / "model.pt")
            torch.save(optim_sd, tmp / "optim.pt")
            torch.save(train_state, tmp / "train.pt")
    return future


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 2**63


def _save_failed(tmp: Path, target: Path, e: BaseException) -> OLMoCheckpointError:
    """Remove a failed save's temporary directory and say what went wrong and what is still safe."""
    cause = root_cause(e)
    if isinstance(cause, OSError):
        reason = describe_os_error(cause)
    elif _free_bytes(target.parent) < 2**20:  # measured before the partial files are removed
        reason = "no space left on the device"
    else:
        reason = f"{type(cause).__name__}: {cause}"
    shutil.rmtree(tmp, ignore_errors=True)
    return OLMoCheckpointError(
        f"Could not write checkpoint '{target}': {reason}. The partial save was removed and the committed "
        f"checkpoints in '{target.parent}' are intact. Free some space (or fix the folder's permissions) and "
        f"relaunch with --try_load_latest_save to continue from the newest committed checkpoint."
    )


def commit_checkpoint(pending: PendingCheckpoint) -> Path:
    """Wait for the files, then publish the checkpoint: marker last, then an atomic rename. Collective."""
    try:
        if pending.future is not None:
            pending.future.result()
        _barrier()
        if _rank() == 0:
            _publish(pending)
    except (OSError, RuntimeError, CheckpointException) as e:
        raise _save_failed(pending.tmp, pending.target, e) from None
    _barrier()
    return pending.target


def _publish(pending: PendingCheckpoint) -> None:
    root, tmp, target = pending.target.parent, pending.tmp, pending.target
    if pending.config is not None:
        pending.config.save(tmp / "config.yaml")
    meta = {**pending.meta, "files": _fsync_tree(tmp)}
    (tmp / MARKER).write_text(json.dumps(meta, indent=1))
    _fsync_tree(tmp)
    if target.exists():
        trash = root / f".{target.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
        target.rename(trash)
        tmp.rename(target)
        shutil.rmtree(trash)
    else:
        tmp.rename(target)
    _fsync_dir(root)


_SAVE_GROUP: list[Any] = []


@dataclass
class _Stager:
    stager: Any
    in_flight: Optional[Future] = None


_STAGERS: dict[bool, _Stager] = {}


def _stager(pinned: bool) -> _Stager:
    """One staging area per process, reused by every background save: allocating ~12 bytes per parameter
    of fresh host memory for each save costs more than the copy. The copy is synchronous, so once
    ``async_save`` returns, training may change the weights without affecting the checkpoint."""
    if pinned not in _STAGERS:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        options = StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
        _STAGERS[pinned] = _Stager(DefaultStager(options))
    return _STAGERS[pinned]


def _save_group() -> Any:
    """A gloo group for background writes, so their collectives never interleave with training's."""
    if not dist.is_initialized():
        return None
    if not _SAVE_GROUP:
        _SAVE_GROUP.append(dist.new_group(backend="gloo"))
    return _SAVE_GROUP[0]


def load_checkpoint(
    info: CheckpointInfo,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    load_trainer_state: bool = True,
) -> Optional[dict[str, Any]]:
    """Restore model (and optimizer unless None) in place; return this rank's trainer state or None.

    Every file is read without executing code from it (see :mod:`olmo.checkpoint_io`).

    :raises OLMoCheckpointError: if a file is refused or the tensors do not match the model's shapes.
    """
    if info.sharded:
        return _load_sharded(info, model, optimizer, load_trainer_state)
    model_sd = load_state_file(info.path, "model")
    check_shapes(info.path, model_sd, get_model_state_dict(model))
    set_model_state_dict(model, model_sd, options=_FULL)
    if optimizer is not None:
        optim_sd = load_state_file(info.path, "optim")
        try:
            set_optimizer_state_dict(model, optimizer, optim_sd, options=_FULL)
        except (KeyError, ValueError, RuntimeError) as e:
            raise OLMoCheckpointError(
                f"The optimizer state in '{info.path}' does not fit this optimizer ({e}). Pass "
                f"--reset_optimizer_state to load the model weights only."
            ) from None
    if not load_trainer_state:
        return None
    return trainer_state(info)


def trainer_state(info: CheckpointInfo) -> dict[str, Any]:
    """This rank's trainer state (rank 0's when the checkpoint was saved by fewer ranks)."""
    if not info.sharded:
        path = fetch(info.path, "train.pt")
    else:
        own = Path(info.path) / "train" / f"rank{_rank()}.pt"
        path = own if own.is_file() else Path(info.path) / "train" / "rank0.pt"
    state = safe_torch_load(path)
    if not isinstance(state, dict):
        raise OLMoCheckpointError(f"'{path}' holds a {type(state).__name__}, not a trainer state.")
    return state


def _load_sharded(
    info: CheckpointInfo, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], load_trainer_state: bool
) -> Optional[dict[str, Any]]:
    folder = str(Path(info.path) / "model_and_optim")
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    check_shapes(info.path, sharded_model_shapes(folder), state["model"])
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner())
    except CheckpointException as e:
        cause = root_cause(e)
        if isinstance(cause, OLMoError):
            raise cause from None
        raise OLMoCheckpointError(
            f"Could not load the sharded checkpoint '{info.path}' ({type(cause).__name__}: {cause}). It is "
            f"damaged or was not written by this trainer; load another checkpoint."
        ) from None
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    if not load_trainer_state:
        return None
    return trainer_state(info)


def sharded_model_shapes(folder: str) -> dict[str, tuple]:
    metadata = read_dcp_metadata(folder)
    return {
        k[len("model.") :]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


def _shape(value: Any) -> tuple:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def check_shapes(path: str, saved: dict[str, Any], expected: dict[str, Any]) -> None:
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    wrong = sorted(k for k in set(saved) & set(expected) if _shape(saved[k]) != _shape(expected[k]))
    if not (missing or unexpected or wrong):
        return
    details = []
    if wrong:
        details.append(
            "shape mismatches: "
            + ", ".join(
                f"{k} {list(_shape(saved[k]))} in checkpoint vs {list(_shape(expected[k]))} in model"
                for k in wrong[:5]
            )
        )
    if missing:
        details.append(f"missing from checkpoint: {', '.join(missing[:5])}")
    if unexpected:
        details.append(f"not in model: {', '.join(unexpected[:5])}")
    raise ModelMismatchError(
        f"Checkpoint '{path}' was saved from a different model shape ({'; '.join(details)}). Make the "
        f"model section of your config match the checkpoint's config.yaml, or load another checkpoint."
    )


def prune_checkpoints(folder: os.PathLike | str, sharded: bool, keep: int) -> list[Path]:
    """Delete the oldest committed checkpoints of one kind so that ``keep`` remain (-1 keeps all)."""
    if keep < 0 or _rank() != 0:
        return []
    mine = [c for c in list_checkpoints(folder) if c.sharded == sharded and not c.ephemeral]
    doomed = mine[: max(0, len(mine) - max(keep, 1))]
    for c in doomed:
        delete_checkpoint(c)
    return [Path(c.path) for c in doomed]


def remove_ephemeral_checkpoints(folder: os.PathLike | str, keep_step: Optional[int] = None) -> list[Path]:
    """Delete ephemeral checkpoints except the one at ``keep_step`` (rank 0 does the work)."""
    if _rank() != 0:
        return []
    doomed = [c for c in list_checkpoints(folder) if c.ephemeral and c.step != keep_step]
    for c in doomed:
        delete_checkpoint(c)
    return [Path(c.path) for c in doomed]


def delete_checkpoint(checkpoint: CheckpointInfo) -> None:
    # Un-commit first (remove the marker), so a crash mid-delete never leaves a half-deleted checkpoint
    # that still looks committed.
    (Path(checkpoint.path) / MARKER).unlink()
    shutil.rmtree(checkpoint.path)
