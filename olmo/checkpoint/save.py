"""Writing checkpoints: every file into a hidden temporary directory, fsynced, the marker last, then an
atomic rename (see :mod:`olmo.checkpoint` for the layouts). A save that fails (a full disk, a read-only
folder) removes its temporary directory and leaves the committed checkpoints as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from ..exceptions import OLMoCheckpointError
from ..util import lost_peer, remove_path, unwritable_reason
from .config_record import ConfigRecord
from .model_state import FULL_STATE, STAGE_FULL_STATE, model_and_optim_state, plain_tensors
from .safe_reads import MARKER, describe_os_error, read_marker, root_cause

__all__ = [
    "FORMAT_VERSION",
    "PendingCheckpoint",
    "save_checkpoint",
    "begin_checkpoint",
    "model_and_optim_state",
    "plain_tensors",
    "check_new_output_dir",
    "write_unsharded_checkpoint",
    "write_imported_checkpoint",
    "commit_checkpoint",
    "is_committed",
    "replace_dir",
    "rank",
    "barrier",
    "FULL_STATE",
    "STAGE_FULL_STATE",
]

FORMAT_VERSION = 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> dict[str, int]:
    """fsync every file under ``root`` and return their sizes (relative path -> bytes)."""
    sizes = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        sizes[str(path.relative_to(root))] = path.stat().st_size
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(d)
    return sizes


def replace_dir(staged: Path, target: Path) -> None:
    """Rename the directory ``staged`` to its sibling ``target`` and fsync their folder: a reader finds the old
    ``target`` or the whole new one. An existing ``target`` is first renamed aside (a hidden ``.NAME.old-*``) and
    deleted after the rename (a symlink as a link: what it points to may belong to another run).

    The one place where a directory is renamed into place: checkpoint commits, local uploads and HF exports.
    """
    if target.exists():
        aside = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(aside)
        staged.rename(target)
        remove_path(aside)
    else:
        staged.rename(target)
    fsync_dir(target.parent)


def is_committed(path: Path) -> bool:
    try:
        read_marker(path / MARKER)
        return True
    except OLMoCheckpointError:
        return False


@dataclass
class PendingCheckpoint:
    """A checkpoint whose files are written (or being written in the background) into a temporary
    directory but not yet committed; :func:`commit_checkpoint` finishes it."""

    target: Path
    tmp: Path
    meta: dict[str, Any]
    config: Optional[ConfigRecord]
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
    config: ConfigRecord,
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
    state = model_and_optim_state(model, optimizer, full=not sharded)
    pending = begin_checkpoint(folder, step, state, train_state, config, sharded, overwrite, ephemeral)
    return commit_checkpoint(pending)


def begin_checkpoint(
    folder: os.PathLike | str,
    step: int,
    state: dict[str, Any],
    train_state: dict[str, Any],
    config: ConfigRecord,
    sharded: bool,
    overwrite: bool = False,
    ephemeral: bool = False,
    background: bool = False,
    name: Optional[str] = None,
) -> PendingCheckpoint:
    """Write a checkpoint's files into a temporary directory; every rank must call this.

    :param state: ``{"model": ..., "optim": ...}`` as :func:`model_and_optim_state` makes it (full when not
        ``sharded``), or as a :class:`~olmo.train.train_module.TrainModule`'s ``state_dict_to_save`` returns it.

    With ``background`` (sharded only), the model and optimizer state is first copied into fresh CPU
    buffers (so later optimizer steps cannot leak into this checkpoint) and then written by a background
    thread with ``torch.distributed.checkpoint.async_save``; the call returns once the copy is done.

    :param name: the directory's name in ``folder``, instead of ``stepN`` or ``stepN-unsharded`` (a checkpoint so
        named is not one that ``try_load_latest_save`` resumes from, nor one that retention removes).
    """
    root = Path(folder)
    target = root / (name or (f"step{step}" if sharded else f"step{step}-unsharded"))
    # A folder of that name that is not a committed checkpoint (a damaged marker) is invisible to
    # discovery; the commit replaces it.
    if is_committed(target) and not overwrite:
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
        if rank() == 0:
            tmp.mkdir(parents=True)
        barrier()
        future = _write_state(tmp, state, train_state, sharded, background)
    except (OSError, RuntimeError, CheckpointException) as e:  # torch.save reports a full disk as RuntimeError
        raise _save_failed(tmp, target, e) from None
    meta = {"format_version": FORMAT_VERSION, "step": step, "sharded": sharded, "ephemeral": ephemeral}
    return PendingCheckpoint(target, tmp, meta, config, future)


def _write_state(
    tmp: Path, state: dict[str, Any], train_state: dict[str, Any], sharded: bool, background: bool
) -> Optional[Future]:
    future: Any = None
    if sharded:
        if background:
            on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in state["model"].values())
            stager = _stager(pinned=on_gpu)
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
        torch.save(train_state, tmp / "train" / f"rank{rank()}.pt")
    elif rank() == 0:
        torch.save(state["model"], tmp / "model.pt")
        torch.save(state["optim"], tmp / "optim.pt")
        torch.save(train_state, tmp / "train.pt")
    return future


def check_new_output_dir(target: Path, hint: str = "", inputs: Sequence[Union[str, Path]] = ()) -> None:
    """Refuse an ``OUTPUT_DIR`` of a conversion command that exists already (a dangling symlink counts), lies inside
    one of its ``inputs``, or cannot be created, before any work.

    :param hint: appended to the message for an existing directory (e.g. a suggested path).
    :param inputs: the directories the command reads (a committed checkpoint is never written into).
    :raises OLMoCheckpointError: naming the directory and the fix.
    """
    if os.path.lexists(target):
        what = "is a symlink" if target.is_symlink() else "already exists"
        raise OLMoCheckpointError(
            f"OUTPUT_DIR '{target}' {what}; it is never written into. Pick a new path{hint} or delete it first."
        )
    resolved = target.resolve()
    for source in inputs:
        source_dir = Path(source).resolve()
        if resolved == source_dir or source_dir in resolved.parents:
            raise OLMoCheckpointError(
                f"OUTPUT_DIR '{target}' is inside '{source}', which this command reads: nothing is ever written into "
                f"an input (a committed checkpoint must stay as it was committed). Pick a path outside it{hint}."
            )
    reason = unwritable_reason(target.parent)
    if reason is not None:
        raise OLMoCheckpointError(f"OUTPUT_DIR '{target}' cannot be created: {reason}. Pick another OUTPUT_DIR.")


def write_unsharded_checkpoint(
    target: Path,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    train_state: dict[str, Any],
    config_file: Path,
    step: int,
    safetensors: bool = False,
) -> Path:
    """Write a committed unsharded checkpoint ``target`` from one process (``scripts/unshard.py`` and
    ``scripts/convert_olmo_checkpoint.py``): the full state dicts, ``train_state`` and a copy of ``config_file``,
    into a temporary directory that is committed like every trainer checkpoint. Nothing is left on failure.

    :raises OLMoCheckpointError: if ``target`` exists (or appears meanwhile) or the files cannot be written.
    """
    if target.exists():
        raise OLMoCheckpointError(
            f"'{target}' already exists; it is never written into. Pick a new path or delete it."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        state = model_and_optim_state(model, optimizer, full=True)
        model_sd: dict[str, Any] = state["model"]
        if safetensors:
            from safetensors.torch import save_file

            contiguous = {k: v.contiguous() for k, v in model_sd.items()}
            save_file(contiguous, str(tmp / "model.safetensors"), {"format": "pt"})
        else:
            torch.save(model_sd, tmp / "model.pt")
        if "optim" in state:
            torch.save(state["optim"], tmp / "optim.pt")
        torch.save(train_state, tmp / "train.pt")
        shutil.copyfile(config_file, tmp / "config.yaml")
        if target.exists():
            raise OLMoCheckpointError(f"'{target}' appeared while it was being written; nothing was written.")
        meta = {"format_version": FORMAT_VERSION, "step": step, "sharded": False, "ephemeral": False}
        commit_checkpoint(PendingCheckpoint(target, tmp, meta, config=None))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise OLMoCheckpointError(
                f"Could not write '{target}': {describe_os_error(e)}. Nothing was written; free some space or "
                f"pick another path."
            ) from None
        raise
    return target


def write_imported_checkpoint(
    target: Path,
    cfg: ConfigRecord,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    safetensors: bool = False,
) -> Path:
    """:func:`write_unsharded_checkpoint` of a model converted from another trainer's format (transformers,
    OLMo-core): step 0, no data position or RNG state, and ``cfg`` as its ``config.yaml``; a run goes on from it
    with ``--load_path=target --reset_trainer_state``."""
    train_state = {
        "format_version": 1,
        "global_step": 0,
        "epoch": 0,
        "global_train_examples_seen_this_epoch": 0,
        "global_train_tokens_seen": 0,
        "world_size": 1,
        "rng": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        config_file = Path(scratch) / "config.yaml"
        cfg.save(config_file)
        return write_unsharded_checkpoint(target, model, optimizer, train_state, config_file, 0, safetensors)


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 2**63


def _save_failed(tmp: Path, target: Path, e: BaseException) -> OLMoCheckpointError:
    """Remove a failed save's temporary directory and say what went wrong and what is still safe."""
    cause = root_cause(e)
    fix = "Free some space (or fix the folder's permissions) and relaunch"
    if isinstance(cause, OSError):
        reason = describe_os_error(cause)
    elif _free_bytes(target.parent) < 2**20:  # measured before the partial files are removed
        reason = "no space left on the device"
    else:
        reason = f"{type(cause).__name__}: {cause}"
        if isinstance(cause, dist.DistError) or lost_peer(cause):
            # A collective of the save failed: another rank died (its own log says why), not this folder.
            fix = "Another rank of the job failed during the save (see its log); relaunch the job"
    shutil.rmtree(tmp, ignore_errors=True)
    return OLMoCheckpointError(
        f"Could not write checkpoint '{target}': {reason}. The partial save was removed and the committed "
        f"checkpoints in '{target.parent}' are intact. {fix} with --try_load_latest_save to continue from the "
        f"newest committed checkpoint."
    )


def commit_checkpoint(pending: PendingCheckpoint) -> Path:
    """Wait for the files, then publish the checkpoint: marker last, then an atomic rename. Collective."""
    try:
        if pending.future is not None:
            pending.future.result()
        barrier()
        if rank() == 0:
            _publish(pending)
    except (OSError, RuntimeError, CheckpointException) as e:
        raise _save_failed(pending.tmp, pending.target, e) from None
    barrier()
    return pending.target


def _publish(pending: PendingCheckpoint) -> None:
    tmp, target = pending.tmp, pending.target
    if pending.config is not None:
        pending.config.save(tmp / "config.yaml")
    meta = {**pending.meta, "files": fsync_tree(tmp)}
    (tmp / MARKER).write_text(json.dumps(meta, indent=1))
    fsync_tree(tmp)
    replace_dir(tmp, target)


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
