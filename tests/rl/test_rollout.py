"""The built-in rollout engine (issue 53): each completion's tokens come from its own seeded stream, its recorded
log-probabilities are those the training step recomputes, the sampler draws from the nucleus it states, and
completions stop at the end token or are marked truncated."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from olmo.model import OLMo
from olmo.rl.rollout import BuiltinRolloutEngine, sample_token, stream_seed
from olmo.testing import tiny_model_config

VOCAB = 100


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = OLMo(tiny_model_config(max_sequence_length=32, residual_dropout=0.1), init_params=True)
    return model.train()  # the engine turns dropout off itself, and back on


def _engine(model, **overrides):
    settings = dict(group_size=4, max_new_tokens=8, temperature=1.0, top_p=1.0, eos=0, seed=7, vocab_size=VOCAB)
    return BuiltinRolloutEngine(model, **{**settings, **overrides})


PROMPT = torch.tensor([5, 17, 42, 9, 33])


def test_a_completion_depends_on_the_seed_step_prompt_and_its_index_only(model):
    engine = _engine(model)
    group = engine.sample(PROMPT, prompt_index=3, step=11)
    engine.sample(torch.tensor([1, 2, 3]), prompt_index=0, step=11)  # other work in between changes nothing
    assert engine.sample(PROMPT, prompt_index=3, step=11).tokens == group.tokens
    assert _engine(model, group_size=2).sample(PROMPT, 3, 11).tokens == group.tokens[:2]  # a smaller group
    assert len({tuple(t) for t in group.tokens}) > 1  # the group's completions differ
    assert engine.sample(PROMPT, prompt_index=3, step=12).tokens != group.tokens
    assert engine.sample(PROMPT, prompt_index=4, step=11).tokens != group.tokens
    assert _engine(model, seed=8).sample(PROMPT, 3, 11).tokens != group.tokens
    assert model.training


def test_sampling_log_probabilities_are_what_the_training_forward_computes(model):
    """The drift the trainer reports (its recomputed log-probabilities against these) is float noise here."""
    group = _engine(model, temperature=0.7).sample(PROMPT, prompt_index=0, step=0)
    model.eval()
    try:
        for tokens, logps in zip(group.tokens, group.logps):
            ids = torch.cat([PROMPT, torch.tensor(tokens)]).unsqueeze(0)
            with torch.no_grad():
                logits = model(ids).logits[0, len(PROMPT) - 1 : -1, :VOCAB].float() / 0.7
            recomputed = F.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(logps, recomputed, rtol=0, atol=1e-5)
    finally:
        model.train()


def test_a_low_temperature_samples_the_greedy_continuation(model):
    group = _engine(model, temperature=1e-4, group_size=2).sample(PROMPT, 0, 0)
    model.eval()
    try:
        with torch.no_grad():
            greedy = model.generate(PROMPT.unsqueeze(0), max_steps=8).token_ids[0, 0].tolist()  # ends at id 0
    finally:
        model.train()
    expected = greedy[: greedy.index(0) + 1] if 0 in greedy else greedy
    # Padding rows of the embedding (ids >= vocab_size) are never sampled; the tiny model's greedy stays below it.
    assert all(t < VOCAB for t in greedy)
    assert group.tokens == [expected, expected]


def test_completions_end_at_the_end_token_or_are_truncated(model):
    group = _engine(model, max_new_tokens=3, group_size=8).sample(PROMPT, 0, 0)
    for tokens, logps, truncated in zip(group.tokens, group.logps, group.truncated):
        assert len(tokens) == len(logps) <= 3
        assert truncated == (tokens[-1] != 0) and (truncated or 0 not in tokens[:-1])
        assert truncated or len(tokens) <= 3
    # An end token as likely as all else: some completions end early, and the tokens after the end are not kept.
    eos_model = _engine(model, eos=int(group.tokens[0][0]), max_new_tokens=5).sample(PROMPT, 0, 0)
    assert eos_model.tokens[0] == [group.tokens[0][0]] and eos_model.truncated[0] is False


def test_the_sampler_draws_each_token_with_its_probability_within_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    generator = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(
        torch.tensor([sample_token(probs.log(), 1.0, generator) for _ in range(n)]), minlength=4
    )
    # Each frequency within 5 standard deviations of its probability.
    for p, c in zip(probs.tolist(), counts.tolist()):
        assert abs(c / n - p) < 5 * math.sqrt(p * (1 - p) / n)
    # top_p 0.7: the nucleus is {0.5, 0.3} (0.5 < 0.7 before the second; 0.8 >= 0.7 before the third), renormalised.
    counts = torch.bincount(
        torch.tensor([sample_token(probs.log(), 0.7, generator) for _ in range(n)]), minlength=4
    )
    assert counts[2:].sum() == 0
    assert abs(counts[0] / n - 0.5 / 0.8) < 5 * math.sqrt(0.625 * 0.375 / n)


def test_stream_seeds_differ_by_every_part_and_fit_a_generator():
    seeds = {stream_seed(*key) for key in [(1, 2, 3, 4), (2, 2, 3, 4), (1, 3, 3, 4), (1, 2, 4, 4), (1, 2, 3, 5)]}
    assert len(seeds) == 5 and all(0 <= s < 2**63 for s in seeds)
    torch.Generator().manual_seed(max(seeds))
