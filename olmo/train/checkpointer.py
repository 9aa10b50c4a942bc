"""The trainer's checkpoint component: :class:`Checkpointer` owns *when* and *what kind* of checkpoint is written
(``save_interval``, ``save_interval_unsharded``, ``save_interval_ephemeral``, the final save), the background
(``save_async``) write and its commit, retention, the remote upload, the Hugging Face export (``hf_export``), and
restoring a checkpoint into a :class:`~olmo.train.train_module.TrainModule`.

*What* a checkpoint holds of the model and optimizer is the train module's choice
(:meth:`~olmo.train.train_module.TrainModule.state_dict_to_save`); the trainer's position and RNG states come from the
``trainer_state`` callable; the on-disk layout is :mod:`olmo.checkpoint`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..checkpoint import (
    MARKER,
    CheckpointInfo,
    PendingCheckpoint,
    begin_checkpoint,
    commit_checkpoint,
    delete_checkpoint,
    inspect_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    remove_ephemeral_checkpoints,
)
from ..checkpoint.kept_inputs import canonical_entry, kept_checkpoints
from ..checkpoint.upload import build_checkpoint_uploader
from ..config import TrainConfig
from ..config.input_paths import run_inputs
from ..distributed.collectives import DistEnv, all_reduce, barrier
from ..exceptions import OLMoTrainingError
from ..hf.files import export_tokenizer, parse_size, write_hf_model
from .callback import Callback, CheckpointContext, EndContext, RunContext, StepContext

if TYPE_CHECKING:
    from .train_module import TrainModule

__all__ = ["Checkpointer", "CheckpointCallback", "HFExportCallback"]

log = logging.getLogger(__name__)


class Checkpointer:
    """Writes the checkpoints due at each step and restores one; every rank calls every method.

    :param trainer_state: ``trainer_state(gather_all_ranks)``, the trainer's position and RNG states for
        ``train.pt`` (every rank's RNG when gathering, for an unsharded checkpoint) or ``train/rankN.pt``.
    :param before_save: called before anything is written (the trainer reads back pending metrics, so that a
        non-finite loss stops the run before a checkpoint of its weights exists).
    :param notify: ``notify(hook, ctx)`` calls the loop's callbacks: ``pre_checkpoint`` before a checkpoint is
        written, ``post_checkpoint`` once it is published.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        train_module: TrainModule,
        trainer_state: Callable[[bool], dict[str, Any]],
        before_save: Callable[[], None] = lambda: None,
        notify: Callable[[str, CheckpointContext], None] = lambda hook, ctx: None,
    ):
        self.cfg, self.env, self.train_module = cfg, env, train_module
        self.trainer_state, self.before_save, self.notify = trainer_state, before_save, notify
        self.last_saved_step: dict[str, int] = {}  # by kind: sharded, unsharded, ephemeral
        self.pending: Optional[PendingCheckpoint] = None
        self.uploader = build_checkpoint_uploader(cfg.remote_save_folder, env.rank)  # rank 0 only, or None
        self.restored_step: Optional[int] = None
        """The step of the checkpoint this launch restored (:meth:`mark_restored`), if any."""
        self.restored_path: Optional[str] = None  # the checkpoint this launch restored, if any
        self.exported_step: Optional[int] = None
        # What the run reads inside save_folder (launches that would delete it are refused up front): kept through
        # retention and rewinds.
        self.kept = kept_checkpoints(cfg.save_folder, run_inputs(cfg)) if env.rank == 0 else set[Path]()

    def enabled(self, sharded: bool) -> bool:
        """Whether the config saves checkpoints of this kind on a schedule."""
        if sharded:
            return self.cfg.save_interval is not None and self.cfg.save_num_checkpoints_to_keep != 0
        return (
            self.cfg.save_interval_unsharded is not None and self.cfg.save_num_unsharded_checkpoints_to_keep != 0
        )

    def mark_restored(self, step: int) -> None:
        """The launch (or a rewind) restored the checkpoint of ``step``: a save of that step again is the same one."""
        self.restored_step = step

    def load(
        self, info: CheckpointInfo, load_optimizer_state: bool, load_trainer_state: bool
    ) -> Optional[dict[str, Any]]:
        """Load ``info`` into the train module's model (and optimizer, as asked); return this rank's trainer
        state, or None when not asked for it."""
        tm = self.train_module
        self.restored_path = info.path
        return load_checkpoint(info, tm.model, tm.optimizer if load_optimizer_state else None, load_trainer_state)

    def start(self, step: int) -> None:
        """At the start of ``fit``: resume unfinished uploads and, for a fresh run that saves checkpoints, write
        the step-0 checkpoint (unless ``no_pre_train_checkpoint``), which proves early that saving works."""
        if self.uploader is not None:
            self.uploader.submit_missing(self.cfg.save_folder)  # what an earlier launch did not finish uploading
        if step == 0 and not self.cfg.no_pre_train_checkpoint and (self.enabled(True) or self.enabled(False)):
            self.maybe_save(step, final=True)

    def maybe_save(self, step: int, final: bool = False) -> bool:
        """Save the checkpoints due at ``step``; with ``final`` (end of training, or a stop), also the checkpoint
        a finished or stopped run must leave. Return whether anything was written."""
        cfg, before = self.cfg, dict(self.last_saved_step)
        due_sharded = self.enabled(True) and cfg.save_interval and step % cfg.save_interval == 0
        if due_sharded:
            self.save(step, sharded=True)
        if self.enabled(False) and cfg.save_interval_unsharded and step % cfg.save_interval_unsharded == 0:
            self.save(step, sharded=False)
        if not due_sharded and cfg.save_interval_ephemeral and step % cfg.save_interval_ephemeral == 0:
            self.save(step, sharded=True, ephemeral=True)
        if final:
            # As in OLMo: unsharded is the kind meant for keeping; otherwise sharded. With saving turned off a
            # checkpoint is still written, because a stopped run must be resumable.
            if self.enabled(False):
                self.save(step, sharded=False)
            else:
                self.save(step, sharded=self.enabled(True) or self.env.world_size > 1)
        hf = cfg.hf_export
        unsharded_now = self.last_saved_step.get("unsharded") == step != before.get("unsharded")
        if hf.enabled and hf.every_unsharded and unsharded_now and not final:
            self.export_hf(step)
        return self.last_saved_step != before

    def export_hf(self, step: int) -> None:
        """With ``hf_export.enabled``, write ``save_folder/stepN-hf``, a transformers model directory of the current
        weights (every rank calls this: the full state is gathered on rank 0, which writes it). At most once a
        step; an existing ``stepN-hf`` (a relaunched finished run) is kept."""
        hf = self.cfg.hf_export
        target = Path(self.cfg.save_folder) / f"step{step}-hf"
        if not hf.enabled or self.exported_step == step:
            return
        self.exported_step = step
        if target.exists():
            log.info("%s exists; not exporting step %d again.", target, step)
            return
        start = time.perf_counter()
        model_state = self.train_module.state_dict(optim=False, full=True)["model"]  # collective
        if self.env.rank == 0:
            tokenizer = export_tokenizer(self.cfg.tokenizer.identifier, self.cfg.model, "tokenizer.identifier")
            dtype = torch.bfloat16 if hf.dtype == "bfloat16" else torch.float32
            write_hf_model(target, model_state, self.cfg.model, tokenizer, dtype, parse_size(hf.max_shard_size))
            log.info("Exported %s (%s) in %.1f s.", target, hf.dtype, time.perf_counter() - start)

    def save(self, step: int, sharded: bool, ephemeral: bool = False) -> None:
        """Save a checkpoint of ``step`` (a no-op if one of this kind was already saved at it). With
        ``save_async``, a sharded checkpoint is committed later by :meth:`commit`."""
        kind = ("ephemeral" if ephemeral else "sharded") if sharded else "unsharded"
        if self.last_saved_step.get(kind) == step:
            return
        name = f"step{step}" if sharded else f"step{step}-unsharded"
        if step == self.restored_step and (Path(self.cfg.save_folder) / name / MARKER).is_file():
            # Nothing was trained since this very checkpoint was restored (e.g. relaunching a finished run).
            self.last_saved_step[kind] = step
            return
        self.before_save()
        self.commit()  # one background save at a time, committed in order
        # A regular sharded checkpoint replaces an ephemeral one of the same step (same directory name).
        replace = self.cfg.save_overwrite or (kind == "sharded" and self.last_saved_step.get("ephemeral") == step)
        start = time.perf_counter()
        self.notify("pre_checkpoint", CheckpointContext(step, kind))
        train_state = self.trainer_state(not sharded)
        self.pending = begin_checkpoint(
            self.cfg.save_folder,
            step,
            self.train_module.state_dict_to_save(sharded),
            train_state,
            self.cfg,
            sharded,
            overwrite=replace,
            ephemeral=ephemeral,
            background=sharded and self.cfg.save_async,
        )
        self.last_saved_step[kind] = step
        if self.pending.future is None:
            self.commit()
        log.info("Checkpoint of step %d blocked training for %.2f s.", step, time.perf_counter() - start)

    def save_named(self, step: int, name: str) -> Path:
        """Save a checkpoint of ``step`` into ``save_folder/name`` now (sharded with several ranks), replacing one
        of that name; it is uploaded like the others but never pruned, and not resumed from by
        ``try_load_latest_save`` (e.g. the start of a KL stage, see :mod:`olmo.train.kl`)."""
        self.before_save()
        self.commit()
        start, sharded = time.perf_counter(), self.env.world_size > 1
        self.notify("pre_checkpoint", CheckpointContext(step, "named"))
        pending = begin_checkpoint(
            self.cfg.save_folder,
            step,
            self.train_module.state_dict_to_save(sharded),
            self.trainer_state(not sharded),
            self.cfg,
            sharded,
            overwrite=True,
            name=name,
        )
        path = commit_checkpoint(pending)
        if self.uploader is not None:
            self.uploader.submit(path)
        log.info("Saved checkpoint %s of step %d in %.2f s.", path, step, time.perf_counter() - start)
        self.notify("post_checkpoint", CheckpointContext(step, "named", str(path)))
        return path

    def newest_before(self, step: int, why: str) -> CheckpointInfo:
        """The newest committed checkpoint from before ``step`` (a background save is committed first: it may be
        the one), for a rewind.

        :raises OLMoTrainingError: when there is none; ``why`` starts the message.
        """
        self.commit()
        folder = self.cfg.save_folder
        before = [c for c in list_checkpoints(folder) if c.step < step]
        if not before:
            raise OLMoTrainingError(
                f"{why}, but '{folder}' holds no committed checkpoint from before step {step} to roll back to. "
                f"Resume from an earlier checkpoint (--load_path) with --fast_forward_batches past the offending "
                f"data, or save checkpoints more often."
            )
        return inspect_checkpoint(before[-1].path)

    def delete_from(self, step: int) -> None:
        """Delete the checkpoints of ``step`` and later (rank 0; every rank waits), which a rewind makes stale;
        the next saves of any kind are due again.

        :raises OLMoTrainingError: on every rank, before anything is deleted, when one of them holds what the run
            reads (a reference, data): it must not be deleted, and the run could not save that step again."""
        stale = [c for c in list_checkpoints(self.cfg.save_folder) if c.step >= step] if self.env.rank == 0 else []
        read = [c.path for c in stale if canonical_entry(Path(c.path)) in self.kept]
        device = self.env.device if self.env.device is not None else torch.device("cpu")
        if all_reduce(torch.tensor([float(len(read))], device=device)).item() > 0:
            raise OLMoTrainingError(
                f"Cannot rewind to before step {step}: the run reads what lies in its later checkpoint(s) "
                f"{', '.join(read) or '(named on rank 0)'} (a reference or data), which a rewind would have to delete "
                f"and then save again. Nothing was deleted. Copy what the run reads out of save_folder "
                f"'{self.cfg.save_folder}' and relaunch with --try_load_latest_save."
            )
        for c in stale:
            log.warning("Deleting checkpoint %s: it was written during the offending stretch.", c.path)
            delete_checkpoint(c)
        barrier()
        self.last_saved_step.clear()

    def is_writing(self) -> bool:
        """Whether this rank is still writing a background checkpoint."""
        return self.pending is not None and not self.pending.is_written()

    def commit(self) -> None:
        """Publish the checkpoint being written (waiting for it if needed), then apply retention."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        path = commit_checkpoint(pending)
        if self.uploader is not None:  # before retention: the upload keeps a hard-linked snapshot
            self.uploader.submit(path)
        folder = self.cfg.save_folder
        if pending.meta["sharded"]:
            # A newer sharded checkpoint makes every older ephemeral one redundant.
            ephemeral = pending.meta["ephemeral"]
            keep_step = pending.meta["step"] if ephemeral else None
            remove_ephemeral_checkpoints(folder, keep_step=keep_step, kept=self.kept)
            if not ephemeral:
                prune_checkpoints(folder, True, self.cfg.save_num_checkpoints_to_keep, self.kept)
        else:
            prune_checkpoints(folder, False, self.cfg.save_num_unsharded_checkpoints_to_keep, self.kept)
        log.info("Saved checkpoint %s", path)
        meta = pending.meta
        kind = ("ephemeral" if meta["ephemeral"] else "sharded") if meta["sharded"] else "unsharded"
        self.notify("post_checkpoint", CheckpointContext(meta["step"], kind, str(path)))

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for the remote uploads (at most ``timeout`` seconds; the rest stay local-only, and the next launch
        into this save folder uploads them) and log how each ended."""
        if self.uploader is not None:
            self.uploader.close(timeout)


