"""Our RL numbers against TRL 1.16.0's GRPOTrainer (issue 53, point 3): for fixed prompts, completions, sampling and
"old" log-probabilities and rewards, the advantages, the loss of each loss type and the KL, entropy and clip-fraction
metrics equal those TRL computed with its own code in its own virtualenv (tests/fixtures/trl_grpo/make_fixture.sh),
on the same models imported from transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from olmo.cli.convert_from_hf import convert_from_hf
from olmo.model import OLMo
from olmo.rl.policy_loss import LOSSES, group_advantages, reduce_losses, token_losses
from olmo.rl.rollout import Group
from olmo.rl.step import completion_logps, group_batch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trl_grpo"
MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "trl_dpo"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_grpo")
    out = {}
    for name in ("policy", "reference"):
        convert_from_hf(str(MODELS / f"hf-{name}"), str(root / name))
        out[name] = OLMo.from_checkpoint(str(root / name))
    return out


@pytest.mark.parametrize("loss", LOSSES)
def test_advantages_losses_and_metrics_equal_trls(models, loss):
    inputs = json.loads((FIXTURE / "inputs.json").read_text())
    trl = json.loads((FIXTURE / "trl_values.json").read_text())
    expected = trl["losses"][loss]
    G, T, vocab = inputs["group_size"], inputs["temperature"], inputs["vocab_size"]
    rewards = torch.tensor(inputs["rewards"])
    advantages, _ = group_advantages(rewards, G, "group")
    torch.testing.assert_close(advantages, torch.tensor(expected["advantages"]), rtol=0, atol=1e-6)

    policy, reference = models["policy"].train(), models["reference"].eval()
    numerators, denominators, sums = [], [], torch.zeros(4, dtype=torch.float64)  # kl, entropy, clipped, tokens
    for i, prompt in enumerate(inputs["prompt_ids"]):
        rows = slice(G * i, G * (i + 1))
        old = [torch.tensor(lp) for lp in inputs["old_logps"][rows]]
        group = Group(i, inputs["completions"][rows], old, inputs["truncated"][rows])
        batch = group_batch(torch.tensor(prompt), group, pad=inputs["eos"])
        logps, entropy = completion_logps(policy, batch, T, vocab)
        with torch.no_grad():
            ref_logps, _ = completion_logps(reference, batch, T, vocab)
        out = token_losses(
            logps,
            batch.old_logps,
            advantages[rows],
            loss=loss,
            epsilon_low=trl["epsilon_low"],
            epsilon_high=expected["epsilon_high"],
            beta=trl["beta"],
            ref_logps=ref_logps,
        )
        numerator, denominator = reduce_losses(out.loss, batch.completion_mask, loss, inputs["max_new_tokens"])
        numerators.append(numerator)
        denominators.append(denominator)
        mask = batch.completion_mask.double()
        assert out.kl is not None
        for k, value in enumerate((out.kl.detach(), entropy, out.clipped)):
            sums[k] += (value.double() * mask).sum()
        sums[3] += mask.sum()
    value = sum(numerators) / sum(denominators).clamp(min=1.0)
    assert value.item() == pytest.approx(expected["loss"], abs=1e-5)
    kl, entropy, clipped = (sums[:3] / sums[3]).tolist()
    assert kl == pytest.approx(expected["kl"], abs=1e-5)
    assert entropy == pytest.approx(expected["entropy"], abs=1e-5)
    assert clipped == pytest.approx(expected["clip_fraction"], abs=1e-6)
    assert 0 < clipped < 1  # the fixture's old log-probabilities make some ratios clip, not all
    value.backward()  # a loss one can train on


def test_the_fixture_was_computed_by_trl_on_completions_of_different_lengths():
    trl = json.loads((FIXTURE / "trl_values.json").read_text())
    inputs = json.loads((FIXTURE / "inputs.json").read_text())
    assert trl["versions"]["trl"] == "1.16.0"
    assert len({len(c) for c in inputs["completions"]}) > 3  # grpo, dr_grpo and dapo average differently
    assert len({round(v["loss"], 6) for v in trl["losses"].values()}) == len(LOSSES)
