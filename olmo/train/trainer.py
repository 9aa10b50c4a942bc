"""The training loop: :class:`Trainer` and its short :meth:`~Trainer.fit`.

The loop owns the data position (stages, epochs, the ranges a rollback took out) and trains one step after another;
everything around a step is a callback (:mod:`olmo.train.callback`): the watchdog, straggler detection, spike skipping
and rollback, throughput and MFU, metrics logging, the stop agreement, checkpointing, evaluation and the Hugging Face
export, then the user's own. The components those callbacks drive own their schedules: the
:class:`~olmo.train.checkpointer.Checkpointer` (save cadence, background commit, ephemeral checkpoints, retention, the
final save), the :class:`~olmo.eval.EvalRunner`, the :class:`~olmo.train.stop.StopConditions` (last step, signals,
time limit) and the metrics sinks (:mod:`olmo.train.metrics_sinks`). What one step does (forward, loss, backward,
optimizer step) is the job of a :class:`~olmo.train.train_module.TrainModule`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointInfo
from ..config import TrainConfig
from ..data import DataContext, DataIndexLog, FilteredInstanceCounter, IterableDataset
from ..distributed import DistEnv, autocast_dtype, model_config_fingerprint
from ..distributed.float8 import refresh_float8_scales
from ..distributed.layout import ParallelLayout
from ..eval import EvalRunner, Evaluator
from ..util.rng import get_rng_state, set_rng_state
from .callback import (
    Callback,
    EndContext,
    ErrorContext,
    MetricsContext,
    RewindContext,
    RunContext,
    StageContext,
    StepContext,
    check_callbacks,
    ordered_callbacks,
)
from .callback_state import callback_states, load_callback_states
from .checkpointer import CheckpointCallback, Checkpointer, HFExportCallback
from .data_feed import DataFeed
from .evaluation import EvaluationCallback
from .loop_control import MAX_REWINDS_TO_ONE_CHECKPOINT, LoopControl
from .metrics import (
    SpeedMonitor,
    StepMetrics,
    StepMetricsQueue,
    ThroughputCallback,
    ThroughputMonitor,
    device_peak_flops,
    fetch_metrics,
)
from .metrics_sinks import MetricsCallback, MetricsLogger, SinkOptions
from .stability import StabilityCallback, StabilityMonitor
from .stages import (
    Stage,
    StageCallback,
    StagePlan,
    check_schedule_lengths,
    plan_stages,
)
from .stop import EXIT_CODE_STOPPED, StopCallback, StopConditions, StopLimits, StopNow, checkpoint_summary
from .stragglers import StragglerCallback, StragglerMonitor
from .train_module import EvalBatchSpec, TrainModule
from .trainer_state import TrainerState
from .watchdog import Watchdog, WatchdogCallback

__all__ = ["Trainer", "TrainerState", "EXIT_CODE_STOPPED"]

log = logging.getLogger(__name__)


class Trainer(LoopControl):
    """Runs training for one config on one process (and, through FSDP, on many).

    :param train_module: what one step does (see :func:`olmo.train.build_module.build_train_module`).
    :param train_loader: a DataLoader over :class:`olmo.data.IterableDataset`.
    :param layout: the launch's (the one its model was built on); by default ``ParallelLayout.of_run(cfg, env)``.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        env: DistEnv,
        train_module: TrainModule,
        train_loader: torch.utils.data.DataLoader,
        evaluators: Sequence[Evaluator] = (),
        stages: Optional[StagePlan] = None,
        callbacks: Sequence[Callback] = (),
        layout: Optional[ParallelLayout] = None,
    ):
        user_callbacks = check_callbacks(callbacks)  # a wrong item fails here, not at its first hook
        self.cfg, self.env, self.train_module = cfg, env, train_module
        self.layout = layout or ParallelLayout.of_run(cfg, env)
        dataset: IterableDataset = train_loader.dataset  # type: ignore[assignment]
        self.state = TrainerState(epoch=dataset.epoch)  # --epoch starts a fresh run at that epoch
        if stages is None:
            stages = plan_stages(cfg, None if cfg.stages else lambda _: dataset.num_instances)
        self.stage_plan = stages
        self.stability = StabilityMonitor(cfg.stability, cfg.save_folder, cfg.global_train_batch_size, env.rank)
        self.data = DataFeed(
            self.layout,
            self.state,
            stages,
            self.stability,
            train_loader,
            model=cfg.model,
            data_context=DataContext.from_train_config(cfg),
            batch_size=cfg.global_train_batch_size,
            save_folder=cfg.save_folder,
        )
        self.max_steps = stages.total_steps
        self._stop_at = self.max_steps  # the step fit() stops at (set when it starts)
        check_schedule_lengths(cfg.scheduler, cfg.tokens_per_batch, stages)
        self.device_batch_size = cfg.device_batch_size(env.world_size)
        self.autocast_dtype = autocast_dtype(cfg, env.device)
        self.collect_steps = cfg.metrics_collect_steps(env.device)
        self.step_metrics = StepMetricsQueue(self.collect_steps, env.rank, bool(cfg.softmax_auxiliary_loss))
        self.filtered = FilteredInstanceCounter()
        self.checkpointer = Checkpointer(
            cfg,
            env,
            train_module,
            self.trainer_state_dict,
            self.collect_metrics,
            self.call_hook,
        )
        self.eval_runner = EvalRunner(evaluators, cfg.eval_interval)
        self.stragglers = StragglerMonitor(cfg.stability.stragglers, env.rank, env.world_size, env.device)
        self.watchdog = Watchdog(cfg.stability.watchdog, cfg.save_folder, env.rank, env.world_size)
        LoopControl.__init__(self, user_callbacks, self.state, env)
        self.index_log: Optional[DataIndexLog] = None  # set by fit
        self._stage: Optional[Stage] = None  # the stage being trained (set by fit)
        self._batch_iter: Iterator[dict[str, Any]] = iter(())
        if cfg.precision not in (None, "fp32") and self.autocast_dtype is None:
            log.warning("precision=%s has no effect on %s; training in fp32.", cfg.precision, env.device.type)
        sizes = [cfg.device_eval_batch_size] + [e.device_eval_batch_size or 0 for e in cfg.evaluators]
        self.evaluator_batches = EvalBatchSpec(max(sizes), cfg.model.max_sequence_length)  # for StepHost
        train_module.on_attach(self)
        self.eval_runner.check_batch_size(train_module.eval_batch_spec.rank_batch_size)

    @property
    def model(self) -> torch.nn.Module:
        """The train module's model (what checkpoints and evaluators use)."""
        return self.train_module.model

    @property
    def dataset(self) -> IterableDataset:
        """The training data being read (the current stage's)."""
        return self.data.dataset

    @property
    def train_loader(self) -> torch.utils.data.DataLoader:
        return self.data.loader

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The train module's optimizer (what checkpoints hold)."""
        return self.train_module.optimizer

    def restore(
        self, info: CheckpointInfo, load_optimizer_state: bool, load_trainer_state: bool, rollback: bool = False
    ) -> None:
        """Load a checkpoint into the model (and optimizer, and trainer state, as asked). ``rollback``: the run goes
        back to its own checkpoint (:meth:`rewind`), so ``--fast_forward_batches`` and
        ``--epoch``, which apply to the launch's first restore, do not apply again."""
        log.info(
            "Restoring %s (optimizer: %s, trainer state: %s)", info.path, load_optimizer_state, load_trainer_state
        )
        state = self.checkpointer.load(info, load_optimizer_state, load_trainer_state)
        refresh_float8_scales(self.model)  # the loaded weights' (a rewind's included), not those before the load
        if state is not None:
            self._load_trainer_state(state, rollback)
            self.checkpointer.mark_restored(self.state.global_step)
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
        load_callback_states(self.user_callbacks, state)
        if not self.cfg.restore_dataloader:
            return
        s = self.state
        s.restore(state)
        self.data.use_segment(self.stage_plan.after(s.global_step))  # the data the position counts in
        if self.cfg.epoch is not None and self.cfg.epoch != s.epoch and not rollback:
            s.start_epoch(self.cfg.epoch)
        if self.cfg.fast_forward_batches and not rollback:
            skipped = self.cfg.fast_forward_batches * self.cfg.global_train_batch_size
            s.skip_to(s.global_train_examples_seen_this_epoch + skipped)
        if self.dataset.epoch != s.epoch:
            self.dataset.reshuffle(s.epoch)
        if "stability" in state:
            self.stability.load_state_dict(state["stability"], self.train_module.spike_detector)
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
        detector = self.train_module.spike_detector
        stability = {"stability": self.stability.state_dict(detector)} if self.stability.enabled else {}
        return {
            **stability,
            **callback_states(self.user_callbacks),
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
        """Train until ``stop_at``/max_duration, a stop signal, the time limit or a callback's stop; return an exit
        code. The loop itself: everything around a step is a callback (:mod:`olmo.train.callback`)."""
        s = self.state
        limits = StopLimits(self.cfg.stop_at, self.cfg.stop_after, self.cfg.time_limit)
        stop = StopConditions(self.cfg.save_folder, s.global_step, self.max_steps, lambda: s.global_step, limits)
        self._begin(stop)
        how, reason = "finished", None
        try:
            with stop:
                self.call_hook(
                    "pre_train", RunContext(s.global_step, stop.stop_at, self.checkpointer.restored_step, self)
                )
                self.train_module.pre_train()
                while s.global_step < stop.stop_at and self.stop_reason is None:
                    self._enter_phase("forward_backward", s.global_step + 1)
                    self.call_hook("pre_step", StepContext(s.global_step, stop.stop_at, self))
                    try:
                        batch, waited = self._next_batch(stop)
                        self._post_step(self.step(batch), waited)
                    except StopNow as e:
                        how, reason = "interrupted", e.reason
                        break
                    except Exception as e:
                        self.call_hook("on_error", ErrorContext(s.global_step, e, self))
                        if not self.rewind_requested:  # no callback recovers from it
                            raise
                    if (request := self.take_rewind_request()) is not None:
                        self._rewind(*request)
                if self.stop_reason is not None:
                    how, reason = "stopped", self.stop_reason
                self.call_hook("post_train", EndContext(s.global_step, how, reason, self.env.world_size, self))
                self._exit_code = 0 if how == "finished" else EXIT_CODE_STOPPED
        finally:
            self._end()
        return self._exit_code

    def _begin(self, stop: StopConditions) -> None:
        """Set up one ``fit``: its stop conditions, the built-in callbacks (then the user's), the data index log."""
        cfg, s = self.cfg, self.state
        self._stop_at, self._start_step, self._exit_code = stop.stop_at, s.global_step, 0
        self._batch_iter, self._stage = self.data.batches(stop.stop_at), None
        sinks = SinkOptions(cfg.save_folder, cfg.console_log_interval, cfg.wandb, cfg.run_name, cfg.as_written)
        metrics = MetricsCallback(sinks, self.env.rank, stop.stop_at, self._summary, self.collect_steps)
        built_in: list[Callback] = [
            WatchdogCallback(self.watchdog),
            StragglerCallback(self.stragglers),
            StabilityCallback(self.stability, cfg.stability.rollback),
            ThroughputCallback(self._throughput_monitor(), self.data.fetch_stats, self.collect_steps),
            metrics,
            StopCallback(stop, self.checkpointer, self._finish),
            CheckpointCallback(
                self.checkpointer, cfg.stability.watchdog.upload_wait if self.watchdog.enabled else None
            ),
            StageCallback(self.checkpointer, cfg.kl_reference.load_path is not None),
            EvaluationCallback(self.eval_runner, self.train_module, self.env, cfg.eval_on_load),
            HFExportCallback(self.checkpointer),
        ]
        self.begin_loop(stop, metrics, ordered_callbacks(built_in, self.user_callbacks))
        self.index_log = DataIndexLog(cfg.save_folder, self.env.rank, s.global_step, cfg.save_data_indices)
        if cfg.gen1_gc_interval is not None:
            gc.disable()

    def _end(self) -> None:
        """After ``fit``, also after an error: no phase, log what was read back already, close every callback."""
        self._enter_phase(None, self.state.global_step)
        self.log_metrics(collect=False)  # after an error, what was already read back
        gc.enable()
        if self.index_log is not None:
            self.index_log.close()
        self.metrics.exit_code = self._exit_code
        for callback in reversed(self.callbacks):  # the summary after the uploads' outcomes; the watchdog last
            callback.close()

    def _throughput_monitor(self) -> ThroughputMonitor:
        cfg = self.cfg
        speed = SpeedMonitor(
            cfg.speed_monitor.window_size,
            self.train_module.num_flops_per_token(cfg.model.max_sequence_length),
            device_peak_flops(self.env.device, cfg.speed_monitor.gpu_flops_available),
        )
        device_tokens = cfg.device_tokens(self.env.world_size)
        module = self.train_module
        return ThroughputMonitor(speed, lambda: module.step_device_tokens() or device_tokens, self.env.device)

    def _next_batch(self, stop: StopConditions) -> tuple[dict[str, Any], float]:
        """Enter the next stage when the last one ended, then wait for the step's batch; also the seconds waited."""
        s = self.state
        if self._stage is None or s.global_step == self._stage.end_step:
            self._stage = self.stage_plan.at(s.global_step + 1)
            self._batch_iter = self._enter_stage(self._stage, self._batch_iter)
            self.restart_clock()
        # A signal ends the wait at once only in one process: with several, the others may be inside the step's
        # collectives, so a rank interrupted here could not save; it finishes the step and all save together.
        with self.phase("data_wait", s.global_step + 1), stop.waiting(self.env.world_size == 1):
            start = time.perf_counter()
            batch = next(self._batch_iter)
        return batch, time.perf_counter() - start

    def _post_step(self, record: StepMetrics, waited: float) -> None:
        s = self.state
        if self.stage_plan.staged and self._stage is not None:
            record.values["train/stage"] = self._stage.index
        ctx = StepContext(s.global_step, self._stop_at, self, record.values, waited, s.global_train_tokens_seen)
        ctx.clock_restarted = self.take_clock_restart()
        self.call_hook("post_step", ctx)

    def _rewind(self, before_step: int, reason: str) -> None:
        """Go back to the newest committed checkpoint from before ``before_step`` (a callback asked, see
        :meth:`rewind`): the checkpoints written since are deleted, ``on_rewind`` hooks run, and the model,
        optimizer, trainer state and data are restored from it.

        :raises OLMoTrainingError: when no committed checkpoint precedes ``before_step``.
        """
        s = self.state
        with self.phase("checkpoint"):
            target = self.checkpointer.newest_before(before_step, f"Step {s.global_step}: {reason}")
            rollback = self.cfg.stability.rollback
            limit = max(MAX_REWINDS_TO_ONE_CHECKPOINT, rollback.max_rollbacks + 1 if rollback.enabled else 0)
            self._count_rewind(s.global_step, target.step, reason, limit)
            order_dir = self.stage_plan.at(s.global_step).order_dir
            at = (s.global_step, target.step, before_step, reason, order_dir, s.epoch)
            self.call_hook(
                "on_rewind", RewindContext(*at, s.global_train_examples_seen_this_epoch, self.env.rank, self)
            )
            self.checkpointer.delete_from(before_step)
            close = getattr(self._batch_iter, "close", None)
            if close is not None:
                close()  # stops the loader's workers
            self.step_metrics.records.clear()  # steps that are trained again
            self.restore(target, True, True, rollback=True)
            self._batch_iter, self._stage = self.data.batches(self._stop_at), None
            self.restart_clock()

    def step(self, batch: dict[str, Any]) -> StepMetrics:
        """One training step as :meth:`fit` runs it (and ``scripts/benchmark.py`` times it): advance the data
        position, record the batch's indices, zero the gradients, train on ``batch``, step the optimizer, read the
        metrics back every ``metrics_collect_interval`` steps, and collect gen-1 garbage on schedule. Returns the
        step's metrics record (its values are on the host once collected)."""
        cfg, s = self.cfg, self.state
        order_dir = self.stage_plan.at(s.global_step + 1).order_dir  # where each recent batch came from
        self.stability.before_step(s.global_step + 1, order_dir, s.epoch, s.global_train_examples_seen_this_epoch)
        s.advance(cfg.global_train_batch_size, cfg.tokens_per_batch)
        if self.index_log is not None:
            self.index_log.write(s.global_step, batch["index"], batch.get("instance_mask"))
        record = self.train_step(batch)
        if s.global_step % self.collect_steps == 0:
            self.collect_metrics()
        if cfg.gen1_gc_interval is not None and s.global_step % cfg.gen1_gc_interval == 0:
            gc.collect(1)
        return record

    def _enter_stage(self, stage: Stage, batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Before the first step this launch trains of ``stage``: the ``on_stage`` hooks (the stage callback writes
        a KL stage's boundary checkpoint there, before the data moves on), then the stage's own data if it has
        any, then the train module's set-up of the stage. Returns the batches to train on."""
        s = self.state
        at_boundary = s.global_step == stage.start_step
        self.call_hook("on_stage", StageContext(s.global_step, stage, at_boundary, self.stage_plan.staged, self))
        if stage.segment != self.data.segment:
            assert at_boundary, "a resume restores the data of its stage"
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stops the old loader's workers
            s.start_epoch(0)
            self.data.use_segment(stage)
            batches = self.data.batches(self._stop_at)
        self.train_module.enter_stage(stage, at_boundary)
        return batches

    def _summary(self, logger: MetricsLogger) -> dict[str, Any]:
        """The run summary that closes the log (and wandb's summary)."""
        last, start_step, seconds = logger.last, self._start_step, self._stop.elapsed()
        fetched = fetch_metrics(self.data.fetch_stats())
        return {
            "steps this run": self.state.global_step - start_step,
            "global step": self.state.global_step,
            "tokens seen": self.state.global_train_tokens_seen,
            "first loss": logger.first_loss,
            "last loss": last.get("train/CrossEntropyLoss"),
            "tokens/s/device": round(last.get("throughput/device/tokens_per_second", 0.0)),
            "wall time (s)": round(seconds, 1),
            "save folder": self.cfg.save_folder,
            **checkpoint_summary(self.cfg.save_folder, self.state.global_step),
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

    # What the train module may read of and hand to the trainer (olmo.train.train_module.StepHost).
    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def tokens_seen(self) -> int:
        return self.state.global_train_tokens_seen

    @property
    def restored_path(self) -> Optional[str]:
        return self.checkpointer.restored_path

    def add_step_metrics(self, *values: Any) -> None:
        self.step_metrics.add(self.state.global_step, *values)
        if self.collect_steps == 1:  # read back now: a non-finite loss stops the run before the update
            self.collect_metrics()

    def count_filtered(self, step: int, count: torch.Tensor) -> None:
        self.filtered.add(step, count)

    def local_work(self) -> contextlib.AbstractContextManager[None]:
        return self.stragglers.local()

    def train_step(self, batch: dict[str, Any]) -> StepMetrics:
        """One step of the train module on this device batch, as :meth:`fit` runs it (for benchmarks and tests
        that drive steps themselves); returns the step's metrics record."""
        self.train_module.zero_grads()
        self.train_module.train_batch(batch)
        with self.phase("optimizer", self.state.global_step):
            self.train_module.optim_step()
            refresh_float8_scales(self.model)  # float8 weights' scales for the next all-gather, if any
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
            instances = functools.partial(self.data.instances_of, record.step)
            self.call_hook("post_metrics", MetricsContext(record.step, record.values, self, instances))
