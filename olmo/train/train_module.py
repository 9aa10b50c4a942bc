"""The training step as a component: :class:`TrainModule`, with OLMo-core's API.

A train module owns *what one step does* (forward, loss, backward, clipping, the optimizer step) and the model
and optimizer a checkpoint holds; :class:`olmo.train.Trainer` owns *the loop* (data position, checkpoint and
evaluation cadence, stop conditions, metrics sinks). Each step the loop calls :meth:`~TrainModule.zero_grads`,
:meth:`~TrainModule.train_batch` and :meth:`~TrainModule.optim_step`, none of which waits for the device.

Loss normalization (:class:`TransformerTrainModule`): each step's loss is the mean cross entropy over every
*unmasked* label in the global batch. Each micro-batch contributes ``sum(CE) * world_size / n_labels_global`` to
the backward pass, so the gradient does not depend on how the global batch is split into ranks and micro-batches
(FSDP/DDP average gradients over ranks, which the ``world_size`` factor undoes). The original OLMo divided by
B*T instead, which under-weights label-masked fine-tuning batches.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from ..checkpoint.save import FULL_STATE, model_and_optim_state
from ..config import SchedulerUnits, TrainConfig
from ..data import check_token_ids
from ..data.builders import DataContext
from ..distributed.collectives import DistEnv, all_reduce
from ..distributed.context_parallel import ContextParallel
from ..distributed.parallelize import ParallelizeOptions, autocast_dtype, defer_replica_all_reduce
from ..distributed.tensor_parallel import order_fused_rows
from ..eval.evaluator import ModelEval
from ..exceptions import OLMoConfigurationError
from ..model import OLMo
from ..model.layers import output_head_loss
from ..model.loss import LossSums, next_token_labels, per_token_cross_entropy
from ..optim import BoltOnWarmupScheduler, build_scheduler, clip_grads, set_learning_rate
from ..optim.skip_step import StepFactorMixin
from .expert_load import ExpertLoadMeter
from .metrics import ReduceType
from .stability import SpikeDetector
from .stages import no_kl_penalty_error
from .step_host import EvalBatchSpec, StepHost
from .step_settings import StepSettings

if TYPE_CHECKING:
    from .stages import Stage

__all__ = [
    "StepHost",
    "TrainModule",
    "TransformerTrainModule",
    "BasicTrainModule",
    "EvalBatchSpec",
    "ReduceType",
]

log = logging.getLogger(__name__)


class TrainModule(ABC):
    """One training step and the state a checkpoint holds. Subclass it for a new training paradigm.

    A subclass sets :attr:`model` and :attr:`optimizer` (what checkpoints save and restore) and implements
    :meth:`train_batch`, :meth:`optim_step` and :meth:`eval_batch`. Metrics are recorded on the device with
    :meth:`record_ce_loss` and :meth:`record_metric` and queued by :meth:`queue_step_metrics`, which
    ``optim_step`` must call once per step, before ``optimizer.step()``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trains_kl_penalty: bool = False
    """Whether :meth:`enter_stage` sets up a stage's ``kl_beta`` (as :class:`olmo.train.kl.KLTrainModule` does)."""
    spike_detector: Optional[SpikeDetector] = None
    """With ``stability.skip_spikes``, what decides on the device whether a step's update is applied; the trainer
    checkpoints its state (None: the module does not skip spikes)."""

    def __init__(self) -> None:
        self._trainer: Optional[StepHost] = None
        self.stage: Optional[Stage] = None
        """The stage being trained (set by :meth:`enter_stage`)."""
        self._loss: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self._extra: dict[str, tuple[torch.Tensor, ReduceType]] = {}
        self._applied: Optional[torch.Tensor] = None  # 1.0 or 0.0: the step's update is applied (spike skipping)

    @property
    def trainer(self) -> StepHost:
        """The trainer this module is attached to (see :meth:`on_attach`), as far as a module may use it."""
        assert self._trainer is not None, "the train module is not attached to a Trainer yet"
        return self._trainer

    @classmethod
    def from_config(
        cls, cfg: TrainConfig, env: DistEnv, model: OLMo, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> TrainModule:
        """Build this module for a run (what :func:`build_train_module` calls); by default
        ``cls(cfg, env, model, optimizer, scheduler)``."""
        return cls(cfg, env, model, optimizer, scheduler)  # type: ignore[call-arg]

    def on_attach(self, trainer: StepHost) -> None:
        """Called once by the :class:`~olmo.train.Trainer` that will drive this module."""
        self._trainer = trainer

    def pre_train(self) -> None:
        """Called by ``Trainer.fit`` right before the first step."""
        self.model.train()

    @abstractmethod
    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        """Forward and backward over every micro-batch of this rank's device batch, accumulating gradients and
        recording the step's metrics on the device. ``dry_run``: record nothing (a warm-up batch)."""

    @abstractmethod
    def optim_step(self) -> None:
        """Clip, set the learning rate from the schedule, queue the step's metrics, step the optimizer."""

    def zero_grads(self) -> None:
        """Drop the gradients (set to None, freeing their memory)."""
        self.optimizer.zero_grad(set_to_none=True)

    @abstractmethod
    def eval_batch(self, batch: dict[str, Any], labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward only: the logits (B, T, V) of ``batch``, or with ``labels`` the per-token cross entropy (B, T)."""

    @property
    def eval_batch_spec(self) -> EvalBatchSpec:
        """What :meth:`eval_batch` takes. By default any batch the config's evaluators make (the largest of
        their ``device_eval_batch_size``) of up to ``model.max_sequence_length`` tokens; a module with a smaller
        limit overrides this, and the trainer refuses, at start-up, an evaluator whose batches exceed it."""
        return self.trainer.evaluator_batches

    def enter_stage(self, stage: Stage, at_boundary: bool) -> None:
        """Called by the trainer before the first step it trains of each stage (see :mod:`olmo.train.stages`; a run
        without ``stages`` is one stage): ``at_boundary`` when that step is the stage's first, otherwise the run
        resumed in the middle of the stage. Sets :attr:`stage`. A module that honours ``kl_beta`` overrides
        this (:class:`olmo.train.kl.KLTrainModule`)."""
        if stage.kl_beta > 0:
            raise no_kl_penalty_error(type(self).__name__, stage.index)
        self.stage = stage

    def on_optimizer_reset(self, step: int) -> None:
        """Called when a checkpoint of ``step`` was restored with a fresh optimizer (``--reset_optimizer_state``)."""
        log.info("Step %d restored with a fresh optimizer; %s keeps its schedule.", step, type(self).__name__)

    def state_dict(self, optim: Optional[bool] = None, full: bool = True) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}``: with ``full``, whole tensors on the CPU (what ``stepN-unsharded/model.pt``
        and ``optim.pt`` hold); otherwise this rank's shards (what DCP writes into ``stepN/``). ``optim=False``
        leaves the optimizer out."""
        return model_and_optim_state(self.model, None if optim is False else self.optimizer, full)

    def state_dict_to_save(self, sharded: bool) -> dict[str, Any]:
        """What the trainer's checkpoints hold of this module: :meth:`state_dict`, full for an unsharded checkpoint
        and sharded for a sharded one. The ``"model"`` and ``"optim"`` keys are the on-disk format; override to
        leave out state that is not trained (e.g. a frozen reference model's)."""
        return self.state_dict(full=not sharded)

    def load_state_dict(self, state: dict[str, Any], full: bool = True) -> None:
        """Load what :meth:`state_dict` returned (the optimizer only when ``state`` has ``"optim"``)."""
        options = FULL_STATE if full else None
        set_model_state_dict(self.model, state["model"], options=options)
        if "optim" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=options)
        order_fused_rows(self.model, self.optimizer if "optim" in state else None)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at context length ``seq_len`` (for MFU)."""
        assert isinstance(self.model, OLMo), "override num_flops_per_token for a model other than OLMo"
        return self.model.num_flops_per_token(seq_len)

    def global_num_flops_in_batch(self, batch: dict[str, Any]) -> int:
        """Training FLOPs of one global batch, given this rank's device batch."""
        rows, seq_len = batch["input_ids"].shape
        data_parallel = self.trainer.layout.data_parallel_size
        return self.num_flops_per_token(seq_len) * rows * seq_len * data_parallel

    def step_device_tokens(self) -> Optional[int]:
        """This device's tokens of the last step when not its batch's (RL's groups); None: the batch's count."""
        return None

    def record_ce_loss(
        self, ce_sum: torch.Tensor, n_labels: torch.Tensor, z_sum: Optional[torch.Tensor] = None
    ) -> None:
        """Record this step's loss: this rank's summed cross entropy (and z-loss) and the *global* label count.
        The trainer logs ``sum over ranks / n_labels`` as ``train/CrossEntropyLoss`` (and ``train/ZLoss``)."""
        self._loss = (ce_sum, torch.zeros_like(ce_sum) if z_sum is None else z_sum, n_labels)

    def record_metric(self, name: str, value: torch.Tensor, reduce_type: ReduceType = ReduceType.mean) -> None:
        """Record a scalar metric of this step on this rank; it is reduced over ranks and logged as ``name``."""
        self._extra[name] = (value, reduce_type)

    def queue_step_metrics(self, learning_rate: float, grad_norm: torch.Tensor) -> None:
        """Hand the step's recorded metrics to the trainer. With ``metrics_collect_interval`` 1 they are read back
        now, so a non-finite loss or gradient norm stops the run before ``optimizer.step()`` touches the weights."""
        assert self._loss is not None, "record_ce_loss was not called in this step"
        ce_sum, z_sum, n_labels = self._loss
        self.trainer.add_step_metrics(
            learning_rate, ce_sum, z_sum, n_labels, grad_norm, self._extra, self._applied
        )
        self._loss, self._extra, self._applied = None, {}, None