class CheckpointCallback(Callback):
    """Checkpointing as a loop callback: the step-0 checkpoint and unfinished uploads at the start, the checkpoints
    due after each step, the final one (a finished or stopped run; an interrupted one with one process), the last
    background commit, and the wait for the uploads at the very end (at most ``upload_wait`` seconds)."""

    def __init__(self, checkpointer: Checkpointer, upload_wait: Optional[float] = None):
        self.checkpointer, self.upload_wait = checkpointer, upload_wait

    def pre_train(self, ctx: RunContext) -> None:
        with ctx.loop.phase("checkpoint"):
            self.checkpointer.start(ctx.step)

    def post_step(self, ctx: StepContext) -> None:
        with ctx.loop.phase("checkpoint"):
            saved = self.checkpointer.maybe_save(ctx.step)
        if saved:
            ctx.loop.restart_clock()  # checkpoint time is not training throughput

    def post_train(self, ctx: EndContext) -> None:
        with ctx.loop.phase("checkpoint"):
            if ctx.how != "interrupted" or ctx.world_size == 1:  # other ranks may be inside a collective
                self.checkpointer.maybe_save(ctx.step, final=True)
            self.checkpointer.commit()

    def close(self) -> None:
        self.checkpointer.close(self.upload_wait)  # logs how each upload ended


class HFExportCallback(Callback):
    """With ``hf_export.enabled``: ``save_folder/stepN-hf`` at the end of a finished run (``every_unsharded``
    exports are written with each unsharded checkpoint, by the :class:`Checkpointer`)."""

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer

    def post_train(self, ctx: EndContext) -> None:
        if ctx.how == "finished":
            with ctx.loop.phase("checkpoint"):
                self.checkpointer.export_hf(ctx.step)
