"""Direct Preference Optimization: :class:`DPOTrainModule`, the loss of :func:`dpo_pair_losses`, and
:func:`resolve_dpo_reference`, which fixes the reference model of a run before anything is written.

Each rank trains whole pairs (the data order deals pairs, :class:`olmo.data.IterableDataset` with ``pairs``): rows
``2j`` and ``2j + 1`` of every micro-batch are one pair's chosen and rejected answers. Per micro-batch, the policy and
the frozen reference compute each row's log-probability of its labels (the answer's tokens, summed); the pairs'
losses are summed and scaled by ``world_size / pairs in the global batch``, so the gradient is that of the mean loss
over the global batch's pairs however the batch is split into ranks and micro-batches (as the cross entropy's is
over labels, :mod:`olmo.train.train_module`).

The reference is built like the policy (same FSDP sharding, compile and activation checkpointing), never trained,
in eval mode (no dropout), under the same autocast. ``train/CrossEntropyLoss`` stays the policy's cross entropy
over every label of the batch (chosen and rejected answers), for comparison with the SFT run.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import inspect_checkpoint, load_checkpoint
from ..config import DPOConfig, DPOLoss, ModelConfig, TrainConfig
from ..data import check_token_ids
from ..distributed.collectives import all_reduce
from ..distributed.parallelize import build_model
from ..exceptions import OLMoCheckpointError, OLMoConfigurationError, OLMoDataError
from ..model.layers import lm_head
from ..model.loss import OutputHead, next_token_labels, per_token_cross_entropy
from ..util import is_url
from .dpo_reference import ReferenceInputs, precomputed_reference, reference_of_batch
from .metrics import ReduceType
from .train_module import TransformerTrainModule

if TYPE_CHECKING:
    from ..checkpoint.restore import LaunchPlan
    from .stages import Stage

__all__ = [
    "DPOTrainModule",
    "check_pairs_differ",
    "dpo_pair_losses",
    "identical_pairs",
    "continued_config",
    "resolve_dpo_reference",
    "resolve_reference",
    "sequence_log_probs",
]

log = logging.getLogger(__name__)


def sequence_log_probs(out: OutputHead, labels: torch.Tensor) -> torch.Tensor:
    """(B,) each row's summed log-probability of its labels (-100: not counted), in fp32, differentiable: a model
    output head (``model(input_ids, head=partial(sequence_log_probs, labels=labels))``). The logits of the rows
    exist at once (B x T x V)."""
    logits, _ = lm_head(out.hidden, out.weight, out.bias, None, None, False, out.logit_scale)
    assert logits is not None
    return -per_token_cross_entropy(logits, labels).sum(dim=-1)


def dpo_pair_losses(
    policy: torch.Tensor,
    reference: torch.Tensor,
    lengths: torch.Tensor,
    beta: float,
    loss: DPOLoss,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair's loss and its chosen and rejected rewards, from the summed log-probabilities of ``2P`` rows
    (``policy``, ``reference``; chosen rows even, rejected odd) with ``lengths`` labelled tokens each.

    The rewards are ``beta * (log pi - log ref)`` of the summed log-probabilities, for every loss (as TRL reports
    them); the ``ipo`` and ``norm`` losses compare the log-ratios divided by the answers' lengths.
    """
    ratios = (policy - reference).view(-1, 2)  # (P, [chosen, rejected])
    rewards = (beta * ratios).detach()
    if loss in (DPOLoss.ipo, DPOLoss.norm):
        ratios = ratios / lengths.view(-1, 2).clamp(min=1).to(ratios.dtype)
    delta = ratios[:, 0] - ratios[:, 1]
    if loss == DPOLoss.ipo:
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * delta)
        if label_smoothing:
            losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-beta * delta)
    return losses, rewards[:, 0], rewards[:, 1]


