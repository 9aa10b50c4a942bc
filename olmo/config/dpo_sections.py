"""The ``dpo`` section: Direct Preference Optimization against a frozen reference model, with the checks of its
values against the rest of the run (``problems``). :class:`olmo.train.dpo.DPOTrainModule` trains it.

The data are pairs prepared by ``scripts/prepare_preference_data.py``: instance ``2i`` is pair ``i``'s chosen
conversation and ``2i + 1`` its rejected one, each labelled on its answer. The data order shuffles pairs and never
splits one (``global_indices.npy`` keeps each pair's two instances next to each other, and each rank trains whole
pairs), so every count of instances (``global_train_batch_size``, the device and micro-batches) must be even. The
label mask the script writes beside the tokens is required (``data.label_mask_paths``): it is what makes each side's
log-probability that of its answer alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..util import missing_slash_problem
from .sections import StrEnum

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = ["DPOConfig", "DPOLoss", "DPO_BETA_RANGE", "beta_problem"]

DPO_BETA_RANGE = (1e-4, 100.0)
"""The values ``dpo.beta`` (and ``eval_preferences.py --beta``) may take. Published runs use 0.01 to 10 (DPO 0.1,
IPO's tau 0.01 to 1, Tulu 3's length-normalized DPO 5); far outside, the loss saturates (a huge beta: ``beta * delta``
overflows or the sigmoid is flat, so the first step's loss is not finite or there is no gradient) or the pull toward
the reference vanishes (a tiny beta; IPO's target ``1 / (2 beta)`` overflows)."""


def beta_problem(beta: float, key: str) -> Optional[str]:
    """Why ``beta``, given as ``key``, cannot be DPO's beta, or None."""
    low, high = DPO_BETA_RANGE
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not low <= beta <= high:
        return (
            f"{key}={beta} must be a number in [{low:g}, {high:g}] (e.g. 0.1; Tulu 3 used 5 with loss norm): outside "
            f"it the loss overflows or saturates, or the pull toward the reference vanishes."
        )
    return None


class DPOLoss(StrEnum):
    """How a pair's log-probability ratios become its loss. With ``delta = (log pi(chosen) - log ref(chosen)) -
    (log pi(rejected) - log ref(rejected))``, each log-probability summed over the answer's labelled tokens:"""

    sigmoid = "sigmoid"
    """The DPO paper's ``-log sigmoid(beta * delta)``; with ``label_smoothing`` e, the conservative form
    ``-(1 - e) log sigmoid(beta * delta) - e log sigmoid(-beta * delta)`` (the preference label is wrong with
    probability e). TRL's ``sigmoid`` at e = 0."""
    ipo = "ipo"
    """IPO's squared loss ``(delta_avg - 1 / (2 beta))^2``, where ``delta_avg`` uses each answer's log-ratio divided
    by its number of labelled tokens (as TRL and the IPO authors do). ``label_smoothing`` must be 0."""
    norm = "norm"
    """Length-normalized DPO (Tulu 3's ``dpo_norm``, TRL's ``sigmoid_norm``): ``-log sigmoid(beta * delta_avg)``,
    each log-ratio divided by its answer's labelled tokens, so long answers do not dominate. Tulu 3 used beta 5.
    With ``label_smoothing`` e, smoothed as ``sigmoid``."""


@dataclass
class DPOConfig:
    """Direct Preference Optimization (``dpo.enabled``): each step lowers the loss of :class:`DPOLoss` over the global
    batch's pairs, comparing the policy with a frozen reference. Metrics ``train/dpo/loss`` (the mean loss over the
    batch's pairs, the one the step's gradient came from), ``train/dpo/rewards_chosen`` and
    ``train/dpo/rewards_rejected`` (means of ``beta * (log pi - log ref)`` summed over each answer),
    ``train/dpo/reward_accuracy`` (the fraction of pairs whose chosen reward is above the rejected one) and
    ``train/dpo/reward_margin`` (mean chosen minus rejected reward)."""

    enabled: bool = False
    """Train on preference pairs with the DPO loss instead of the cross entropy."""
    beta: float = 0.1
    """The strength of the pull toward the reference (DPO's beta; IPO's tau), in [1e-4, 100]
    (:data:`DPO_BETA_RANGE`)."""
    loss: DPOLoss = DPOLoss.sigmoid
    """``sigmoid`` (DPO), ``ipo`` or ``norm`` (length-normalized DPO, Tulu 3's)."""
    label_smoothing: float = 0.0
    """The probability that a pair's preference is wrong (conservative DPO); in [0, 0.5). 0: plain DPO."""
    precompute_reference: bool = False
    """Compute the reference's log-probability of every instance once, before the first step, into
    ``save_folder/train_data/dpo_reference_logps.npy`` (reused by a resume, and by a later run in the same folder
    while the reference and the data match its record: the data by content, each local file's SHA-256, read at every
    launch, and each remote file's size and version), then free the reference model: no reference in memory and no
    reference forward pass during training. False: the frozen model computes them on the fly, each step."""
    reference_path: Optional[str] = None
    """The checkpoint whose model, frozen, is the reference. Null: the model this run starts from (``load_path``),
    recorded here in the run's ``config.yaml`` and in every checkpoint's, so that a resume from any of them (even with
    ``--load_path`` naming a checkpoint of this run) keeps the same reference."""

    def problems(self, cfg: TrainConfig, world_size: int) -> list[str]:
        """One sentence per reason ``dpo`` cannot train ``cfg`` on ``world_size`` processes (none when disabled)."""
        if not self.enabled:
            return []
        out: list[str] = []
        problem = beta_problem(self.beta, "dpo.beta")
        if problem is not None:
            out.append(problem)
        if self.loss not in DPOLoss.__members__:
            out.append(f"dpo.loss={self.loss!r} is not a DPO loss; use sigmoid, ipo or norm.")
        if not (math.isfinite(self.label_smoothing) and 0 <= self.label_smoothing < 0.5):
            out.append(f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5) (0: plain DPO).")
        elif self.label_smoothing and self.loss == DPOLoss.ipo:
            out.append(
                f"dpo.label_smoothing={self.label_smoothing} has no meaning for loss ipo (a squared distance, not a "
                f"probability); set it to 0 or use loss sigmoid or norm."
            )
        if cfg.data.label_mask_paths is None and cfg.data.mixture is None:
            out.append(
                "dpo.enabled=true needs data.label_mask_paths: without a label mask every token (the prompt, the role "
                "headers, the padding) counts in each answer's log-probability, so the loss, its length "
                "normalization and the rewards are wrong. scripts/prepare_preference_data.py writes the mask beside "
                "the tokens: pass --data.label_mask_paths=[DIR/label_mask.npy] with --data.paths=[DIR/input_ids.npy]."
            )
        problem = missing_slash_problem(self.reference_path, "dpo.reference_path")
        if problem is not None:
            out.append(problem)
        if self.reference_path is None and cfg.load_path is None and not cfg.try_load_latest_save:
            out.append(
                "dpo.enabled=true needs a reference model: start from the model to align (--load_path=CHECKPOINT "
                "--reset_trainer_state, e.g. the SFT run's last checkpoint), whose frozen copy is then the reference, "
                "or name the reference with --dpo.reference_path=CHECKPOINT."
            )
        dp = max(cfg.data_parallel_size(world_size), 1)
        micro = cfg.device_train_microbatch_size
        if cfg.global_train_batch_size % 2 or micro % 2 or (cfg.global_train_batch_size // dp) % 2:
            out.append(
                f"dpo.enabled=true trains whole pairs (a chosen and a rejected instance), so global_train_batch_size "
                f"({cfg.global_train_batch_size}), its share per data-parallel rank ({cfg.global_train_batch_size} / "
                f"{dp}) and device_train_microbatch_size ({micro}) must all be even; e.g. "
                f"--global_train_batch_size={2 * dp * max(micro + micro % 2, 2)} "
                f"--device_train_microbatch_size={max(micro + micro % 2, 2)}."
            )
        refused = {  # key: (whether the run sets it, why DPO cannot use it yet)
            "stages": (
                bool(cfg.stages),
                "a staged run changes data and objectives mid-run; train DPO as its own run",
            ),
            "data.mixture": (cfg.data.mixture is not None, "a mixture draws instances, not the prepared pairs"),
            "data.instance_filter": (
                cfg.data.instance_filter is not None,
                "the filter would drop one half of a pair",
            ),
            "model.moe": (
                cfg.model.moe is not None,
                "the experts' auxiliary losses are not added to the DPO loss yet",
            ),
            "context_parallel.degree": (
                cfg.context_parallel.degree > 1,
                "a pair's log-probabilities would be split over the group",
            ),
            "softmax_auxiliary_loss": (
                bool(cfg.softmax_auxiliary_loss),
                "the z-loss is not part of the DPO objective",
            ),
        }
        for key, (on, why) in refused.items():
            if on:
                out.append(f"dpo.enabled=true cannot be combined with {key} ({why}); remove {key}.")
        return out
