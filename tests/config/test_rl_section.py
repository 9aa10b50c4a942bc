"""The ``rl`` section (issue 53's contract): TRL GRPOConfig's defaults, every absurd value named with its key, and
an enabled run refused before any work while the training step is being built."""

from __future__ import annotations

import re

import pytest

from olmo.config import RLLoss, RLScaleRewards, TrainConfig
from olmo.config.rl_sections import BUILTIN_REWARDS
from olmo.config.validation import config_problems
from olmo.rl.loss import LOSSES, SCALES
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
        ("rl.max_new_tokens=0", r"rl.max_new_tokens=0 must be a whole number >= 1"),
        ("rl.prompts_per_step=3", r"= 24 completions per step must be a whole number of optimizer steps"),
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
    assert not any("not yet the training step" in p for p in problems)  # the real problem, not the generic one


def test_an_enabled_run_is_refused_naming_what_exists_until_the_step_lands():
    (problem,) = _problems()
    assert (
        "rl.enabled=true" in problem
        and "scripts/prepare_rl_prompts.py" in problem
        and "rl.enabled=false" in problem
    )
