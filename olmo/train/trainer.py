"""The training loop: :class:`Trainer` and its short :meth:`~Trainer.fit`.

The loop owns the data position and drives its components, each of which owns its own schedule: the
:class:`~olmo.train.checkpointer.Checkpointer` (save cadence, background commit, ephemeral checkpoints, retention, the
final save), the :class:`~olmo.eval.EvalRunner`, the :class:`~olmo.train.stop.StopConditions` (last step, signals,
time limit) and the metrics sinks (:mod:`olmo.train.metrics_sinks`). What one step does (forward, loss, backward,
optimizer step) is the job of a :class:`~olmo.train.train_module.TrainModule`.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointInfo
from ..config import TrainConfig
from ..data import DataIndexLog, FetchStats, FilteredInstanceCounter, IterableDataset
from ..distributed import DistEnv, autocast_dtype, model_config_fingerprint
from ..eval import EvalRunner, Evaluator
from ..util.rng import get_rng_state, set_rng_state
from .checkpointer import Checkpointer
from .metrics import (
    MetricsLogger,
    NonFiniteError,
    SpeedMonitor,
    StepMetrics,
    StepMetricsQueue,
    ThroughputMonitor,
    device_peak_flops,
    fetch_metrics,
)
from .stability import StabilityMonitor, roll_back
from .stages import (
    Stage,
    StagePlan,
    boundary_checkpoint_name,
    build_stage_dataloader,
    check_schedule_lengths,
    order_dir_of,
    plan_stages,
)
from .stop import EXIT_CODE_STOPPED, StopConditions, StopNow
from .stragglers import StragglerMonitor
from .train_module import TrainModule
from .watchdog import Watchdog

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

    :param train_module: what one step does (see :func:`olmo.train.build_module.build_train_module`).
    :param train_loader: a DataLoader over :class:`olmo.data.IterableDataset`.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        train_module: TrainModule,
        train_loader: torch.utils.data.DataLoader,
        evaluators: Sequence[Evaluator] = (),
        stages: Optional[StagePlan] = None,
    ):
        self.cfg, self.env, self.train_module, self.train_loader = cfg, env, train_module, train_loader
        self.dataset: IterableDataset = train_loader.dataset  # type: ignore[assignment]
        self.state = TrainerState(epoch=self.dataset.epoch)  # --epoch starts a fresh run at that epoch
        if stages is None:
            stages = plan_stages(cfg, None if cfg.stages else lambda _: self.dataset.num_instances)
        self.stage_plan = stages
        self._segment = stages.stages[0].segment  # train_loader is the first stage's data
        self.max_steps = stages.total_steps
        self._stop_at = self.max_steps  # the step fit() stops at (set when it starts)
        check_schedule_lengths(cfg, stages)
        self.device_batch_size = cfg.device_batch_size(env.world_size)
        self.autocast_dtype = autocast_dtype(cfg, env.device)
        self.collect_steps = cfg.metrics_collect_steps(env.device)
        self.step_metrics = StepMetricsQueue(self.collect_steps, env.rank, bool(cfg.softmax_auxiliary_loss))
        self.filtered = FilteredInstanceCounter()
        self.checkpointer = Checkpointer(cfg, env, train_module, self.trainer_state_dict, self.collect_metrics)
        self.eval_runner = EvalRunner(evaluators, cfg.eval_interval)
        self.stability = StabilityMonitor(cfg, env.rank)
        self.stragglers = StragglerMonitor(cfg.stability.stragglers, env.rank, env.world_size, env.device)
        self.watchdog = Watchdog(cfg.stability.watchdog, cfg.save_folder, env.rank, env.world_size)
        self.metrics_logger: MetricsLogger  # set by fit
        self.index_log: Optional[DataIndexLog] = None  # set by fit
        if cfg.precision not in (None, "fp32") and self.autocast_dtype is None:
            log.warning("precision=%s has no effect on %s; training in fp32.", cfg.precision, env.device.type)
        train_module.on_attach(self)
        self.eval_runner.check_batch_size(train_module.eval_batch_spec.rank_batch_size)

    @property
    def model(self) -> torch.nn.Module:
        """The train module's model (what checkpoints and evaluators use)."""
        return self.train_module.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The train module's optimizer (what checkpoints hold)."""
        return self.train_module.optimizer

    def restore(
        self, info: CheckpointInfo, load_optimizer_state: bool, load_trainer_state: bool, rollback: bool = False
    ) -> None:
        """Load a checkpoint into the model (and optimizer, and trainer state, as asked). ``rollback``: the run goes
        back to its own checkpoint (:func:`olmo.train.stability.roll_back`), so ``--fast_forward_batches`` and
        ``--epoch``, which apply to the launch's first restore, do not apply again."""
        log.info(
            "Restoring %s (optimizer: %s, trainer state: %s)", info.path, load_optimizer_state, load_trainer_state
        )
        state = self.checkpointer.load(info, load_optimizer_state, load_trainer_state)
        if state is not None:
            self._load_trainer_state(state, rollback)
            self.checkpointer.restored_step = self.state.global_step
            if not load_optimizer_state:
                self.train_module.on_optimizer_reset(self.state.global_step)
        self.dataset.start_index = self.state.global_train_examples_seen_this_epoch
        log.info(
            "Restored to step %d, epoch %d, instance %d of the epoch.",
            self.state.global_step,
            self.state.epoch,
            self.state.global_train_examples_seen_this_epoch,
        )

    def _load_trainer_state(self, state: dict[str, Any], rollback: bool = False) -> None:
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
        self._use_segment(self.stage_plan.after(s.global_step))  # the data the position counts in
        if self.cfg.epoch is not None and self.cfg.epoch != s.epoch and not rollback:
            s.epoch, s.global_train_examples_seen_this_epoch = self.cfg.epoch, 0
        if self.cfg.fast_forward_batches and not rollback:
            s.global_train_examples_seen_this_epoch += (
                self.cfg.fast_forward_batches * self.cfg.global_train_batch_size
            )
        if self.dataset.epoch != s.epoch:
            self.dataset.reshuffle(s.epoch)
        if "stability" in state:
            self.stability.load_state_dict(state["stability"], getattr(self.train_module, "spike_detector", None))
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
        detector = getattr(self.train_module, "spike_detector", None)
        stability = {"stability": self.stability.state_dict(detector)} if self.stability.enabled else {}
        return {
            **stability,
            "format_version": 1,
            "global_step": s.global_step,
            "epoch": s.epoch,
            "global_train_examples_seen_this_epoch": s.global_train_examples_seen_this_epoch,
            "global_train_tokens_seen": s.global_train_tokens_seen,
            "world_size": self.env.world_size,
            "stage": self.stage_plan.after(s.global_step).index,
            "model_config_hash": model_config_fingerprint(self.cfg.model),
            "rng": rng_by_rank,
        }

    def fit(self) -> int:
        """Train until ``stop_at``/max_duration, a stop signal or the time limit; return an exit code."""
        cfg, s, ckpt = self.cfg, self.state, self.checkpointer
        stop = StopConditions(cfg, s.global_step, self.max_steps)
        self.metrics_logger = MetricsLogger(cfg, self.env.rank, stop.stop_at)
        self.index_log = DataIndexLog(cfg.save_folder, self.env.rank, s.global_step, cfg.save_data_indices)
        speed = SpeedMonitor(
            cfg.speed_monitor.window_size,
            self.train_module.num_flops_per_token(cfg.model.max_sequence_length),
            device_peak_flops(self.env.device, cfg.speed_monitor.gpu_flops_available),
        )
        throughput = ThroughputMonitor(
            speed, self.device_batch_size * cfg.model.max_sequence_length, self.env.device
        )
        start_step, exit_code, self._stop_at = s.global_step, 0, stop.stop_at
        if cfg.gen1_gc_interval is not None:
            gc.disable()
        wd = self.watchdog
        wd.start()
        try:
            with stop:
                with wd.phase("checkpoint", s.global_step):
                    ckpt.start(s.global_step)
                if cfg.eval_on_load and ckpt.restored_step:
                    with wd.phase("evaluation", s.global_step):
                        self.maybe_eval(stop.stop_at, force=True)
                self.train_module.pre_train()
                batches, stage = self._batches(), None
                while s.global_step < stop.stop_at:
                    wd.enter("forward_backward", s.global_step + 1)  # the step's phase, unless a finer one applies
                    if self.stability.due is not None:  # persistent spikes or a non-finite loss
                        with wd.phase("checkpoint", s.global_step):
                            batches, stage = roll_back(self, batches), None
                        throughput.reset()
                        continue
                    if stage is None or s.global_step == stage.end_step:
                        stage = self.stage_plan.at(s.global_step + 1)
                        batches = self._enter_stage(stage, batches)
                        throughput.reset()
                    try:
                        with wd.phase("data_wait", s.global_step + 1), stop.waiting():
                            batch = throughput.next_batch(batches)
                        self.stragglers.data_wait(throughput.data_wait)
                        metrics = self.step(batch).values
                        metrics.update(self.stragglers.maybe_gather(s.global_step))
                        if self.stage_plan.staged:
                            metrics["train/stage"] = stage.index
                        if cfg.stability.rollback.enabled:
                            metrics["stability/rollbacks"] = self.stability.rollbacks
                        metrics.update(throughput.step_metrics(s.global_train_tokens_seen, self._fetch_stats()))
                        if s.global_step % self.collect_steps == 0:
                            self.log_metrics()
                        if self.stability.due is not None:
                            continue
                        reason, all_written = stop.agree(writing=ckpt.is_writing())
                        if all_written and ckpt.pending is not None:
                            ckpt.commit()
                        if reason is not None:
                            self.log_metrics()
                            self.metrics_logger.log_event(
                                s.global_step, f"Stopping ({reason}); saving a checkpoint."
                            )
                            with wd.phase("checkpoint", s.global_step):
                                ckpt.maybe_save(s.global_step, final=True)
                            exit_code = EXIT_CODE_STOPPED
                            break
                        with wd.phase("checkpoint", s.global_step):
                            saved = ckpt.maybe_save(s.global_step)
                        # With several processes, a signal is agreed on at the next step instead.
                        with wd.phase("evaluation", s.global_step), stop.waiting(self.env.world_size == 1):
                            evaluated = self.maybe_eval(stop.stop_at)
                        if saved or evaluated:
                            throughput.reset()  # checkpoint and eval time is not training throughput
                    except StopNow as e:
                        exit_code = self._stop_in_wait(e.reason)
                        break
                    except NonFiniteError as e:
                        if not (cfg.stability.rollback.enabled and cfg.stability.rollback.on_non_finite):
                            raise
                        self.stability.due = (e.step, f"a non-finite loss or gradient norm at step {e.step}")
                else:
                    self.log_metrics()
                    with wd.phase("checkpoint", s.global_step):
                        ckpt.maybe_save(s.global_step, final=True)
                        ckpt.export_hf(s.global_step)  # with hf_export.enabled
                with wd.phase("checkpoint", s.global_step):
                    ckpt.commit()
        finally:
            wd.leave()
            self.log_metrics(collect=False)  # after an error, what was already read back
            gc.enable()
            self.index_log.close()
            self.metrics_logger.close(self._summary(start_step, stop.elapsed()), exit_code)
            wd.leave()  # the wait for the uploads is bounded by itself (watchdog.upload_wait), and ends cleanly
            ckpt.close(cfg.stability.watchdog.upload_wait if wd.enabled else None)  # logs how each upload ended
            wd.close()
        return exit_code

    def _stop_in_wait(self, reason: str) -> int:
        """A signal ended a wait for data (or an evaluation): save the last step with one process; with several, the
        other ranks may be inside a collective, so exit without one (the newest committed checkpoint stays)."""
        step = self.state.global_step
        if self.env.world_size > 1:
            log.warning(
                "Stopping (%s) while waiting for data at step %d, without a checkpoint of it.", reason, step
            )
            return EXIT_CODE_STOPPED
        self.metrics_logger.log_event(step, f"Stopping ({reason}) while waiting; saving a checkpoint.")
        with self.watchdog.phase("checkpoint", step):
            self.checkpointer.maybe_save(step, final=True)
        return EXIT_CODE_STOPPED

    def step(self, batch: dict[str, Any]) -> StepMetrics:
        """One training step as :meth:`fit` runs it (and ``scripts/benchmark.py`` times it): advance the data
        position, record the batch's indices, zero the gradients, train on ``batch``, step the optimizer, read the
        metrics back every ``metrics_collect_interval`` steps, and collect gen-1 garbage on schedule. Returns the
        step's metrics record (its values are on the host once collected)."""
        cfg, s = self.cfg, self.state
        if self.stability.enabled:
            order_dir = self.stage_plan.at(s.global_step + 1).order_dir
            self.stability.before_step(
                s.global_step + 1, order_dir, s.epoch, s.global_train_examples_seen_this_epoch
            )
        s.global_step += 1
        s.global_train_examples_seen_this_epoch += cfg.global_train_batch_size
        s.global_train_tokens_seen += cfg.tokens_per_batch
        if self.index_log is not None:
            self.index_log.write(s.global_step, batch["index"], batch.get("instance_mask"))
        record = self.train_step(batch)
        if s.global_step % self.collect_steps == 0:
            self.collect_metrics()
        if cfg.gen1_gc_interval is not None and s.global_step % cfg.gen1_gc_interval == 0:
            gc.collect(1)
        return record

    def maybe_eval(self, stop_at: int, force: bool = False) -> bool:
        """Run every evaluator (on every rank: they reduce across ranks) when ``eval_interval`` says so or at the
        last step, and log the results; return whether anything ran."""
        step = self.state.global_step
        if not self.eval_runner.due(step, stop_at, force):
            return False
        self.log_metrics()  # training steps first, so metrics.jsonl stays in step order
        metrics = self.eval_runner.run(self.train_module, self.env.device)
        self.metrics_logger.log(step, metrics, console_keys=sorted(metrics))
        if self.eval_runner.records:
            self.metrics_logger.log_records(step, self.eval_runner.records)
        return True

    def _enter_stage(self, stage: Stage, batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Before the first step this launch trains of ``stage``: at the stage's first step, write the checkpoint a
        KL stage's reference is rebuilt from and move to the stage's data if it has its own; then let the train
        module set up the stage. Returns the batches to train on."""
        s = self.state
        at_boundary = s.global_step == stage.start_step
        if self.stage_plan.staged:
            what = "begins" if at_boundary else f"continues (resumed at step {s.global_step})"
            self.metrics_logger.log_event(
                s.global_step,
                f"Stage {stage.index} ({stage.name}) {what}: steps {stage.start_step + 1}-{stage.end_step}, "
                f"kl_beta {stage.kl_beta:g}" + (f" ({stage.kl_estimator})" if stage.kl_beta else "") + ".",
            )
        if at_boundary and stage.kl_beta > 0 and self.cfg.kl_reference.load_path is None:
            # Before the data moves on: the checkpoint's position is the end of the previous stage's data.
            self.log_metrics()
            self.checkpointer.save_named(s.global_step, boundary_checkpoint_name(stage))
        if stage.segment != self._segment:
            assert at_boundary, "a resume restores the data of its stage"
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stops the old loader's workers
            s.epoch, s.global_train_examples_seen_this_epoch = 0, 0
            self._use_segment(stage)
            batches = self._batches()
        self.train_module.enter_stage(stage, at_boundary)
        return batches

    def _use_segment(self, stage: Stage) -> None:
        """Train on the data of ``stage``'s segment (a new loader, at the start of its epoch 0)."""
        if stage.segment == self._segment:
            return
        log.info("Stage %d trains on its own data (order in %s).", stage.index, order_dir_of(self.cfg, stage))
        self.train_loader = build_stage_dataloader(self.cfg, stage, self.env.world_size, self.env.rank)
        self.dataset = self.train_loader.dataset  # type: ignore[assignment]
        self._segment = stage.segment

    def _batches(self) -> Iterator[dict[str, Any]]:
        """Device batches forever, moving to the next epoch (reshuffled) when one runs out, and over the ranges of
        batches a rollback took out (``skipped_batches.json``)."""
        while True:
            # Remote instances are fetched ahead only as far as this launch will train.
            s = self.state
            if self._jump_skipped_range():
                self.dataset.start_index = s.global_train_examples_seen_this_epoch
            remaining = (self._stop_at - s.global_step) * self.cfg.global_train_batch_size
            self.dataset.stop_index = s.global_train_examples_seen_this_epoch + remaining
            jumped = False
            for batch in self.train_loader:
                yield batch
                if self.stability.ranges and self._jump_skipped_range():
                    self.dataset.start_index, jumped = s.global_train_examples_seen_this_epoch, True
                    break  # the loader restarts after the range
            if jumped:
                continue
            self.state.epoch += 1
            self.state.global_train_examples_seen_this_epoch = 0
            log.info("Epoch %d complete; starting epoch %d.", self.state.epoch - 1, self.state.epoch)
            self.dataset.reshuffle(self.state.epoch)

    def _jump_skipped_range(self) -> bool:
        """Move the data position past a skipped range that starts here; return whether it moved."""
        s = self.state
        order_dir = self.stage_plan.at(s.global_step + 1).order_dir
        target = self.stability.skip_target(order_dir, s.epoch, s.global_train_examples_seen_this_epoch)
        if target is None:
            return False
        log.info(
            "Skipping instances %d-%d of epoch %d (a range a rollback took out; %s).",
            s.global_train_examples_seen_this_epoch,
            target - 1,
            s.epoch,
            "skipped_batches.json",
        )
        s.global_train_examples_seen_this_epoch = target
        return True

    def _fetch_stats(self) -> Optional[FetchStats]:
        """What reading the current training data costs, when it is remote."""
        return getattr(self.dataset.dataset, "fetch_stats", None)

    def _summary(self, start_step: int, seconds: float) -> dict[str, Any]:
        last = self.metrics_logger.last
        fetched = fetch_metrics(self._fetch_stats())
        return {
            "steps this run": self.state.global_step - start_step,
            "global step": self.state.global_step,
            "tokens seen": self.state.global_train_tokens_seen,
            "first loss": self.metrics_logger.first_loss,
            "last loss": last.get("train/CrossEntropyLoss"),
            "tokens/s/device": round(last.get("throughput/device/tokens_per_second", 0.0)),
            "wall time (s)": round(seconds, 1),
            "save folder": self.cfg.save_folder,
            **({"stage": self.stage_plan.after(self.state.global_step).name} if self.stage_plan.staged else {}),
            **({"instances filtered this run": self.filtered.total} if self.cfg.data.instance_filter else {}),
            **(
                {
                    "remote data fetched (MB)": round(fetched["throughput/data_bytes_fetched"] / 1e6, 3),
                    "remote data requests": fetched["throughput/data_requests"],
                    "remote data retries": fetched["throughput/data_retries"],
                }
                if fetched
                else {}
            ),
        }

    def train_step(self, batch: dict[str, Any]) -> StepMetrics:
        """One step of the train module on this device batch, as :meth:`fit` runs it (for benchmarks and tests
        that drive steps themselves); returns the step's metrics record."""
        self.train_module.zero_grads()
        self.train_module.train_batch(batch)
        with self.watchdog.phase("optimizer", self.state.global_step):
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

    def log_metrics(self, collect: bool = True) -> None:
        """Log the steps whose metrics are ready (collecting the pending ones first, unless told not to)."""
        if collect:
            self.collect_metrics()
        for record in self.step_metrics.pop_ready():
            record.values.update(self.filtered.pop(record.step))
            if self.stability.enabled:
                self.stability.on_logged(record.step, record.values, self._instances_of(record.step))
            self.metrics_logger.log(record.step, record.values)

    def _instances_of(self, step: int) -> Optional[list[int]]:
        """The instance indices of the global batch of a recent ``step`` (for logging a skipped step)."""
        found = self.stability.position_of(step)
        if found is None or found[1] != self.dataset.epoch:
            return None
        position = found[2]
        return [
            int(i) for i in self.dataset.global_indices()[position : position + self.cfg.global_train_batch_size]
        ]