class DPOTrainModule(TransformerTrainModule):
    """:class:`~olmo.train.train_module.TransformerTrainModule` with the DPO loss of ``cfg.dpo`` in place of the cross
    entropy; the reference is the model of ``dpo.reference_path`` (set by :func:`resolve_dpo_reference`)."""

    trains_dpo = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.settings.dpo.reference_path is None:
            raise OLMoConfigurationError(
                "dpo.reference_path is not set: scripts/train.py sets it to the model the run starts from; a program "
                "building DPOTrainModule itself must set it (or call olmo.train.dpo.resolve_dpo_reference)."
            )
        self.reference: Optional[nn.Module] = None
        self.reference_logps: Optional[np.ndarray] = None
        """With ``dpo.precompute_reference``: every instance's reference log-probability (a memmap)."""

    def enter_stage(self, stage: Stage, at_boundary: bool) -> None:
        super().enter_stage(stage, at_boundary)
        if self.reference is not None or self.reference_logps is not None:
            return
        s = self.settings
        path = str(s.dpo.reference_path)
        if s.dpo.precompute_reference:
            self.reference_logps = precomputed_reference(
                ReferenceInputs(s.data, s.model, s.data_context, path, s.save_folder, s.micro_batch_size),
                self.trainer.layout,
                lambda: self._load_reference(path),
                self._reference_forward,
            )
        else:
            self.reference = self._load_reference(path)

    def _reference_forward(self, reference: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The reference's summed log-probabilities (B,) of a collated batch (for the precomputation)."""
        device = self.env.device
        max_doc_lens = batch.get("max_doc_lens")
        batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        inputs = _model_inputs(batch, slice(None), max_doc_lens)
        with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return _log_probs(reference, batch["input_ids"], next_token_labels(batch), inputs)

    def _load_reference(self, path: str) -> nn.Module:
        reference = build_model(
            self.settings.model, self.trainer.layout, self.settings.parallel, init_params=False
        )
        reference.eval()
        reference.requires_grad_(False)
        info = inspect_checkpoint(path, "dpo.reference_path")
        load_checkpoint(info, reference, None, load_trainer_state=False)
        log.info("DPO reference: the model of %s (step %d), frozen.", path, info.step)
        return reference

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> None:
        assert self.reference is not None or self.reference_logps is not None, "enter_stage was not called"
        check_token_ids(batch, self.settings.model.vocab_size, self.trainer.global_step)
        self._check_pairs_differ(batch)
        device, W, dpo = self.env.device, self.env.world_size, self.settings.dpo
        max_doc_lens = batch.get("max_doc_lens")
        indices = batch.get("index")  # on the host: the rows' instances, for precomputed reference values
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        labels = next_token_labels(batch)
        lengths = (labels != -100).sum(dim=-1)  # (B,) labelled tokens per answer
        rows = batch["input_ids"].size(0)
        n_labels, n_pairs = all_reduce(torch.stack([lengths.sum().float(), lengths.new_tensor(rows // 2).float()]))
        scale = W / n_pairs.clamp(min=1.0)
        sums = torch.zeros(6, device=device)  # loss, CE, chosen and rejected rewards, correct pairs, margin
        micro = self.settings.micro_batch_size
        try:
            for start in range(0, rows, micro):
                part = slice(start, start + micro)
                inputs = _model_inputs(batch, part, max_doc_lens)
                if self.defer_replica_all_reduce:
                    self.model.set_requires_all_reduce(start + micro >= rows)  # type: ignore[operator]
                with torch.autocast(
                    device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
                ):
                    if self.reference_logps is not None:
                        assert indices is not None, "the batch has no instance indices"
                        ref = reference_of_batch(self.reference_logps, indices[part], device)
                    else:
                        assert self.reference is not None
                        with torch.no_grad():
                            ref = _log_probs(self.reference, batch["input_ids"][part], labels[part], inputs)
                    policy = _log_probs(self.model, batch["input_ids"][part], labels[part], inputs)
                losses, chosen, rejected = dpo_pair_losses(
                    policy, ref, lengths[part], dpo.beta, dpo.loss, dpo.label_smoothing
                )
                (losses.sum() * scale).backward()
                sums += torch.stack(
                    [
                        losses.detach().sum(),
                        -policy.detach().sum(),
                        chosen.sum(),
                        rejected.sum(),
                        (chosen > rejected).float().sum(),
                        (chosen - rejected).sum(),
                    ]
                )
        finally:
            if self.defer_replica_all_reduce:
                self.model.set_requires_all_reduce(True)  # type: ignore[operator]
        per_pair = sums / n_pairs.clamp(min=1.0)  # this rank's share of each mean over the global batch's pairs
        if self.spike_detector is not None:
            self._global_ce = all_reduce(per_pair[0].clone())
        if dry_run:
            return
        self.record_ce_loss(sums[1], n_labels)
        names = ("loss", None, "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin")
        for name, value in zip(names, per_pair.unbind()):
            if name is not None:
                self.record_metric(f"train/dpo/{name}", value, ReduceType.sum)

    def _check_pairs_differ(self, batch: dict[str, Any]) -> None:
        """Refuse a batch holding a pair whose two rows are the same tokens and labels (data prepared before
        ``prepare_preference_data.py`` refused such pairs): its loss is constant and it has no gradient."""
        same = identical_pairs(batch["input_ids"], batch.get("label_mask"))
        if not same.any():
            return
        row = 2 * int(same.nonzero()[0][0])
        index = [int(i) for i in batch["index"][row : row + 2]] if "index" in batch else [row, row + 1]
        raise OLMoDataError(
            f"Instances {index[0]} and {index[1]} of data.paths (a pair, at step {self.trainer.global_step}) are the "
            f"same tokens and labels, {_OLD_PREPARATION}"
        )


_OLD_PREPARATION = (
    "so the pair teaches no preference (its loss has no gradient). The files were prepared by a "
    "scripts/prepare_preference_data.py older than its check for such pairs: prepare them again (it names each such "
    "line of the input) and train on the new files."
)


def check_pairs_differ(dataset: Any, max_tokens: int, rows_per_read: int = 1 << 12) -> None:
    """Refuse, before training, preference data holding a pair whose two instances are the same tokens and labels,
    reading at most ``max_tokens`` tokens of it (local files, in order, in reads of ``rows_per_read`` instances);
    the train step checks every batch too (:meth:`DPOTrainModule._check_pairs_differ`), past what was read here.

    :raises OLMoDataError: naming the instances and the fix."""
    bounds, length, read = dataset.instance_bounds(), dataset.chunk_size, 0
    for i, path in enumerate(dataset.paths):
        first, count = int(bounds[i]), int(bounds[i + 1] - bounds[i])
        if first % 2 or is_url(str(path)) or dataset.label_mask_paths is None:
            continue  # a file whose pairs straddle another's, or a remote one: the train step checks them
        tokens, mask = dataset.tokens(i), dataset.label_mask(i)
        for start in range(0, count - count % 2, rows_per_read):
            stop = min(count - count % 2, start + rows_per_read)
            span = slice(start * length, stop * length)
            same = identical_pairs(tokens[span].reshape(-1, length), mask[span].reshape(-1, length))
            if same.any():
                row = first + start + 2 * int(same.nonzero()[0][0])
                raise OLMoDataError(
                    f"Instances {row} and {row + 1} of data.paths (a pair, in '{path}') are the same tokens and "
                    f"labels, {_OLD_PREPARATION}"
                )
            read += (stop - start) * length
            if read >= max_tokens:
                return


def identical_pairs(ids: Any, mask: Optional[Any] = None) -> Any:
    """(P,) whether each pair of rows ``2j``, ``2j + 1`` of ``ids`` (2P, T) (and of the label ``mask``, when given) is
    the same twice; numpy arrays or tensors."""
    same = (ids[0::2] == ids[1::2]).all(1)
    return same if mask is None else same & (mask[0::2] == mask[1::2]).all(1)


def _log_probs(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, inputs: dict[str, Any]
) -> torch.Tensor:
    """(B,) each row's summed log-probability of ``labels`` under ``model`` (:func:`sequence_log_probs` as its head)."""
    return model(input_ids, head=partial(sequence_log_probs, labels=labels), **inputs).loss


def _model_inputs(batch: dict[str, Any], rows: slice, max_doc_lens: Optional[list[int]]) -> dict[str, Any]:
    """The model's arguments besides the token ids for ``rows`` of a batch: documents and attention mask."""
    inputs: dict[str, Any] = {}
    if "doc_lens" in batch:
        inputs["doc_lens"] = batch["doc_lens"][rows]
        inputs["max_doc_lens"] = None if max_doc_lens is None else max_doc_lens[rows]
    if "attention_mask" in batch:
        inputs["attention_mask"] = batch["attention_mask"][rows]
    return inputs


def resolve_dpo_reference(
    dpo: DPOConfig, model: ModelConfig, launch: LaunchPlan, restore_dataloader: bool
) -> None:
    """Fix ``dpo.reference_path`` before anything is written (the run's and every checkpoint's ``config.yaml``
    then record it) and check that it opens with this run's model shape (:func:`resolve_reference`)."""
    if not dpo.enabled:
        return
    saved = continued_config(launch, restore_dataloader)
    recorded = saved.dpo.reference_path if saved is not None and saved.dpo.enabled else None
    dpo.reference_path = resolve_reference(
        "dpo.reference_path", dpo.reference_path, recorded, model, launch, "dpo.enabled=true"
    )


def continued_config(launch: LaunchPlan, restore_dataloader: bool) -> Optional[TrainConfig]:
    """The config of the checkpoint a launch continues (its trainer state, ``restore_dataloader``: the config's key),
    or None: a launch that starts a run, or a checkpoint not of ours (e.g. converted)."""
    from ..checkpoint.safe_reads import fetch

    plan = launch.restore
    if plan is None or not plan.load_trainer_state or not restore_dataloader:
        return None
    try:
        return TrainConfig.load_saved(fetch(plan.info.path, "config.yaml"), ["compile=null"])
    except (OLMoConfigurationError, OLMoCheckpointError, OSError):
        return None


def resolve_reference(
    key: str, given: Optional[str], recorded: Optional[str], model: ModelConfig, launch: LaunchPlan, needs: str
) -> str:
    """The frozen reference of a run (``key``, ``given`` by the config or None), checked to open with this run's
    model shape: a launch that continues a checkpoint keeps the reference its config ``recorded``
    (:func:`continued_config`; a different ``given`` is refused); any other launch uses ``given``, or else the
    checkpoint it starts from.

    :param needs: what needs the reference, for the error (``dpo.enabled=true``).
    :raises OLMoConfigurationError: when there is no reference, or it differs from the one the run trained with.
    :raises OLMoCheckpointError: naming ``key`` when it cannot be this run's reference.
    """
    from ..checkpoint.restore import preflight_reference

    plan = launch.restore
    if recorded is not None and plan is not None:
        if given is not None and given != recorded:
            raise OLMoConfigurationError(
                f"{key}={given!r}, but the checkpoint this launch continues ({plan.info.path}, step "
                f"{plan.info.step}) trained against the reference {recorded!r}: a different reference changes the "
                f"objective mid-run. Drop --{key} to keep the recorded one, or start a new run "
                f"(--reset_trainer_state, another save_folder)."
            )
        given = recorded
    if given is None and plan is not None:
        given = plan.info.path
    if given is None:
        raise OLMoConfigurationError(
            f"{needs} needs a reference model, and this launch starts from no checkpoint (save_folder holds none for "
            f"--try_load_latest_save). Start from the model to align with --load_path=CHECKPOINT "
            f"--reset_trainer_state, or name the reference with --{key}=CHECKPOINT."
        )
    preflight_reference(str(given), key, "the reference", model)
    log.info("Reference (%s): %s.", key, given)
    return str(given)
