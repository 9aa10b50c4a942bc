"""The training loop: :class:`Trainer` and its short :meth:`~Trainer.fit`.

The loop owns the data position, checkpoint and evaluation cadence, stop conditions and metrics sinks; what one
step does (forward, loss, backward, optimizer step) is the job of a :class:`~olmo.train_module.TrainModule`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from .checkpoint import (
    MARKER,
    CheckpointInfo,
    PendingCheckpoint,
    begin_checkpoint,
    commit_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    remove_ephemeral_checkpoints,
)
from .checkpoint_upload import build_checkpoint_uploader
from .config import TrainConfig
from .data import DataIndexLog, FilteredInstanceCounter, IterableDataset
from .distributed import DistEnv, all_reduce, autocast_dtype, model_config_fingerprint
from .eval import Evaluator
from .metrics import (
    MetricsLogger,
    SpeedMonitor,
    StepMetrics,
    StepMetricsQueue,
    device_peak_flops,
    peak_memory_mb,
)
from .rng import get_rng_state, set_rng_state
from .stop import EXIT_CODE_STOPPED, StopRequest
from .train_module import TrainModule

__all__ = ["Trainer", "TrainerState", "EXIT_CODE_STOPPED"]

log = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """Where training is. The data position is a global instance count, so it survives a change of
    world size or micro-batch size."""

    global_step: int = 0
    global_train_examples_seen_this_epoch: int = 0
    global_train_tokens_seen: int = 0
    epoch: int = 0


class Trainer:
    """Runs training for one config on one process (and, through FSDP, on many).

    :param train_module: what one step does (see :func:`olmo.train_module.build_train_module`).
    :param train_loader: a DataLoader over :class:`olmo.data.IterableDataset`.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        train_module: TrainModule,
        train_loader: torch.utils.data.DataLoader,
        evaluators: Sequence[Evaluator] = (),
    ):
        self.cfg, self.env, self.train_module, self.train_loader = cfg, env, train_module, train_loader
        self.evaluators = list(evaluators)
        self.dataset: IterableDataset = train_loader.dataset  # type: ignore[assignment]
        self.state = TrainerState(epoch=self.dataset.epoch)  # --epoch starts a fresh run at that epoch
        self.max_steps = cfg.max_steps(self.dataset.total_size)
        self.device_batch_size = cfg.device_batch_size(env.world_size)
        self.autocast_dtype = autocast_dtype(cfg, env.device)  # for the evaluators
        self.stop_request = StopRequest()
        self.last_saved_step: dict[str, int] = {}
        self.pending_save: Optional[PendingCheckpoint] = None
        self.uploader = build_checkpoint_uploader(cfg.remote_save_folder, env.rank)  # rank 0 only, or None
        self.restored_step: Optional[int] = None
        self.collect_steps = cfg.metrics_collect_steps(env.device)
        self.step_metrics = StepMetricsQueue(self.collect_steps, env.rank, bool(cfg.softmax_auxiliary_loss))
        self.filtered = FilteredInstanceCounter()
        if cfg.precision not in (None, "fp32") and self.autocast_dtype is None:
            log.warning("precision=%s has no effect on %s; training in fp32.", cfg.precision, env.device.type)
        train_module.on_attach(self)

    @property
    def model(self) -> torch.nn.Module:
        """The train module's model (what checkpoints and evaluators use)."""
        return self.train_module.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The train module's optimizer (what checkpoints hold)."""
        return self.train_module.optimizer

    # ----------------------------------------------------------------------------------------------
    def restore(self, info: CheckpointInfo, load_optimizer_state: bool, load_trainer_state: bool) -> None:
        """Load a checkpoint into the model (and optimizer, and trainer state, as asked)."""
        log.info(
            "Restoring %s (optimizer: %s, trainer state: %s)", info.path, load_optimizer_state, load_trainer_state
        )
        state = load_checkpoint(
            info, self.model, self.optimizer if load_optimizer_state else None, load_trainer_state
        )
        if state is not None:
            self._load_trainer_state(state)
            self.restored_step = self.state.global_step
            if not load_optimizer_state:
                self.train_module.on_optimizer_reset(self.state.global_step)
        self.dataset.start_index = self.state.global_train_examples_seen_this_epoch
        log.info(
            "Restored to step %d, epoch %d, instance %d of the epoch.",
            self.state.global_step,
            self.state.epoch,
            self.state.global_train_examples_seen_this_epoch,
        )

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        if state.get("model_config_hash") not in (None, model_config_fingerprint(self.cfg.model)):
            log.warning(
                "The checkpoint's model config differs from this run's in non-shape options "
                "(e.g. dropout or rope_theta); continuing with this run's values."
            )
        if not self.cfg.restore_dataloader:
            return
        s = self.state
        s.global_step = int(state["global_step"])
        s.global_train_tokens_seen = int(state["global_train_tokens_seen"])
        s.global_train_examples_seen_this_epoch = int(state["global_train_examples_seen_this_epoch"])
        s.epoch = int(state.get("epoch") or 0)
        if self.cfg.epoch is not None and self.cfg.epoch != s.epoch:
            s.epoch, s.global_train_examples_seen_this_epoch = self.cfg.epoch, 0
        if self.cfg.fast_forward_batches:
            s.global_train_examples_seen_this_epoch += (
                self.cfg.fast_forward_batches * self.cfg.global_train_batch_size
            )
        if self.dataset.epoch != s.epoch:
            self.dataset.reshuffle(s.epoch)
        rng = state.get("rng", {}).get(self.env.rank)
        if state.get("world_size") == self.env.world_size and rng is not None:
            set_rng_state(rng)
        else:
            log.warning(
                "World size changed (%s -> %d): RNG states are not restored, so dropout draws "
                "differ from an uninterrupted run.",
                state.get("world_size"),
                self.env.world_size,
            )

    def trainer_state_dict(self, gather_all_ranks: bool) -> dict[str, Any]:
        """This run's position plus RNG states (every rank's when ``gather_all_ranks``)."""
        rng = get_rng_state()
        if gather_all_ranks and dist.is_initialized():
            all_rng: list = [None] * self.env.world_size
            dist.all_gather_object(all_rng, rng)
            rng_by_rank = dict(enumerate(all_rng))
        else:
            rng_by_rank = {self.env.rank: rng}
        s = self.state
        return {
            "format_version": 1,
            "global_step": s.global_step,
            "epoch": s.epoch,
            "global_train_examples_seen_this_epoch": s.global_train_examples_seen_this_epoch,
            "global_train_tokens_seen": s.global_train_tokens_seen,
            "world_size": self.env.world_size,
            "model_config_hash": model_config_fingerprint(self.cfg.model),
            "rng": rng_by_rank,
        }

    # ----------------------------------------------------------------------------------------------
    def save(self, sharded: bool, ephemeral: bool = False) -> None:
        """Save a checkpoint of the current step (a no-op if one of this kind was already saved at it).
        With ``save_async``, sharded checkpoints are committed later by :meth:`commit_pending_save`."""
        step, kind = self.state.global_step, ("ephemeral" if ephemeral else "sharded") if sharded else "unsharded"
        if self.last_saved_step.get(kind) == step:
            return
        name = f"step{step}" if sharded else f"step{step}-unsharded"
        if step == self.restored_step and (Path(self.cfg.save_folder) / name / MARKER).is_file():
            # Nothing was trained since this very checkpoint was restored (e.g. relaunching a finished run).
            self.last_saved_step[kind] = step
            return
        self.collect_metrics()  # a non-finite loss not yet seen must stop the run before anything is written
        self.commit_pending_save()  # one background save at a time, committed in order
        # A regular sharded checkpoint replaces an ephemeral one of the same step (same directory name).
        replace = self.cfg.save_overwrite or (kind == "sharded" and self.last_saved_step.get("ephemeral") == step)
        start = time.perf_counter()
        state = self.trainer_state_dict(gather_all_ranks=not sharded)
        pending = begin_checkpoint(
            self.cfg.save_folder,
            step,
            self.model,
            self.optimizer,
            state,
            self.cfg,
            sharded,
            overwrite=replace,
            ephemeral=ephemeral,
            background=sharded and self.cfg.save_async,
        )
        self.last_saved_step[kind] = step
        self.pending_save = pending
        if pending.future is None:
            self.commit_pending_save()
        log.info("Checkpoint of step %d blocked training for %.2f s.", step, time.perf_counter() - start)

    def commit_pending_save(self) -> None:
        """Publish the checkpoint being written (waiting for it if needed), then apply retention."""
        pending, self.pending_save = self.pending_save, None
        if pending is None:
            return
        path = commit_checkpoint(pending)
        if self.uploader is not None:  # before retention: the upload keeps a hard-linked snapshot
            self.uploader.submit(path)
        if pending.meta["sharded"]:
            # A newer sharded checkpoint makes every older ephemeral one redundant.
            ephemeral = pending.meta["ephemeral"]
            remove_ephemeral_checkpoints(
                self.cfg.save_folder, keep_step=pending.meta["step"] if ephemeral else None
            )
            if not ephemeral:
                prune_checkpoints(self.cfg.save_folder, True, self.cfg.save_num_checkpoints_to_keep)
        else:
            prune_checkpoints(self.cfg.save_folder, False, self.cfg.save_num_unsharded_checkpoints_to_keep)
        log.info("Saved checkpoint %s", path)

    def _saving_enabled(self, sharded: bool) -> bool:
        if sharded:
            return self.cfg.save_interval is not None and self.cfg.save_num_checkpoints_to_keep != 0
        return (
            self.cfg.save_interval_unsharded is not None and self.cfg.save_num_unsharded_checkpoints_to_keep != 0
        )

    def maybe_save(self, final: bool = False) -> bool:
        """Save the checkpoints due at this step; with ``final`` (end of training, or a stop), also the
        checkpoint a finished or stopped run must leave. Return whether anything was written."""
        cfg, step = self.cfg, self.state.global_step
        before = dict(self.last_saved_step)
        due_sharded = self._saving_enabled(True) and cfg.save_interval and step % cfg.save_interval == 0
        if due_sharded:
            self.save(sharded=True)
        if self._saving_enabled(False) and cfg.save_interval_unsharded and step % cfg.save_interval_unsharded == 0:
            self.save(sharded=False)
        if not due_sharded and cfg.save_interval_ephemeral and step % cfg.save_interval_ephemeral == 0:
            self.save(sharded=True, ephemeral=True)
        if final:
            # As in OLMo: unsharded is the kind meant for keeping; otherwise sharded. With saving turned
            # off a checkpoint is still written, because a stopped run must be resumable.
            if self._saving_enabled(False):
                self.save(sharded=False)
            else:
                self.save(sharded=self._saving_enabled(True) or self.env.world_size > 1)
        return self.last_saved_step != before

    def maybe_eval(self, metrics_logger: MetricsLogger, stop_at: int, force: bool = False) -> bool:
        """Run every evaluator (on every rank: they reduce across ranks) when ``eval_interval`` says so or
        at the last step, and log the results; return whether anything ran."""
        step = self.state.global_step
        due = force or step % self.cfg.eval_interval == 0 or step >= stop_at
        if not self.evaluators or not due:
            return False
        self.log_metrics(metrics_logger)  # training steps first, so metrics.jsonl stays in step order
        start, metrics = time.perf_counter(), {}
        self.train_module.zero_grads()  # free gradient memory for the eval batches
        for evaluator in self.evaluators:
            metrics.update(evaluator.evaluate(self.model, self.env.device, self.autocast_dtype))
        metrics["eval/seconds"] = time.perf_counter() - start
        metrics_logger.log(step, metrics, console_keys=sorted(metrics))
        return True

    # ----------------------------------------------------------------------------------------------
    def fit(self) -> int:
        """Train until ``stop_at``/max_duration, a stop signal or the time limit; return an exit code."""
        cfg, s = self.cfg, self.state
        stop_at = min(cfg.stop_at or self.max_steps, self.max_steps)
        if cfg.stop_after is not None:
            stop_at = min(stop_at, s.global_step + cfg.stop_after)
        metrics_logger = MetricsLogger(cfg, self.env.rank, stop_at)
        index_log = DataIndexLog(cfg.save_folder, self.env.rank, s.global_step, cfg.save_data_indices)
        speed = SpeedMonitor(
            cfg.speed_monitor.window_size,
            self.train_module.num_flops_per_token(cfg.model.max_sequence_length),
            device_peak_flops(self.env.device, cfg.speed_monitor.gpu_flops_available),
        )
        device_tokens = self.device_batch_size * cfg.model.max_sequence_length
        if cfg.gen1_gc_interval is not None:
            gc.disable()
        self.stop_request.install()
        if self.uploader is not None:
            self.uploader.submit_missing(cfg.save_folder)  # what an earlier launch did not finish uploading
        start_time, start_step, exit_code = time.monotonic(), s.global_step, 0
        if (
            s.global_step == 0
            and not cfg.no_pre_train_checkpoint
            and (self._saving_enabled(True) or self._saving_enabled(False))
        ):
            self.maybe_save(final=True)  # proves early that checkpoints can be written
        if cfg.eval_on_load and self.restored_step:
            self.maybe_eval(metrics_logger, stop_at, force=True)
        self.train_module.pre_train()
        batches = self._batches()
        try:
            while s.global_step < stop_at:
                wait_start = time.perf_counter()
                batch = next(batches)
                data_wait = time.perf_counter() - wait_start
                s.global_step += 1
                s.global_train_examples_seen_this_epoch += cfg.global_train_batch_size
                s.global_train_tokens_seen += cfg.tokens_per_batch
                index_log.write(s.global_step, batch["index"], batch.get("instance_mask"))
                self.train_module.zero_grads()
                self.train_module.train_batch(batch)
                self.train_module.optim_step()
                metrics = self._step_record().values
                metrics.update(speed.step(device_tokens))
                metrics["throughput/data_wait_seconds"] = data_wait
                metrics["throughput/total_tokens"] = s.global_train_tokens_seen
                metrics["System/Peak Memory (MB)"] = peak_memory_mb(self.env.device)
                if s.global_step % self.collect_steps == 0:
                    self.log_metrics(metrics_logger)
                reason, all_written = self._agree(start_time)
                if all_written and self.pending_save is not None:
                    self.commit_pending_save()
                if reason is not None:
                    self.log_metrics(metrics_logger)
                    metrics_logger.log_event(s.global_step, f"Stopping ({reason}); saving a checkpoint.")
                    self.maybe_save(final=True)
                    exit_code = EXIT_CODE_STOPPED
                    break
                if self.maybe_save() | self.maybe_eval(metrics_logger, stop_at):
                    speed.reset()  # checkpoint and eval time is not training throughput
                if cfg.gen1_gc_interval is not None and s.global_step % cfg.gen1_gc_interval == 0:
                    gc.collect(1)
            else:
                self.log_metrics(metrics_logger)
                self.maybe_save(final=True)
            self.commit_pending_save()
        finally:
            self.log_metrics(metrics_logger, collect=False)  # after an error, what was already read back
            self.stop_request.uninstall()
            gc.enable()
            index_log.close()
            metrics_logger.close(self._summary(metrics_logger, start_step, start_time), exit_code)
            if self.uploader is not None:
                self.uploader.close()  # waits for the uploads and logs how each ended
        return exit_code

    def _batches(self) -> Iterator[dict[str, Any]]:
        """Device batches forever, moving to the next epoch (reshuffled) when one runs out."""
        while True:
            yield from self.train_loader
            self.state.epoch += 1
            self.state.global_train_examples_seen_this_epoch = 0
            log.info("Epoch %d complete; starting epoch %d.", self.state.epoch - 1, self.state.epoch)
            self.dataset.reshuffle(self.state.epoch)

    def _agree(self, start_time: float) -> tuple[Optional[str], bool]:
        """One small collective per step so that all ranks act together: whether to stop (a signal on any
        rank, or the time limit) and whether every rank has finished writing a background checkpoint."""
        reason = self.stop_request.reason
        if (
            reason is None
            and self.cfg.time_limit is not None
            and time.monotonic() - start_time > self.cfg.time_limit
        ):
            reason = "time_limit"
        writing = self.pending_save is not None and not self.pending_save.is_written()
        flags = all_reduce(torch.tensor([float(reason is not None), float(writing)]), dist.ReduceOp.MAX).tolist()
        return reason or ("stop requested on another rank" if flags[0] > 0 else None), flags[1] == 0

    def _summary(self, metrics_logger: MetricsLogger, start_step: int, start_time: float) -> dict[str, Any]:
        last = metrics_logger.last
        return {
            "steps this run": self.state.global_step - start_step,
            "global step": self.state.global_step,
            "tokens seen": self.state.global_train_tokens_seen,
            "first loss": metrics_logger.first_loss,
            "last loss": last.get("train/CrossEntropyLoss"),
            "tokens/s/device": round(last.get("throughput/device/tokens_per_second", 0.0)),
            "wall time (s)": round(time.monotonic() - start_time, 1),
            "save folder": self.cfg.save_folder,
            **({"instances filtered this run": self.filtered.total} if self.cfg.data.instance_filter else {}),
        }

    # ----------------------------------------------------------------------------------------------
    def train_step(self, batch: dict[str, Any]) -> StepMetrics:
        """One step of the train module on this device batch, as :meth:`fit` runs it (for benchmarks and tests
        that drive steps themselves); returns the step's metrics record."""
        self.train_module.zero_grads()
        self.train_module.train_batch(batch)
        self.train_module.optim_step()
        return self._step_record()

    def _step_record(self) -> StepMetrics:
        record = self.step_metrics.records[-1] if self.step_metrics.records else None
        assert record is not None and record.step == self.state.global_step, (
            f"{type(self.train_module).__name__}.optim_step did not call queue_step_metrics at step "
            f"{self.state.global_step}"
        )
        return record

    def collect_metrics(self) -> None:
        """Read the pending steps' metrics back from the device; raise at a non-finite loss or grad norm."""
        self.step_metrics.collect(self.state.global_step)

    def log_metrics(self, metrics_logger: MetricsLogger, collect: bool = True) -> None:
        """Log the steps whose metrics are ready (collecting the pending ones first, unless told not to)."""
        if collect:
            self.collect_metrics()
        for record in self.step_metrics.pop_ready():
            record.values.update(self.filtered.pop(record.step))
            metrics_logger.log(record.step, record.values)
