"""Training with a KL penalty to a frozen reference model: :class:`KLTrainModule`.

In a stage with ``kl_beta > 0`` (see :mod:`olmo.train.stages`) each step minimizes

    cross entropy + z-loss + kl_beta * KL(policy || reference)

where the reference is a frozen copy of the model: a snapshot taken at the stage's first step (saved as
``save_folder/stage{i}-step{N}`` so that a resume rebuilds it), or the model of ``kl_reference.load_path``. The
reference is built like the policy (same FSDP sharding, compile and activation checkpointing), is never trained,
runs in eval mode (no dropout) under the same autocast, and lives only while a stage needs it. Two estimators
(``kl_estimator``):

* ``nll_diff``: per token, the policy's negative log-likelihood of the label minus the reference's, the latter as
  a constant (``policy_loss - stop_gradient(reference_loss)``). One forward of the reference per micro-batch,
  computed the same way as the policy's loss (fused or not).
* ``full``: the exact KL over the whole vocabulary at every labelled position, computed together with the loss
  by :func:`olmo.model.loss.fused_output_loss` from both models' final hidden states, one chunk of tokens at a time,
  so neither model's (tokens x vocab) logits ever exist (whatever ``fused_loss`` says).

Metrics: ``train/CrossEntropyLoss`` stays the cross entropy alone; ``train/KL`` is the mean KL per label and
``train/TotalLoss`` the loss optimized (cross entropy + z-loss + ``kl_beta`` x KL), both per label of the global
batch like the cross entropy.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..checkpoint import inspect_checkpoint, load_checkpoint
from ..config import KLEstimator
from ..distributed.parallelize import build_model
from ..exceptions import OLMoCheckpointError
from ..model.layers import output_head_loss
from ..model.loss import LossSums, OutputHead
from .metrics import ReduceType
from .stages import Stage, boundary_checkpoint_name, check_boundary_checkpoint, find_boundary_checkpoint
from .train_module import TransformerTrainModule

__all__ = ["KLTrainModule"]

log = logging.getLogger(__name__)


class KLTrainModule(TransformerTrainModule):
    """:class:`~olmo.train.train_module.TransformerTrainModule` plus the KL penalty of the current stage (none in a stage
    with ``kl_beta: 0``, where a step is exactly the parent's)."""

    trains_kl_penalty = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reference: Optional[nn.Module] = None
        self._reference_source: Optional[str] = None  # what the reference holds: a path, or "stage{i}"

    # ----------------------------------------------------------------------------------------------
    def enter_stage(self, stage: Stage, at_boundary: bool) -> None:
        self.stage = stage
        self.set_sources(stage)
        if stage.kl_beta == 0:
            if self.reference is not None:
                log.info("Stage %s has no KL penalty: dropping the reference model.", stage.name)
            self.reference, self._reference_source = None, None
            return
        load_path = self.settings.kl_reference.load_path
        if load_path is not None:
            source = load_path
        elif at_boundary:
            source = f"stage{stage.index}"  # this stage's snapshot, taken now
        else:
            found = find_boundary_checkpoint(self.settings.save_folder, stage, self.trainer.restored_path)
            source = str(found or Path(self.settings.save_folder) / boundary_checkpoint_name(stage))
        if source == self._reference_source:
            return
        if self.reference is None:
            self.reference = build_model(
                self.settings.model, self.trainer.layout, self.settings.parallel, init_params=False
            )
            self.reference.eval()
            self.reference.requires_grad_(False)
        if source == f"stage{stage.index}":
            with torch.no_grad():
                for ref, param in zip(self.reference.parameters(), self.model.parameters()):
                    ref.copy_(param)
            log.info("KL reference of stage %s: the model at step %d.", stage.name, stage.start_step)
        else:
            self._load_reference(source, stage, from_boundary=load_path is None)
        self._reference_source = source

    def _load_reference(self, path: str, stage: Stage, from_boundary: bool) -> None:
        assert self.reference is not None
        flag = "kl_reference.load_path" if not from_boundary else "the KL reference"
        try:
            info = inspect_checkpoint(path, flag)
        except OLMoCheckpointError as e:
            if not from_boundary:
                raise
            raise OLMoCheckpointError(
                f"Cannot rebuild the KL reference of stage {stage.index} ({stage.name}): {e} It is the model at the "
                f"stage's first step (step {stage.start_step}), saved there when the stage began. Resume from a "
                f"checkpoint at or before step {stage.start_step} (--load_path), or name the reference with "
                f"--kl_reference.load_path."
            ) from None
        if from_boundary:  # as check_kl_reference checked it before the launch wrote anything
            try:
                check_boundary_checkpoint(
                    self.settings.save_folder, stage, Path(path), info, self.trainer.restored_path
                )
            except OLMoCheckpointError as e:
                raise OLMoCheckpointError(
                    f"'{path}' cannot be the KL reference of stage {stage.index}: {e}"
                ) from None
        load_checkpoint(info, self.reference, None, load_trainer_state=False)
        log.info("KL reference of stage %s: the model of %s (step %d).", stage.name, path, info.step)

    # ----------------------------------------------------------------------------------------------
    def micro_batch_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, inputs: dict[str, Any]) -> LossSums:
        stage, reference = self.stage, self.reference
        if stage is None or stage.kl_beta == 0 or reference is None:
            return super().micro_batch_loss(input_ids, labels, inputs)
        beta, fused = stage.kl_beta, self.settings.fused_loss
        z = self.z_loss_multiplier
        if stage.kl_estimator == KLEstimator.nll_diff:
            with torch.no_grad():
                ref_ce = reference(input_ids, labels=labels, fused_loss=fused, **inputs).loss.ce
            # d/dθ [ce + beta * (ce - const)] = (1 + beta) d(ce)/dθ: the policy's loss with its cross entropy
            # weighted by 1 + beta, computed the way the reference's was.
            head = partial(
                output_head_loss,
                labels=labels,
                z_loss_multiplier=z,
                fused=fused,
                ce_weight=1 + beta,
                per_row=self.per_row,
            )
            loss = self.model(input_ids, head=head, **inputs).loss
            return LossSums(loss.total - beta * ref_ce, loss.ce, loss.z, loss.ce - ref_ce, loss.ce_rows)
        with torch.no_grad():
            ref_head = reference(input_ids, head=_captured_head, **inputs).loss
        head = partial(
            output_head_loss,
            labels=labels,
            z_loss_multiplier=z,
            fused=True,
            reference=ref_head,
            kl_beta=beta,
            per_row=self.per_row,
        )
        return self.model(input_ids, head=head, **inputs).loss

    def record_step_sums(self, sums: LossSums, per_label: torch.Tensor) -> None:
        if sums.kl is None:
            return
        self.record_metric("train/KL", sums.kl * per_label, ReduceType.sum)
        self.record_metric("train/TotalLoss", sums.total * per_label, ReduceType.sum)


def _captured_head(out: OutputHead) -> OutputHead:
    """The reference's final hidden states and output layer, kept past its forward. A weight that FSDP
    gathered for the forward is copied, since FSDP frees the gathered copy afterwards."""
    weight, bias = out.weight, out.bias
    if _fsdp_may_free(weight):
        weight = weight.detach().clone()
        bias = None if bias is None else bias.detach().clone()
    return OutputHead(out.hidden, weight, bias, out.logit_scale)


def _fsdp_may_free(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` may be a parameter FSDP gathered for the forward and frees when it reshards (with more
    than one rank; a replicated parameter is copied needlessly, which costs memory but no correctness)."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
