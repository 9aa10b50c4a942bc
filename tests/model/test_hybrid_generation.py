"""Generation with linear-attention layers (``model.layer_types``): the recurrent state cached beside the KV cache
gives the full forward's logits for prompts shorter and longer than the delta rule's chunk (64), one token or several
at a time; greedy and beam search score their sequences as the full forward does; a left-padded batch generates what
each prompt generates alone; and the greedy tokens are those of transformers' ``OlmoHybridForCausalLM.generate`` on
the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from olmo.config import ActivationType, LayerNormType, LinearAttentionConfig
from olmo.hf import build_hf_config, to_hf_state
from olmo.hf.olmo_hybrid import from_saved_names
from olmo.model import OLMo
from olmo.model.generation import left_padded, until_end
from olmo.model.linear_attention import CHUNK_SIZE
from olmo.model.recurrent_cache import RecurrentState
from olmo.testing import (
    run_main,
    run_train,
    tiny_config_dict,
    tiny_model_config,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)

VOCAB = 100
LINEAR = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8)
PATTERNS = {
    "hybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention"], n_layers=3),
    # No attention layer: the positions of learned embeddings come from the recurrent state's length.
    "linear-only-learned-positions": dict(layer_types=["linear_attention"], rope=False),
}


def build(seed: int = 0, **overrides: Any) -> OLMo:
    torch.manual_seed(seed)
    fields = {**PATTERNS["hybrid"], "linear_attention": LINEAR, "max_sequence_length": 256, **overrides}
    return OLMo(tiny_model_config(**fields)).eval()


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("prompt", [1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 150])
def test_decoding_gives_the_full_forwards_logits(prompt: int, pattern: str) -> None:
    """Prefill, then steps of 1, 1, 3 and 1 tokens (several at once: the chunked path after a state), in fp64: each
    step's logits are the full forward's over the whole sequence (to 1e-7: the gated output norm computes in fp32,
    whose last bit may round apart; a wrong state or window differs by 1e-2)."""
    model = build(**PATTERNS[pattern]).double()
    tokens = ids(2, prompt + 6)
    with torch.no_grad():
        full = model(tokens).logits  # (2, prompt + 6, V)
        out = model(tokens[:, :prompt], use_cache=True)
        cache, pieces = out.attn_key_values, [out.logits]
        assert cache is not None
        linear = [layer for layer in cache if isinstance(layer, RecurrentState)]
        assert linear and all(layer.length == prompt and layer.conv.shape[:2] == (2, 3) for layer in linear)
        assert all(layer.state.shape == (2, 4, 8, 8) for layer in linear)
        for start, end in ((0, 1), (1, 2), (2, 5), (5, 6)):
            step = tokens[:, prompt + start : prompt + end]
            out = model(step, past_key_values=cache, use_cache=True)
            cache = out.attn_key_values
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-7)


def _sequence_log_prob(model: OLMo, prompt: torch.Tensor, generated: list[int]) -> float:
    """The log-probability the full forward gives ``generated`` after ``prompt`` (up to the first end token)."""
    eos = model.config.eos_token_id
    if eos in generated:
        generated = generated[: generated.index(eos) + 1]
    full = torch.cat((prompt, torch.tensor([generated])), dim=1)
    log_probs = F.log_softmax(model(full).logits[0].float(), dim=-1)
    start = prompt.size(1) - 1
    return sum(float(log_probs[start + i, t]) for i, t in enumerate(generated))


def test_greedy_and_beam_search_score_their_sequences_as_the_full_forward_does() -> None:
    """Greedy (one beam) is the argmax of full forwards; with 3 beams every hypothesis' score is its sequence's
    log-probability, which holds only if the recurrent states follow their beams when the search reorders them."""
    model = build(seed=3)
    prompt = ids(1, CHUNK_SIZE + 10, seed=5)
    with torch.no_grad():
        greedy = model.generate(prompt, max_steps=8)
        tokens, expected = prompt, []
        for _ in range(8):
            expected.append(int(model(tokens).logits[0, -1].argmax()))
            tokens = torch.cat((tokens, torch.tensor([expected[-1:]])), dim=1)
        beams = model.generate(prompt, max_steps=8, beam_size=3)
        assert greedy.token_ids[0, 0].tolist() == expected
        assert float(greedy.scores[0, 0]) == pytest.approx(_sequence_log_prob(model, prompt, expected), abs=1e-4)
        assert beams.token_ids.shape[:2] == (1, 3) and (beams.scores[0, 0] >= greedy.scores[0, 0] - 1e-5)
        assert len({tuple(b) for b in beams.token_ids[0].tolist()}) == 3
        for k in range(3):
            want = _sequence_log_prob(model, prompt, beams.token_ids[0, k].tolist())
            assert float(beams.scores[0, k]) == pytest.approx(want, abs=1e-4)


def test_a_left_padded_batch_generates_what_each_prompt_generates_alone() -> None:
    """Prompts of 2, 70 and 130 tokens padded on the left to one batch (padding across chunk boundaries and inside
    the convolution's window): a linear layer starts afresh at each prompt's first real token, so each row decodes
    the logits of its prompt alone, and generates what it generates alone, beams too."""
    model = build(seed=1)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (2, 70, 130)]
    batch, mask = left_padded(prompts, model.config.pad_token_id)
    assert mask is not None
    following = ids(3, 3, seed=4)
    with torch.no_grad():
        out = model(batch, attention_mask=mask, use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(3):
            mask = torch.cat((mask, torch.ones(3, 1, dtype=mask.dtype)), dim=1)
            out = model(
                following[:, t : t + 1], attention_mask=mask, past_key_values=out.attn_key_values, use_cache=True
            )
            steps.append(out.logits[:, -1])
        for row, prompt in enumerate(prompts):
            alone = model(torch.cat((torch.tensor([prompt]), following[row : row + 1]), dim=1)).logits[0, -4:]
            torch.testing.assert_close(torch.stack(steps)[:, row], alone, rtol=0, atol=1e-5)
        mask = mask[:, :-3]
        together = model.generate(batch, attention_mask=mask, max_steps=6, beam_size=2)
        for row, prompt in enumerate(prompts):
            alone = model.generate(torch.tensor([prompt]), max_steps=6, beam_size=2)
            assert torch.equal(together.token_ids[row], alone.token_ids[0])
            torch.testing.assert_close(together.scores[row], alone.scores[0], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="padding between real tokens"):
            model(batch[:1], attention_mask=torch.tensor([[1, 0] + [1] * (batch.size(1) - 2)]))
        with pytest.raises(ValueError, match="attention_bias is not implemented for linear_attention"):
            model(batch[:1, :4], attention_bias=torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_greedy_tokens_equal_transformers_generate() -> None:
    """OLMo Hybrid's layout (three linear-attention layers to one attention layer, GQA, negative eigenvalues) on
    transformers' OlmoHybridForCausalLM with the same weights: a 100-token prompt and a left-padded batch give the
    same greedy tokens and the same prompt logits."""
    hf_modeling = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
    types = ["linear_attention"] * 3 + ["full_attention"]
    model = build(
        seed=7,
        d_model=64,
        n_kv_heads=2,
        n_layers=4,
        layer_types=types,
        linear_attention=LinearAttentionConfig(
            num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=16
        ),
        norm_after=True,
        attention_layer_norm=True,
        layer_norm_type=LayerNormType.rms,
        layer_norm_eps=1e-6,
        activation_type=ActivationType.swiglu,
        include_bias=False,
        weight_tying=False,
    )
    cfg = model.config
    ref = hf_modeling.OlmoHybridForCausalLM(build_hf_config(cfg, torch.float32)).eval()  # the converter's config
    # The converter's state dict is under the names transformers' files hold; its model's own names are these.
    ref.load_state_dict(from_saved_names(to_hf_state(model.state_dict(), cfg)), strict=True)
    prompt = ids(1, 100, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, ref(prompt).logits, rtol=1e-4, atol=1e-5)
        ours = model.generate(prompt, max_steps=10).token_ids[:, 0]
        theirs = ref.generate(prompt, max_new_tokens=10, do_sample=False)[:, 100:]
        prompts = [ids(1, n, seed=n)[0].tolist() for n in (100, 30)]
        batch, mask = left_padded(prompts, cfg.pad_token_id)
        ours_batch = model.generate(batch, attention_mask=mask, max_steps=6).token_ids[:, 0]
        theirs_batch = ref.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)[:, 100:]
    eos = cfg.eos_token_id  # a sequence ends there (transformers pads after it, we repeat it)
    for a, b in ((ours, theirs), (ours_batch, theirs_batch)):
        assert [until_end(row, eos) for row in a.tolist()] == [until_end(row, eos) for row in b.tolist()]
    assert len(until_end(ours[0].tolist(), eos)) >= 5  # enough tokens to compare


def test_training_samples_and_generate_py_continue_a_hybrid_checkpoint_alike(tmp_path: Path, capsys) -> None:
    """End to end: a tiny hybrid trains two steps with a ``generate`` evaluator (two prompts of different lengths:
    a left-padded batch) and scripts/generate.py continues each prompt alone from the checkpoint the same way."""
    write_byte_memmap(tmp_path / "train.npy", 20_000)
    write_byte_tokenizer(tmp_path / "tokenizer.json")
    prompts = ["def main(", "import os, sys"]
    evaluators = [{"label": "samples", "type": "generate", "prompts": prompts, "max_new_tokens": 8}]
    cfg = tiny_config_dict(
        tmp_path / "run",
        [str(tmp_path / "train.npy")],
        **{
            "tokenizer.identifier": str(tmp_path / "tokenizer.json"),
            "model.layer_types": ["linear_attention", "full_attention"],
            "model.linear_attention": {"num_key_heads": 2, "num_value_heads": 2, "key_head_dim": 8},
            "max_duration": 2,
            "eval_interval": 2,
            "save_interval_unsharded": 2,
            "evaluators": evaluators,
        },
    )
    assert run_train(write_config(tmp_path / "hybrid.yaml", cfg)) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = [r["eval/samples/samples"] for r in lines if "eval/samples/samples" in r]
    assert len(samples) == 1 and [s["prompt"] for s in samples[0]] == prompts
    for sample in samples[0]:
        capsys.readouterr()
        checkpoint = tmp_path / "run" / "step2-unsharded"
        flags = (f"--prompt={sample['prompt']}", "--max_new_tokens=8", "--json")
        assert run_main("generate.py", checkpoint, *flags) == 0
        assert json.loads(capsys.readouterr().out)["text"] == sample["completion"]
    assert sum(s["tokens"] for s in samples[0]) > 0
