"""The ``rl`` section (issue 53's contract): TRL GRPOConfig's defaults, every absurd value named with its key, what
the RL step cannot be combined with yet, and the data and batch an RL run takes from its section."""

from __future__ import annotations

import re

import pytest

from olmo.config import RLLoss, RLScaleRewards, TrainConfig
from olmo.config.rl_sections import BUILTIN_REWARDS, apply_rl_run_settings
from olmo.config.validation import config_problems
from olmo.rl.policy_loss import LOSSES, SCALES
from olmo.rl.rewards import BUILTIN_REWARDS as REWARDS_OF_OLMO_RL

TINY = "configs/tiny/OLMo-tiny.yaml"


def _problems(*overrides: str) -> list[str]:
    cfg = TrainConfig.load(
        TINY, ["rl.enabled=true", "rl.prompts=prompts/", "global_train_batch_size=64", *overrides]
    )
    return [p for p in config_problems(cfg, 1) if p.startswith("rl")]


def test_defaults_are_trls_and_the_names_match_the_code():
    rl = TrainConfig.load(TINY).rl
    assert not rl.enabled and rl.loss == RLLoss.dapo and rl.scale_rewards == RLScaleRewards.group
    assert (rl.group_size, rl.max_new_tokens, rl.temperature, rl.top_p, rl.beta) == (8, 512, 1.0, 1.0, 0.0)
    assert (rl.epsilon_low, rl.upper_clip, rl.mask_truncated_completions) == (0.2, 0.2, False)
    assert rl.num_iterations == 1
    assert [(r.name, r.weight) for r in rl.rewards] == [("exact_answer", 1.0)]
    assert set(RLLoss.__members__) == set(LOSSES) and set(RLScaleRewards.__members__) == set(SCALES)
    assert BUILTIN_REWARDS == REWARDS_OF_OLMO_RL
    assert not config_problems(TrainConfig.load(TINY), 1)  # off: nothing to check


@pytest.mark.parametrize(
    "override, message",
    [
        ("rl.prompts=null", "rl.enabled=true needs rl.prompts"),
        ("rl.group_size=1", r"rl.group_size=1 must be a whole number >= 2"),
        ("rl.prompts_per_step=0", r"rl.prompts_per_step=0 must be a whole number >= 1"),
        ("rl.num_iterations=0", r"rl.num_iterations=0 must be a whole number >= 1"),
        ("rl.num_mini_batches=0", r"rl.num_mini_batches=0 must be a whole number >= 1"),
        ("rl.num_mini_batches=3", r"rl.prompts_per_step=8 does not split into rl.num_mini_batches=3 equal parts"),
        ("rl.max_new_tokens=0", r"rl.max_new_tokens=0 must be a whole number >= 1"),
        ("rl.beta=0.1", "rl.beta=0.1 pulls the policy toward a reference model: start from the model to train"),
        ("dpo.enabled=true", r"rl.enabled=true cannot be combined with dpo.enabled \(one objective per run\)"),
        ("tensor_parallel.degree=2", "cannot be combined with tensor_parallel.degree"),
        ("scheduler.units=tokens", "cannot be combined with scheduler.units"),
        ("rl.temperature=0", "rl.temperature=0.0 must be a positive number"),
        ("rl.top_p=1.5", r"rl.top_p=1.5 must be in \(0, 1\]"),
        ("rl.beta=-0.1", "rl.beta=-0.1 must be a number >= 0"),
        ("rl.epsilon_low=1", r"rl.epsilon_low=1.0 must be in \[0, 1\)"),
        ("rl.epsilon_high=0", "rl.epsilon_high=0.0 must be a positive number"),
        ("rl.loss=cispo", "rl.loss=cispo caps the ratio itself at epsilon_high"),
        ("rl.rewards=[]", "rl.rewards is empty"),
        ("rl.rewards=[{name: 'has space'}]", "is not a reward name"),
        ("rl.rewards=[{name: format}]", r"rl.rewards\[0\] \(format\) needs pattern"),
        ("rl.rewards=[{name: format, pattern: '(x'}]", "is not a regular expression"),
        ("rl.rewards=[{name: length, max_tokens: 8, buffer: 8}]", r"needs max_tokens and buffer with 0 <= buffer"),
        ("rl.rewards=[{name: exact_answer, pattern: x}]", "pattern is only read by the format reward"),
        ("rl.rewards=[{name: exact_answer}, {name: exact_answer}]", "names exact_answer twice"),
        ("rl.rewards=[{name: exact_answer, weight: .nan}]", "weight=nan must be a finite number"),
    ],
)
def test_each_absurd_value_is_named_with_its_key(override, message):
    problems = _problems(override)
    assert any(re.search(message, p) for p in problems), problems


def test_an_rl_run_takes_its_data_and_batch_from_its_section():
    cfg = TrainConfig.load(TINY, ["rl.enabled=true", "rl.prompts=prompts/", "rl.prompts_per_step=6"])
    changes = apply_rl_run_settings(cfg)
    assert cfg.data.paths == ["prompts/input_ids.npy"] and cfg.data.label_mask_paths is None
    assert cfg.global_train_batch_size == 6 and cfg.device_train_microbatch_size == 1
    assert len(changes) == 3 and all(isinstance(line, str) for line in changes)
    assert apply_rl_run_settings(cfg) == []  # applied once: nothing left to change
    assert not [p for p in config_problems(cfg, 1) if p.startswith("rl")]  # a valid RL run
    off = TrainConfig.load(TINY)
    assert apply_rl_run_settings(off) == [] and off.global_train_batch_size != 6