class TransformerTrainModule(TrainModule):
    """The OLMo training step: label masks, global-label-count loss normalization, fused loss, z-loss, autocast,
    gradient accumulation with a deferred replica all-reduce, clipping and the scheduled learning rate.

    :param settings: what the step reads of the run (:meth:`from_config` takes it from the config).
    :param scheduler: an :mod:`olmo.optim` scheduler.
    """

    def __init__(
        self, settings: StepSettings, env: DistEnv, model: OLMo, optimizer: torch.optim.Optimizer, scheduler: Any
    ):
        super().__init__()
        self.settings, self.env, self.model = settings, env, model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.norm_group: Any = None  # a pipeline's: the other stages' ranks, whose gradients the norm counts
        self.autocast_dtype = autocast_dtype(settings, env.device)
        self._eval = ModelEval(model, env.device, self.autocast_dtype)  # forward under no_grad and autocast
        self.z_loss_multiplier = settings.z_loss_multiplier  # None: no z-loss
        self.defer_replica_all_reduce = defer_replica_all_reduce(settings.parallel, settings.ddp, env) and hasattr(
            model, "set_requires_all_reduce"
        )
        self._stage_schedulers: dict[int, Any] = {}
        self.source_names: Optional[list[str]] = None
        """The sources of the data being trained (a mixture), whose losses are logged as
        ``train/{name}/CrossEntropyLoss``; None without a mixture."""
        self._source_sums: Optional[torch.Tensor] = None  # (S, 2): this rank's CE sum and label count per source
        self.spike_detector: Optional[SpikeDetector] = None
        """With ``stability.skip_spikes.enabled``: decides, on the device, whether each step's update is applied."""
        if settings.skip_spikes.enabled:
            if not isinstance(optimizer, StepFactorMixin):
                raise OLMoConfigurationError(
                    f"stability.skip_spikes needs a skip-step optimizer (build_optimizer(..., skip_steps=True)); "
                    f"got {type(optimizer).__name__}."
                )
            self.spike_detector = SpikeDetector(settings.skip_spikes, env.device)
        self._global_ce: Optional[torch.Tensor] = None  # the step's mean loss over ranks, for the spike detector
        self.expert_load = ExpertLoadMeter(model)  # model.moe: the auxiliary losses' shares, the routers' metrics
        self.context_parallel: Optional[ContextParallel] = None
        """With ``context_parallel.degree`` > 1: the layout's group of ranks sharing each instance (set on attaching);
        this rank trains on its share of every instance's tokens (:mod:`olmo.distributed.context_parallel`)."""

    @classmethod
    def from_config(
        cls, cfg: TrainConfig, env: DistEnv, model: OLMo, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> TrainModule:
        """``cls(settings, env, model, optimizer, scheduler)`` with the :class:`StepSettings` of ``cfg``."""
        settings = StepSettings(
            **{name: getattr(cfg, name) for name in StepSettings.SAME_NAMES},
            skip_spikes=cfg.stability.skip_spikes,
            parallel=ParallelizeOptions.from_train_config(cfg),
            data_context=DataContext.from_train_config(cfg),
            micro_batch_size=cfg.device_train_microbatch_size,
            fused_loss=bool(cfg.fused_loss),
            z_loss_multiplier=(cfg.auxiliary_loss_multiplier or 1e-4) if cfg.softmax_auxiliary_loss else None,
            autocast_precision=cfg.autocast_precision,
        )
        return cls(settings, env, model, optimizer, scheduler)  # type: ignore[call-arg]

    def on_attach(self, trainer: StepHost) -> None:
        super().on_attach(trainer)
        self.context_parallel = trainer.layout.context_parallel

    @property
    def per_row(self) -> bool:
        """Whether the step needs each instance's loss (for the per-source losses of a mixture)."""
        return self.source_names is not None

    def enter_stage(self, stage: Stage, at_boundary: bool) -> None:
        super().enter_stage(stage, at_boundary)
        self.set_sources(stage)

    def set_sources(self, stage: Stage) -> None:
        """Log per-source losses while ``stage`` trains on a mixture (its sources, in order, are the batch's
        ``source_id`` values)."""
        mixture = stage.data.mixture
        self.source_names = None if mixture is None else [s.name for s in mixture.sources]

    def on_optimizer_reset(self, step: int) -> None:
        # A fresh optimizer restarting mid-schedule gets its own warmup back up to the schedule.
        self.scheduler = BoltOnWarmupScheduler(self.scheduler, step, step + int(self.settings.scheduler.t_warmup))

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        step = self.trainer.global_step
        check_token_ids(batch, self.settings.model.vocab_size, step)
        device, W = self.env.device, self.env.world_size
        max_doc_lens = batch.get("max_doc_lens")  # a list, which stays on the host
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        labels = next_token_labels(batch)
        if self.context_parallel is not None:  # this rank's tokens, before counting labels: the whole is the sum
            batch = {**batch, "input_ids": self.context_parallel.shard(batch["input_ids"])}
            labels = self.context_parallel.shard(labels)
        counts = [(labels != -100).sum().float()]
        if "instance_mask" in batch:  # the instances the filter dropped, summed in the same all-reduce
            counts.append((~batch["instance_mask"]).sum().float())
        n_labels, *n_filtered = all_reduce(torch.stack(counts)).unbind()
        if n_filtered and not dry_run:
            self.trainer.count_filtered(step, n_filtered[0])
        loss_scale = W / n_labels.clamp(min=1.0)
        sums = self._forward_backward(batch, labels, loss_scale, max_doc_lens)
        if self.spike_detector is not None:
            # The one reduction spike skipping adds: a float per step, on the device (no host sync).
            self._global_ce = all_reduce(sums.ce.detach().clone()) / n_labels.clamp(min=1.0)
        if not dry_run:
            self.record_ce_loss(sums.ce, n_labels, sums.z)
            self.record_step_sums(sums, loss_scale / W)
            self.expert_load.record(self.record_metric)
            if self._source_sums is not None and self.source_names is not None:
                for name, pair in zip(self.source_names, self._source_sums.unbind()):
                    self.record_metric(f"train/{name}/CrossEntropyLoss", pair, ReduceType.ratio)
        self._source_sums = None

    def record_step_sums(self, sums: LossSums, per_label: torch.Tensor) -> None:
        """Record metrics beyond the cross entropy from this rank's summed losses of the step (``per_label`` is
        one over the global label count); nothing by default."""

    def _forward_backward(
        self,
        batch: dict[str, torch.Tensor],
        labels: torch.Tensor,
        loss_scale: torch.Tensor,
        max_doc_lens: Optional[list[int]] = None,
    ) -> LossSums:
        """Forward and backward over each micro-batch, accumulating gradients; return this rank's summed
        losses (device tensors: ``total`` unscaled, the detached sums, z-loss 0 without it, ``kl`` when the
        micro-batches report one). With ``doc_lens`` in the batch (``data.generate_doc_lengths``) the model
        masks attention between the documents of an instance."""
        device = self.env.device
        ce_sum, z_sum, total_sum = (torch.zeros((), device=device) for _ in range(3))
        kl_sum: Optional[torch.Tensor] = None
        micro, n_rows = self.settings.micro_batch_size, batch["input_ids"].size(0)
        sources = batch.get("source_id") if self.source_names is not None else None  # (B,)
        source_sums = None if sources is None else torch.zeros(len(self.source_names or []), 2, device=device)
        try:
            for start in range(0, n_rows, micro):
                rows = slice(start, start + micro)
                documents: dict[str, Any] = {}
                if self.context_parallel is not None:  # the model's other inputs, for every forward of the step
                    documents["context_parallel"] = self.context_parallel
                if "doc_lens" in batch:
                    documents["doc_lens"] = batch["doc_lens"][rows]
                    documents["max_doc_lens"] = None if max_doc_lens is None else max_doc_lens[rows]
                if self.defer_replica_all_reduce:
                    # Replicas all-reduce the accumulated gradients once, after the last micro-batch.
                    self.model.set_requires_all_reduce(start + micro >= n_rows)  # type: ignore[operator]
                if "attention_mask" in batch:
                    documents["attention_mask"] = batch["attention_mask"][rows]
                share = min(micro, n_rows - start) / n_rows
                self.expert_load.start_micro_batch(share)
                with torch.autocast(
                    device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
                ):
                    loss = self.micro_batch_loss(batch["input_ids"][rows], labels[rows], documents)
                (loss.total * loss_scale).backward()
                self.expert_load.end_micro_batch(share)
                ce_sum += loss.ce
                total_sum += loss.total.detach()
                if loss.z is not None:
                    z_sum += loss.z
                if loss.kl is not None:
                    kl_sum = loss.kl if kl_sum is None else kl_sum + loss.kl
                if source_sums is not None and sources is not None and loss.ce_rows is not None:
                    # Each instance's loss and label count to its source's row: no host sync, one add each.
                    per_row = torch.stack(
                        [loss.ce_rows.float(), (labels[rows] != -100).sum(dim=-1).float()], dim=1
                    )
                    source_sums.index_add_(0, sources[rows], per_row)
        finally:
            if self.defer_replica_all_reduce:
                self.model.set_requires_all_reduce(True)  # type: ignore[operator]
        self._source_sums = source_sums
        return LossSums(total_sum, ce_sum, z_sum, kl_sum)

    def micro_batch_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, inputs: dict[str, Any]) -> LossSums:
        """The summed losses of one micro-batch, under the step's autocast; ``total`` is what backward runs on.
        ``inputs`` holds the model's other arguments (``attention_mask``, ``doc_lens``, ``max_doc_lens``). With
        :attr:`per_row`, the loss is computed through the model's output head hook, with each instance's sum."""
        if self.per_row:
            fused = self.settings.fused_loss
            head = partial(
                output_head_loss,
                labels=labels,
                z_loss_multiplier=self.z_loss_multiplier,
                fused=fused,
                per_row=True,
            )
            return self.model(input_ids, head=head, **inputs).loss
        return self.model(
            input_ids,
            labels=labels,
            z_loss_multiplier=self.z_loss_multiplier,
            fused_loss=self.settings.fused_loss,
            **inputs,
        ).loss

    def optim_step(self) -> None:
        step = self.trainer.global_step
        max_norm = self.scheduler.get_max_grad_norm(self.settings.max_grad_norm, step)
        grad_norm = clip_grads(self.optimizer, max_norm, self.settings.max_grad_norm_ratio, step, self.norm_group)
        lr = self._learning_rate()
        if self.spike_detector is not None and self._global_ce is not None:
            factor, z = self.spike_detector.step_factor(self._global_ce, grad_norm, step)
            self.optimizer.step_factor = factor  # type: ignore[attr-defined]
            self.record_metric("optim/skipped_steps", self.spike_detector.skipped.clone(), ReduceType.max)
            self.record_metric("stability/loss_zscore", z[0], ReduceType.max)
            self.record_metric("stability/grad_norm_zscore", z[1], ReduceType.max)
            self._applied = factor
            self._global_ce = None
        self.queue_step_metrics(lr, grad_norm)
        set_learning_rate(self.optimizer, lr)
        with self.trainer.local_work():  # local work: timed to find a slow rank (stability.stragglers)
            self.optimizer.step()

    def _learning_rate(self) -> float:
        """The scheduled LR for the current step (the first update uses step 1, as in OLMo). A stage with its own
        ``scheduler`` restarts that schedule at its first step and spans the stage."""
        host = self.trainer
        max_steps = host.max_steps
        scheduler, units, start = self.scheduler, self.settings.scheduler.units, 0
        stage = self.stage
        if stage is not None and stage.scheduler is not None:
            if stage.index not in self._stage_schedulers:
                self._stage_schedulers[stage.index] = build_scheduler(stage.scheduler)
            scheduler, units = self._stage_schedulers[stage.index], stage.scheduler.units
            start, max_steps = stage.start_step, stage.num_steps
        if units == SchedulerUnits.tokens:
            tokens = self.settings.tokens_per_batch
            current, t_max = host.tokens_seen - start * tokens, max_steps * tokens
        else:
            current, t_max = host.global_step - start, max_steps
        return scheduler.get_lr(self.settings.optimizer.learning_rate, current, t_max)

    def eval_batch(self, batch: dict[str, Any], labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._eval.eval_batch(batch, labels)


class BasicTrainModule(TrainModule):
    """The smallest useful train module: plain next-token cross entropy over the whole device batch in one
    forward pass (no micro-batches, masks, z-loss or autocast), a fixed learning rate and optional clipping.

    A starting point for a custom module; it works on one process or under DDP/FSDP.

    :param learning_rate: used for every step.
    :param max_grad_norm: clip the global gradient norm to this, or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        learning_rate: float,
        max_grad_norm: Optional[float] = None,
    ):
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self.learning_rate, self.max_grad_norm = learning_rate, max_grad_norm

    @classmethod
    def from_config(
        cls, cfg: TrainConfig, env: DistEnv, model: OLMo, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> TrainModule:
        """``optimizer.learning_rate`` for every step (the schedule is ignored) and ``max_grad_norm``."""
        return cls(model, optimizer, cfg.optimizer.learning_rate, cfg.max_grad_norm)

    def on_attach(self, trainer: StepHost) -> None:
        super().on_attach(trainer)
        if trainer.layout.context > 1:
            log.warning(
                "context_parallel.degree=%d is not honoured by %s: each rank of a group trains its instances whole "
                "(the same numbers, no memory saved). TransformerTrainModule splits them.",
                trainer.layout.context,
                type(self).__name__,
            )

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        device = next(self.model.parameters()).device
        input_ids = batch["input_ids"].to(device)  # (B, T)
        labels = torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.size(0), 1), -100)], dim=1)  # (B, T)
        n_labels = all_reduce((labels != -100).sum().float())
        ce_sum = per_token_cross_entropy(self.model(input_ids).logits, labels).sum()
        # Scaled by the world size because DDP/FSDP average gradients over ranks.
        (ce_sum * self.trainer.env.world_size / n_labels).backward()
        if not dry_run:
            self.record_ce_loss(ce_sum.detach(), n_labels)

    def optim_step(self) -> None:
        norm = clip_grads(self.optimizer, self.max_grad_norm)  # also right for FSDP's sharded gradients
        self.queue_step_metrics(self.learning_rate, norm)
        set_learning_rate(self.optimizer, self.learning_rate)
        self.optimizer.step()

    def eval_batch(self, batch: dict[str, Any], labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        device = next(self.model.parameters()).device
        with torch.no_grad():
            logits = self.model(batch["input_ids"].to(device)).logits
        return logits if labels is None else per_token_cross_entropy(logits, labels.to(device))
