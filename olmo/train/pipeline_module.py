"""The training step of a pipeline (issue 54): :class:`PipelineTrainModule`, chosen by ``pipeline_parallel.degree``.

Each rank's batch (the same instances on every stage of a pipeline) is cut into ``pipeline_parallel.microbatches``
(null: the device batch over ``device_train_microbatch_size``) that ``torch.distributed.pipelining``'s schedule runs
through this rank's stages (:mod:`olmo.distributed.pipeline`): the first stage embeds their tokens, each stage sends
its hidden states to the next, the last computes each micro-batch's loss, the summed cross entropy (and z-loss) over
the step's label count as one process computes it, and the backward flows back. The gradients are the step's
(``scale_grads=False``: the loss is already normalised), FSDP reduces them within each stage, the gradient norm sums
every stage's squares, and the loss sums are shared over the pipeline so the metrics are the whole model's.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import torch

from ..distributed.collectives import DistEnv
from ..distributed.pipeline import PipelineModel
from ..model.loss import LossSums
from .step_host import StepHost
from .step_settings import StepSettings
from .train_module import TransformerTrainModule

__all__ = ["PipelineTrainModule", "SCHEDULES"]

SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
"""``pipeline_parallel.schedule`` -> its class in ``torch.distributed.pipelining``."""
ZERO_BUBBLE = ("zero_bubble", "zbv")
"""The schedules that split each backward into its input-gradient and weight-gradient passes."""

log = logging.getLogger(__name__)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss: the last stage's output is the micro-batch's scaled loss already."""
    return output


class PipelineTrainModule(TransformerTrainModule):
    """OLMo's step over a pipeline of stages (see the module's docstring)."""

    def __init__(
        self, settings: StepSettings, env: DistEnv, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any
    ):
        super().__init__(settings, env, model, optimizer, scheduler)
        assert isinstance(model, PipelineModel), "a pipeline's step takes build_pipeline_model's model"
        self.pipeline_model = model
        self._schedule: Any = None
        self._microbatches = 0
        schedule = str(settings.pipeline_parallel.schedule)
        self.fused_loss = settings.fused_loss and schedule not in ZERO_BUBBLE
        if settings.fused_loss and not self.fused_loss:
            log.warning(
                "fused_loss is not used with pipeline_parallel.schedule=%s: a zero-bubble schedule computes the input "
                "and the weight gradients in two passes, which the fused loss's single backward cannot split; the "
                "last stage computes the logits (the same loss, more memory).",
                schedule,
            )

    def on_attach(self, trainer: StepHost) -> None:
        super().on_attach(trainer)
        self.norm_group = trainer.layout.pipeline_group
        rank = trainer.layout.pipeline_rank
        if (
            rank > 0
        ):  # after the initialisation: each stage's dropout draws from its own stream, not stage 0's copy
            torch.manual_seed(self.settings.seed + rank)

    def eval_batch(self, batch: dict[str, Any], labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The logits (B, T, V) (or, with ``labels``, the per-token cross entropy) of the whole model on every rank
        of the pipeline: each stage's forward in turn (:meth:`PipelineModel.logits`)."""
        from ..model.loss import per_token_cross_entropy

        device, mask = self.env.device, batch.get("attention_mask")
        model = self.pipeline_model
        for stage in model.stages:
            stage.eval()
        try:
            with (
                torch.no_grad(),
                torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None),
            ):
                logits = model.logits(
                    batch["input_ids"].to(device),
                    None if mask is None else mask.to(device),
                    self.trainer.layout.pipeline_group,
                )
        finally:
            for stage in model.stages:
                stage.train()
        return logits if labels is None else per_token_cross_entropy(logits, labels.to(device))

    def num_flops_per_token(self, seq_len: int) -> int:
        return self.pipeline_model.num_flops_per_token(seq_len)

    def _schedule_for(self, microbatches: int) -> Any:
        """The schedule over this rank's stages for ``microbatches`` micro-batches a step (built once)."""
        if self._schedule is None or self._microbatches != microbatches:
            from torch.distributed import pipelining

            model, layout = self.pipeline_model, self.trainer.layout
            stages = [
                pipelining.PipelineStage(
                    stage, stage.index, model.num_stages, self.env.device, group=layout.pipeline_group
                )
                for stage in model.stages
            ]
            name = str(self.settings.pipeline_parallel.schedule)
            cls = getattr(pipelining, SCHEDULES[name])
            self._schedule = cls(
                stages[0] if name == "1f1b" else stages,
                n_microbatches=microbatches,
                loss_fn=_loss,
                scale_grads=False,
            )
            self._microbatches = microbatches
        return self._schedule

    def _forward_backward(
        self,
        batch: dict[str, torch.Tensor],
        labels: torch.Tensor,
        loss_scale: torch.Tensor,
        max_doc_lens: Optional[list[int]] = None,
    ) -> LossSums:
        model, device = self.pipeline_model, self.env.device
        rows = batch["input_ids"].size(0)
        microbatches = self.settings.pipeline_parallel.microbatches or math.ceil(
            rows / self.settings.micro_batch_size
        )
        schedule = self._schedule_for(microbatches)
        for stage in model.stages:
            stage.loss_scale, stage.z_loss_multiplier = loss_scale, self.z_loss_multiplier
            stage.fused_loss = self.fused_loss
            stage.sums.clear()
        kwargs: dict[str, torch.Tensor] = {"labels": labels}
        for key in ("doc_lens", "attention_mask"):
            if key in batch:
                kwargs[key] = batch[key]
        first = any(stage.first for stage in model.stages)
        last = [stage for stage in model.stages if stage.last]
        args = (batch["input_ids"],) if first else ()
        with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            schedule.step(
                *args,
                target=labels if last else None,
                losses=[] if last else None,
                return_outputs=False,
                **kwargs,
            )
        # The last stage's sums of the step's micro-batches (a first step also ran one to learn the shapes), shared
        # over the pipeline: every stage's rank then holds the step's, as every tensor-parallel rank does its own.
        sums = torch.zeros(3, device=device)
        if last:
            kept = last[0].sums[-microbatches:]
            zero = torch.zeros((), device=device)
            parts = [[s.total, s.ce, zero if s.z is None else s.z] for s in kept]  # (micro-batches, 3)
            sums = torch.stack([torch.stack(p) for p in parts]).sum(dim=0).to(device, torch.float32)
        group = self.trainer.layout.pipeline_group
        torch.distributed.all_reduce(sums, group=group)
        total, ce, z = sums.unbind()
        return LossSums(total, ce, z, None)
