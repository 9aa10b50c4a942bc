"""Incremental decoding: the KV cache against the full forward on every architecture the model supports (prefill,
one token at a time, several tokens after a cache, left-padded batches), and ``OLMo.generate`` (greedy against a
loop of full forwards, beam search and sampling against the sequences' recomputed log-probabilities)."""

import pytest
import torch
import torch.nn.functional as F

from olmo.beam_search import (
    GumbelSampler,
    LengthNormalizedSequenceLogProbabilityScorer,
    RepeatedNGramBlockingConstraint,
    TopKSampler,
)
from olmo.config import ActivationType, LayerNormType
from olmo.model import OLMo, OLMoGenerateOutput
from olmo.model.generation import build_sampler
from olmo.testing import tiny_model_config

VOCAB = 100
ARCHITECTURES = {
    "rope": {},
    "alibi": dict(rope=False, alibi=True),
    "learned-positions": dict(rope=False, max_sequence_length=64),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "qk-norm-clip": dict(attention_layer_norm=True, clip_qkv=8.0, layer_norm_type=LayerNormType.rms),
    "olmo2-norm-after": dict(
        norm_after=True, attention_layer_norm=True, layer_norm_type=LayerNormType.rms, weight_tying=False
    ),
    "gelu-bias-scaled": dict(
        activation_type=ActivationType.gelu, include_bias=True, scale_logits=True, embedding_layer_norm=True
    ),
}


