"""The ``rl`` section: reinforcement learning with verifiable rewards (GRPO and its kin, issue 53), with the checks
of its values (``problems``). Defaults are TRL's ``GRPOConfig``'s where it has the same knob.

Each step samples ``group_size`` completions for each of ``prompts_per_step`` prompts of ``rl.prompts`` (a folder
of ``scripts/prepare_rl_prompts.py``, whose instances are the run's data: :func:`apply_rl_run_settings`), scores them
with ``rewards``, and trains on them in ``num_iterations x num_mini_batches`` optimizer steps with the policy loss
``loss`` (:mod:`olmo.rl.policy_loss`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..util import missing_slash_problem
from .sections import StrEnum

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = ["RLConfig", "RLLoss", "RLRewardConfig", "RLScaleRewards", "BUILTIN_REWARDS", "apply_rl_run_settings"]

BUILTIN_REWARDS = ("exact_answer", "format", "length")
"""The rewards a config names without registering them (``olmo.rl.rewards``)."""
_REWARD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


class RLLoss(StrEnum):
    """The policy loss (TRL's ``loss_type``; :mod:`olmo.rl.policy_loss` gives each formula)."""

    grpo = "grpo"
    """PPO's clipped objective, averaged over each completion's tokens, then over completions."""
    dr_grpo = "dr_grpo"
    """The clipped objective summed and divided by completions x ``max_new_tokens`` (Dr. GRPO: no length bias)."""
    dapo = "dapo"
    """The clipped objective averaged over every token of the step (DAPO's token-level loss; TRL's default)."""
    cispo = "cispo"
    """CISPO: ``-sg(min(r, epsilon_high)) A log p``; every token keeps its gradient (``epsilon_high`` ~5)."""


class RLScaleRewards(StrEnum):
    """What divides a completion's reward minus its group's mean (TRL's ``scale_rewards``)."""

    group = "group"
    """The group's standard deviation (GRPO)."""
    batch = "batch"
    """The step's standard deviation over all completions."""
    none = "none"
    """Nothing (Dr. GRPO)."""


@dataclass
class RLRewardConfig:
    """One reward and its weight in the sum that is each completion's reward; each is logged as
    ``train/rl/rewards/NAME``."""

    name: str = "exact_answer"
    """``exact_answer``, ``format``, ``length``, or a name registered from Python (``olmo.rl.register_reward``)."""
    weight: float = 1.0
    """Its weight in the sum (negative: a penalty)."""
    pattern: Optional[str] = None
    """``format``: the regular expression a whole completion must match."""
    max_tokens: Optional[int] = None
    """``length``: the completion length (tokens) at which the penalty reaches -1."""
    buffer: int = 0
    """``length``: the penalty grows linearly over the last ``buffer`` tokens before ``max_tokens``."""


@dataclass
class RLConfig:
    """Reinforcement learning with verifiable rewards (``rl.enabled``)."""

    enabled: bool = False
    """Train with RL: sample, score and train on completions of ``prompts`` each step."""
    prompts: Optional[str] = None
    """The folder ``scripts/prepare_rl_prompts.py`` wrote (prompts and ground truths)."""
    loss: RLLoss = RLLoss.dapo
    """The policy loss: ``grpo``, ``dr_grpo``, ``dapo`` (TRL's default) or ``cispo``."""
    group_size: int = 8
    """Completions sampled per prompt (TRL's ``num_generations``); at least 2."""
    prompts_per_step: int = 8
    """Prompts sampled each step (an RL run's ``global_train_batch_size``, which counts instances: prompts); their
    ``prompts_per_step x group_size`` completions are trained in ``num_iterations x num_mini_batches`` optimizer
    steps."""
    num_mini_batches: int = 1
    """Optimizer steps each pass over the step's completions takes (open-instruct's ``num_mini_batches``; OLMo 3
    Instruct's RL: 4): the prompts are split into this many equal parts, in data order, each trained and stepped on
    alone (its loss normalised over its own completions); the later parts' ratios leave 1 as the policy moves.
    ``prompts_per_step`` must divide evenly by ranks x ``num_mini_batches``."""
    num_iterations: int = 1
    """Passes over each step's completions (TRL's ``num_iterations``, GRPO's mu), each of ``num_mini_batches``
    optimizer steps: 1 x 1 is on-policy; after the first optimizer step the ratio to the sampling log-probabilities
    leaves 1 and the clip acts. The learning rate is the step's for each of them; the step's metrics average over
    them (``logprob_drift``: the first optimizer step's completions, before any update)."""
    max_new_tokens: int = 512
    """The longest completion (TRL's ``max_completion_length``); longer ones are cut and marked truncated."""
    temperature: float = 1.0
    """Sampling temperature (the logits are divided by it when sampling and when training)."""
    top_p: float = 1.0
    """Sample from the nucleus of this probability (1.0: the whole distribution)."""
    beta: float = 0.0
    """The weight of the KL penalty to the reference; 0 needs no reference model (TRL's default)."""
    epsilon_low: float = 0.2
    """The ratio's lower clip is ``1 - epsilon_low`` (TRL's ``epsilon``)."""
    epsilon_high: Optional[float] = None
    """The ratio's upper clip is ``1 + epsilon_high`` (null: ``epsilon_low``; DAPO uses 0.28); for ``cispo`` the
    largest ratio itself (ScaleRL: 5)."""
    scale_rewards: RLScaleRewards = RLScaleRewards.group
    """What divides the advantages: the ``group``'s reward standard deviation, the ``batch``'s, or ``none``."""
    mask_truncated_completions: bool = False
    """Truncated completions do not count in the loss (DAPO's overlong filtering)."""
    reference_path: Optional[str] = None
    """With ``beta > 0``: the checkpoint whose frozen model is the reference. Null: the model the run starts from
    (``load_path``), recorded here in the run's ``config.yaml`` and in every checkpoint's, so a resume keeps it."""
    rewards: list[RLRewardConfig] = field(default_factory=lambda: [RLRewardConfig()])
    """The rewards whose weighted sum scores each completion (default: ``exact_answer`` alone)."""

    @property
    def upper_clip(self) -> float:
        """``epsilon_high``, or ``epsilon_low`` when it is not set."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    def problems(self, cfg: TrainConfig, world_size: int = 1) -> list[str]:
        """One sentence per reason ``rl`` cannot train ``cfg`` on ``world_size`` ranks (none when disabled)."""
        if not self.enabled:
            return []
        out: list[str] = []
        if self.prompts is None:
            out.append(
                "rl.enabled=true needs rl.prompts: the folder scripts/prepare_rl_prompts.py INPUT.jsonl -o DIR wrote."
            )
        out += _slash(self.prompts, "rl.prompts") + _slash(self.reference_path, "rl.reference_path")
        if self.loss not in RLLoss.__members__:
            out.append(f"rl.loss={self.loss!r} is not an RL loss; use grpo, dr_grpo, dapo or cispo.")
        if self.scale_rewards not in RLScaleRewards.__members__:
            out.append(f"rl.scale_rewards={self.scale_rewards!r} must be group, batch or none.")
        for key, value, low in (
            ("group_size", self.group_size, 2),
            ("prompts_per_step", self.prompts_per_step, 1),
            ("num_iterations", self.num_iterations, 1),
            ("num_mini_batches", self.num_mini_batches, 1),
            ("max_new_tokens", self.max_new_tokens, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                out.append(f"rl.{key}={value!r} must be a whole number >= {low}.")
        P, M = self.prompts_per_step, self.num_mini_batches
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (P, M)) and P % (world_size * M):
            out.append(
                f"rl.prompts_per_step={P} does not split into rl.num_mini_batches={M} equal parts on each of "
                f"{world_size} rank(s) (it must be a multiple of {world_size * M}); change one of them."
            )
        if not (_finite(self.temperature) and self.temperature > 0):
            out.append(
                f"rl.temperature={self.temperature} must be a positive number (1.0 samples the model as it is)."
            )
        if not (_finite(self.top_p) and 0 < self.top_p <= 1):
            out.append(f"rl.top_p={self.top_p} must be in (0, 1] (1.0: no nucleus cut).")
        if not (_finite(self.beta) and self.beta >= 0):
            out.append(f"rl.beta={self.beta} must be a number >= 0 (0: no KL penalty, no reference model).")
        if not (_finite(self.epsilon_low) and 0 <= self.epsilon_low < 1):
            out.append(f"rl.epsilon_low={self.epsilon_low} must be in [0, 1) (the ratio's lower clip is 1 - it).")
        if self.epsilon_high is not None and not (_finite(self.epsilon_high) and self.epsilon_high > 0):
            out.append(f"rl.epsilon_high={self.epsilon_high} must be a positive number, or null (epsilon_low).")
        elif self.loss == RLLoss.cispo and self.upper_clip < 1:
            out.append(
                f"rl.loss=cispo caps the ratio itself at epsilon_high ({self.upper_clip}), which below 1 shrinks every "
                f"on-policy token's gradient; set rl.epsilon_high (ScaleRL uses 5.0)."
            )
        out += self._reward_problems()
        if (
            self.beta > 0
            and self.reference_path is None
            and cfg.load_path is None
            and not cfg.try_load_latest_save
        ):
            out.append(
                f"rl.beta={self.beta} pulls the policy toward a reference model: start from the model to train "
                f"(--load_path=CHECKPOINT --reset_trainer_state, e.g. the SFT checkpoint), whose frozen copy is then "
                f"the reference, or name it with --rl.reference_path=CHECKPOINT; or set rl.beta=0 (TRL's default)."
            )
        refused = {  # key: (whether the run sets it, why the RL step cannot use it yet)
            "dpo.enabled": (cfg.dpo.enabled, "one objective per run"),
            "stages": (bool(cfg.stages), "the prompts are one data segment; train RL as its own run"),
            "data.mixture": (cfg.data.mixture is not None, "the prompts are rl.prompts' own"),
            "data.instance_filter": (
                cfg.data.instance_filter is not None,
                "it reads token instances, not prompts",
            ),
            "data.generate_doc_lengths": (cfg.data.generate_doc_lengths, "each prompt is one instance"),
            "context_parallel.degree": (cfg.context_parallel.degree > 1, "sampling does not split sequences"),
            "tensor_parallel.degree": (cfg.tensor_parallel.degree > 1, "sampling runs each rank's prompts alone"),
            "model.moe": (cfg.model.moe is not None, "the experts' auxiliary losses are not in the RL loss yet"),
            "stability.skip_spikes": (cfg.stability.skip_spikes.enabled, "it watches the cross entropy"),
            "softmax_auxiliary_loss": (bool(cfg.softmax_auxiliary_loss), "the z-loss is not part of the RL loss"),
            "scheduler.units": (cfg.scheduler.units == "tokens", "an RL step's tokens are its completions'"),
        }
        for key, (on, why) in refused.items():
            if on:
                out.append(f"rl.enabled=true cannot be combined with {key} ({why}); remove {key}.")
        return out

    def _reward_problems(self) -> list[str]:
        if not self.rewards:
            return ["rl.rewards is empty: name at least one reward, e.g. [{name: exact_answer, weight: 1.0}]."]
        out: list[str] = []
        names = [r.name for r in self.rewards]
        for i, reward in enumerate(self.rewards):
            key = f"rl.rewards[{i}]"
            if not isinstance(reward.name, str) or not _REWARD_NAME.fullmatch(reward.name):
                out.append(f"{key}.name={reward.name!r} is not a reward name (letters, digits, '_', '.', '-').")
            elif names.count(reward.name) > 1 and names.index(reward.name) == i:
                out.append(f"rl.rewards names {reward.name} twice; give it once, with the sum of the weights.")
            if not _finite(reward.weight):
                out.append(f"{key}.weight={reward.weight} must be a finite number.")
            if reward.name == "format":
                if not reward.pattern:
                    out.append(
                        f"{key} (format) needs pattern: the regular expression a whole completion must match."
                    )
                else:
                    try:
                        re.compile(reward.pattern, re.DOTALL)
                    except re.error as e:
                        out.append(
                            f"{key}.pattern={reward.pattern!r} is not a regular expression Python can compile ({e})."
                        )
            elif reward.pattern is not None:
                out.append(f"{key}.pattern is only read by the format reward; remove it from {reward.name}.")
            if reward.name == "length":
                m, b = reward.max_tokens, reward.buffer
                if not (isinstance(m, int) and isinstance(b, int) and 0 <= b < m):
                    out.append(
                        f"{key} (length) needs max_tokens and buffer with 0 <= buffer < max_tokens (got max_tokens="
                        f"{m}, buffer={b}); e.g. max_tokens: 512, buffer: 128."
                    )
            elif reward.max_tokens is not None or reward.buffer:
                out.append(f"{key}.max_tokens and buffer are only read by the length reward; remove them.")
        return out


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _slash(path: Optional[str], key: str) -> list[str]:
    problem = missing_slash_problem(path, key)
    return [] if problem is None else [problem]


def apply_rl_run_settings(cfg: TrainConfig) -> list[str]:
    """With ``rl.enabled``, the settings an RL run derives from its section, set in ``cfg`` (before it is checked):
    its data are the prompts' instances (``rl.prompts/input_ids.npy``, no label mask), each step's batch is
    ``rl.prompts_per_step`` of them (``global_train_batch_size`` counts prompts; each brings ``rl.group_size``
    completions), and each forward and backward is one prompt's group (``device_train_microbatch_size`` 1). Returns
    one line per value changed, for the log."""
    if not cfg.rl.enabled or cfg.rl.prompts is None:
        return []
    changed = []
    paths = [str(Path(cfg.rl.prompts) / "input_ids.npy")]
    if cfg.data.paths != paths:
        changed.append(f"data.paths={paths} (the prompts of rl.prompts, one instance each)")
        cfg.data.paths = paths
    if cfg.data.label_mask_paths is not None:
        changed.append("data.label_mask_paths=null (an RL run trains on its sampled completions)")
        cfg.data.label_mask_paths = None
    if isinstance(cfg.rl.prompts_per_step, int) and cfg.global_train_batch_size != cfg.rl.prompts_per_step:
        changed.append(
            f"global_train_batch_size={cfg.rl.prompts_per_step} (rl.prompts_per_step: prompts per step)"
        )
        cfg.global_train_batch_size = cfg.rl.prompts_per_step
    if cfg.device_train_microbatch_size != 1:
        changed.append("device_train_microbatch_size=1 (each forward and backward is one prompt's group)")
        cfg.device_train_microbatch_size = 1
    return changed
