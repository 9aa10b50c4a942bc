"""The RL step's pieces between sampling and the loss (issue 53): rewards built by name, groups scored, laid out,
and the policy's log-probabilities recomputed equal to the sampling ones (the logprob drift is float noise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from olmo.config import RLRewardConfig
from olmo.exceptions import OLMoConfigurationError, OLMoDataError
from olmo.model import OLMo
from olmo.rl import register_reward, registered_rewards
from olmo.rl.rollout import BuiltinRolloutEngine, Group
from olmo.rl.step import build_rewards, completion_logps, group_batch, score_group
from olmo.testing import tiny_model_config

VOCAB, EOS = 100, 0
PROMPT = torch.tensor([5, 17, 42, 9, 33])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return OLMo(tiny_model_config(max_sequence_length=32), init_params=True).train()


def _group(model, **overrides) -> Group:
    settings = dict(group_size=4, max_new_tokens=6, temperature=0.7, top_p=1.0, eos=EOS, seed=3, vocab_size=VOCAB)
    return BuiltinRolloutEngine(model, **{**settings, **overrides}).sample(PROMPT, prompt_index=2, step=5)


def test_recomputed_log_probabilities_equal_the_sampling_ones(model):
    group = _group(model, max_new_tokens=8)
    batch = group_batch(PROMPT, group, pad=EOS)
    model.eval()
    try:
        logps, entropy = completion_logps(model, batch, temperature=0.7, vocab_size=VOCAB)
        drift = ((logps.detach() - batch.old_logps).abs() * batch.completion_mask).max()
        assert drift < 1e-5  # train/rl/logprob_drift: the same model code samples and trains
        # The entropies are those of the tempered distributions over the real vocabulary.
        with torch.no_grad():
            logits = model(batch.input_ids).logits[:, batch.prompt_length - 1 : -1, :VOCAB].float() / 0.7
        expected = -(F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum(-1)
        torch.testing.assert_close(entropy, expected, rtol=1e-5, atol=1e-5)
    finally:
        model.train()
    assert logps.requires_grad  # the loss differentiates it


def test_a_group_is_laid_out_prompt_first_completions_right_padded(model):
    group = Group(
        0,
        [[7, 8, EOS], [9], [4, 4, 4, 4]],
        [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5]), torch.full((4,), -0.1)],
        [False, True, True],
    )
    batch = group_batch(PROMPT, group, pad=EOS)
    assert batch.input_ids.shape == (3, 5 + 4) and batch.prompt_length == 5
    assert (batch.input_ids[:, :5] == PROMPT).all()
    assert batch.completion_ids.tolist() == [[7, 8, EOS, EOS], [9, EOS, EOS, EOS], [4, 4, 4, 4]]
    assert batch.completion_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch.old_logps[0].tolist() == [-1.0, -2.0, -3.0, 0.0]
    masked = group_batch(PROMPT, group, pad=EOS, mask_truncated=True)
    assert masked.completion_mask.sum(1).tolist() == [3, 0, 0]  # truncated completions do not count


def test_rewards_are_built_by_name_and_summed_with_their_weights():
    group = Group(0, [[65, 66, EOS], [67, 68]], [torch.zeros(3), torch.zeros(2)], [False, True])
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    entries = [
        RLRewardConfig("exact_answer", 2.0),
        RLRewardConfig("format", 0.5, pattern="[A-Z]+"),
        RLRewardConfig("length", 1.0, max_tokens=2, buffer=0),
    ]
    scored = score_group(group, "Q", "AB", decode, build_rewards(entries), eos=EOS)
    # "AB" (its end token not decoded): right, all capitals, 3 tokens > 2; "CD": wrong, capitals, truncated at 2.
    assert scored.per_reward.tolist() == [[0.0, 1.0, -1.0], [0.0, 1.0, 0.0]]  # exact_answer wants a number or box
    assert scored.rewards.tolist() == [0.5 - 1.0, 0.5]
    boxed = Group(0, [[ord(c) for c in "\\boxed{7}"]], [torch.zeros(9)], [True])
    assert score_group(boxed, "Q", "7", decode, build_rewards(entries[:1]), eos=EOS).rewards.tolist() == [2.0]


def test_a_registered_reward_is_found_and_a_failing_one_is_named():
    with pytest.raises(OLMoConfigurationError, match=r"rl.rewards\[0\].name='mine' is not a built-in reward"):
        build_rewards([RLRewardConfig("mine")])
    group = Group(4, [[65]], [torch.zeros(1)], [True])
    try:
        register_reward("mine", lambda c: len(c.text))
        assert score_group(
            group, "Q", "x", lambda ids: "A", build_rewards([RLRewardConfig("mine")]), EOS
        ).rewards.tolist() == [1.0]
        registered_rewards()["mine"] = lambda c: 1 / 0
        with pytest.raises(
            OLMoDataError,
            match=r"The reward 'mine' failed on a completion of prompt p.jsonl:3 \(ZeroDivisionError",
        ):
            score_group(
                group, "Q", "x", lambda ids: "A", build_rewards([RLRewardConfig("mine")]), EOS, "p.jsonl:3"
            )
        registered_rewards()["mine"] = lambda c: float("nan")
        with pytest.raises(OLMoDataError, match="returned nan .* must return a finite number"):
            score_group(group, "Q", "x", lambda ids: "A", build_rewards([RLRewardConfig("mine")]), EOS)
    finally:
        registered_rewards().pop("mine", None)