def build(seed: int = 0, **overrides) -> OLMo:
    torch.manual_seed(seed)
    fields = {"vocab_size": VOCAB, "max_sequence_length": 64, **overrides}
    return OLMo(tiny_model_config(**fields)).eval()


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_cache_gives_the_full_forwards_logits(arch):
    model = build(**ARCHITECTURES[arch])
    tokens = ids(2, 12)
    with torch.no_grad():
        full = model(tokens).logits  # (2, 12, V)
        out = model(tokens[:, :5], use_cache=True)
        assert torch.allclose(out.logits, full[:, :5], atol=1e-5, rtol=0)
        cache, pieces = out.attn_key_values, [out.logits]
        assert len(cache) == 2 and cache[0][0].shape == (2, model.config.effective_n_kv_heads, 5, 8)
        for t in range(5, 9):  # one token at a time
            out = model(tokens[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.attn_key_values
            pieces.append(out.logits)
        out = model(tokens[:, 9:], past_key_values=cache, use_cache=True)  # several tokens after a cache
        pieces.append(out.logits)
        assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)
        assert out.attn_key_values[1][1].shape[-2] == 12
        last = model(tokens[:, 9:], past_key_values=cache[:], last_logits_only=True)
        assert last.logits.shape == (2, 1, model.config.effective_embedding_size) and last.attn_key_values is None
        assert torch.allclose(last.logits[:, 0], full[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["rope", "alibi", "gqa", "olmo2-norm-after"])
def test_a_left_padded_prompt_continues_as_it_would_alone(arch):
    """Relative positions: padding on the left, hidden by the mask, changes nothing (prefill or cached)."""
    model = build(**ARCHITECTURES[arch])
    short, long = ids(1, 6, seed=2), ids(1, 10, seed=3)
    batch = torch.cat((torch.zeros(1, 4, dtype=torch.long), short), dim=1)
    batch = torch.cat((batch, long))  # (2, 10): the short prompt left-padded
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    with torch.no_grad():
        alone = model(short).logits
        padded = model(batch, attention_mask=mask, use_cache=True)
        assert torch.allclose(padded.logits[0, 4:], alone[0], atol=1e-5, rtol=0)
        nxt = torch.tensor([[7], [9]])
        step = model(
            nxt,
            attention_mask=torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=1),
            past_key_values=padded.attn_key_values,
        )
        assert torch.allclose(step.logits[0, -1], model(torch.cat((short, nxt[:1]), 1)).logits[0, -1], atol=1e-5)
        assert torch.allclose(step.logits[1, -1], model(torch.cat((long, nxt[1:]), 1)).logits[0, -1], atol=1e-5)


def test_a_boolean_attention_bias_replaces_the_causal_mask_as_olmos_does():
    model = build()
    tokens = ids(1, 8)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        plain = model(tokens).logits
        assert torch.allclose(model(tokens, attention_bias=causal).logits, plain, atol=1e-6)
        cache = model(tokens[:, :5], attention_bias=causal, use_cache=True).attn_key_values
        rest = model(tokens[:, 5:], attention_bias=causal, past_key_values=cache).logits
        assert torch.allclose(rest, plain[:, 5:], atol=1e-5)
        everything = torch.ones_like(causal)  # no causality at all: early positions see later tokens
        assert not torch.allclose(model(tokens, attention_bias=everything).logits[:, 0], plain[:, 0])


def test_decoding_arguments_that_cannot_work_are_refused():
    model = build()
    tokens = ids(2, 6)
    with torch.no_grad():
        cache = model(tokens, use_cache=True).attn_key_values
        with pytest.raises(ValueError, match="with a cache the mask covers every position, past and new \\(7\\)"):
            model(tokens[:, :1], attention_mask=torch.ones(2, 1), past_key_values=cache)
        with pytest.raises(ValueError, match="past_key_values has 1 entries but the model has 2 blocks"):
            model(tokens[:, :1], past_key_values=cache[:1])
        with pytest.raises(ValueError, match="input_ids or input_embeddings: exactly one"):
            model(None)
        embedded = model(None, input_embeddings=model.transformer.wte(tokens)).logits
        assert torch.equal(embedded, model(tokens).logits)
        with pytest.raises(ValueError, match="pad prompts on the left"):
            model.generate(tokens, attention_mask=torch.tensor([[1] * 6, [1] * 5 + [0]]))


def _greedy_reference(model: OLMo, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding the slow way: a full forward over the whole sequence per token, no cache."""
    tokens = prompt.clone()
    out = []
    for _ in range(steps):
        nxt = int(model(tokens).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == model.config.eos_token_id:
            break
        tokens = torch.cat((tokens, torch.tensor([[nxt]])), dim=1)
    return out


def _sequence_log_prob(model: OLMo, prompt: torch.Tensor, generated: list[int], eos: int) -> float:
    """The log-probability the model gives ``generated`` after ``prompt`` (up to and including the first end)."""
    if eos in generated:
        generated = generated[: generated.index(eos) + 1]
    full = torch.cat((prompt, torch.tensor([generated])), dim=1)
    log_probs = F.log_softmax(model(full).logits[0].float(), dim=-1)
    start = prompt.size(1) - 1
    return sum(float(log_probs[start + i, t]) for i, t in enumerate(generated))


@pytest.mark.parametrize("arch", ["rope", "alibi", "learned-positions", "gqa"])
def test_greedy_generation_equals_argmax_over_full_forwards(arch):
    model = build(**ARCHITECTURES[arch])
    prompt = ids(1, 7, seed=4)
    with torch.no_grad():
        out = model.generate(prompt, max_steps=12)
        expected = _greedy_reference(model, prompt, 12)
    assert isinstance(out, OLMoGenerateOutput) and out.token_ids.shape[:2] == (1, 1)
    assert out.token_ids[0, 0, : len(expected)].tolist() == expected
    with torch.no_grad():
        assert float(out.scores[0, 0]) == pytest.approx(_sequence_log_prob(model, prompt, expected, 0), abs=1e-4)


def test_beam_search_finds_sequences_at_least_as_likely_as_greedy_and_scores_them_right():
    model = build(seed=3)
    prompt = ids(2, 5, seed=5)
    with torch.no_grad():
        greedy = model.generate(prompt, max_steps=6)
        beams = model.generate(prompt, max_steps=6, beam_size=4)
    assert beams.token_ids.shape[:2] == (2, 4)
    assert (beams.scores[:, :-1] >= beams.scores[:, 1:]).all()  # best first
    assert (beams.scores[:, 0] >= greedy.scores[:, 0] - 1e-5).all()
    with torch.no_grad():
        for b in range(2):
            for k in range(4):
                generated = beams.token_ids[b, k].tolist()
                expected = _sequence_log_prob(model, prompt[b : b + 1], generated, 0)
                assert float(beams.scores[b, k]) == pytest.approx(expected, abs=1e-4)


def test_a_batch_of_left_padded_prompts_generates_what_each_prompt_generates_alone():
    model = build(seed=1, rope=False, alibi=True)
    short, long = ids(1, 4, seed=6), ids(1, 9, seed=7)
    batch = torch.cat((torch.cat((torch.zeros(1, 5, dtype=torch.long), short), 1), long))
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, max_steps=5, beam_size=3)
        for row, prompt in enumerate((short, long)):
            alone = model.generate(prompt, max_steps=5, beam_size=3)
            assert torch.equal(together.token_ids[row], alone.token_ids[0])
            assert torch.allclose(together.scores[row], alone.scores[0], atol=1e-5)


def test_sampling_is_reproducible_from_the_seed_and_keeps_to_its_constraints():
    model = build(seed=2)
    prompt = ids(1, 5, seed=8)
    sampler = build_sampler(temperature=0.9, top_k=5)
    assert isinstance(sampler, TopKSampler)
    with torch.no_grad():
        torch.manual_seed(11)
        first = model.generate(prompt, max_steps=8, sampler=sampler)
        torch.manual_seed(11)
        again = model.generate(prompt, max_steps=8, sampler=sampler)
        assert torch.equal(first.token_ids, again.token_ids)
        # Each sampled token is among the 5 most likely at its position.
        full = torch.cat((prompt, first.token_ids[0]), dim=1)
        logits = model(full).logits[0, prompt.size(1) - 1 : -1]
        top5 = logits.topk(5, dim=-1).indices
        assert all(int(t) in top5[i].tolist() for i, t in enumerate(first.token_ids[0, 0]))
        blocked = model.generate(
            prompt, max_steps=10, beam_size=2, constraints=[RepeatedNGramBlockingConstraint(1)]
        )
        for beam in blocked.token_ids[0].tolist():
            body = [t for t in beam if t != 0]
            assert len(body) == len(set(body))  # no token twice
        stochastic = model.generate(prompt, max_steps=4, beam_size=3, sampler=GumbelSampler())
        normalized = model.generate(
            prompt, max_steps=4, beam_size=3, final_sequence_scorer=LengthNormalizedSequenceLogProbabilityScorer()
        )
    assert stochastic.token_ids.shape[:2] == normalized.token_ids.shape[:2] == (1, 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1), r"--temperature=-1 must be finite and >= 0"),
        (dict(temperature=float("nan")), r"--temperature=nan must be finite and >= 0"),
        (dict(temperature=float("inf")), r"--temperature=inf must be finite and >= 0"),
        (dict(temperature=1, top_k=3, top_p=0.5), r"--top_k or --top_p, not both"),
        (dict(temperature=1, top_k=0), r"--top_k=0 must be at least 1"),
        (dict(temperature=1, top_p=1.5), r"--top_p=1.5 must be in \(0, 1\]"),
        (dict(top_p=0.9), r"give a --temperature above 0"),
    ],
)
def test_sampling_options_that_make_no_sense_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_sampler(**kwargs)


def test_generating_past_the_learned_positions_is_refused_with_the_limit():
    model = build(rope=False, max_sequence_length=10)
    with pytest.raises(ValueError, match=r"Position 10 is past the 10 learned positions \(model.wpe\)"):
        model.generate(ids(1, 6), max_steps=8)
