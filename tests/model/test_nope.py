"""``model.nope``: attention without any position encoding (OLMo Hybrid's released attention layers), instead of
the learned positions a model with neither RoPE nor ALiBi has."""

from __future__ import annotations

import pytest
import torch

from olmo.config import LinearAttentionConfig, ModelConfig
from olmo.distributed import model_config_fingerprint
from olmo.model import OLMo


def _config(**kw: object) -> ModelConfig:
    base: dict[str, object] = dict(
        d_model=32,
        n_heads=4,
        n_layers=2,
        vocab_size=50,
        embedding_size=64,
        max_sequence_length=16,
        eos_token_id=0,
        pad_token_id=0,
        layer_norm_type="rms",
        init_device="cpu",
    )
    return ModelConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_a_nope_model_has_no_positions_so_attention_alone_cannot_order_tokens() -> None:
    """Without position encoding a one-layer attention model's last-position output is the same for any order of the
    earlier tokens (causal attention over them is a weighted set); with learned positions it is not; a linear-attention layer
    in front orders them again. No ``wpe`` parameter."""
    torch.manual_seed(0)
    ids = torch.tensor([[5, 9, 3, 7, 2]])
    shuffled = torch.tensor([[3, 7, 9, 5, 2]])
    nope = OLMo(_config(nope=True, n_layers=1)).eval()
    assert "transformer.wpe.weight" not in dict(nope.named_parameters())
    torch.testing.assert_close(nope(ids).logits[0, -1], nope(shuffled).logits[0, -1], rtol=1e-5, atol=1e-5)
    learned = OLMo(_config(n_layers=1)).eval()
    assert "transformer.wpe.weight" in dict(learned.named_parameters())
    assert not torch.allclose(learned(ids).logits[0, -1], learned(shuffled).logits[0, -1], atol=1e-4)
    hybrid = _config(nope=True, layer_types=["linear_attention", "full_attention"])
    hybrid.linear_attention = LinearAttentionConfig(key_head_dim=8, value_head_dim=8)
    model = OLMo(hybrid).eval()
    assert not torch.allclose(model(ids).logits[0, -1], model(shuffled).logits[0, -1], atol=1e-4)
    # No learned positions: a NoPE model reads past max_sequence_length.
    assert model(torch.randint(0, 50, (1, 40))).logits.shape == (1, 40, 64)


@pytest.mark.parametrize("other", ["rope", "alibi"])
def test_nope_with_another_position_encoding_is_refused_naming_both(other: str) -> None:
    problems = _config(nope=True, **{other: True}).problems()
    assert any(f"model.nope=true (no position encoding) contradicts model.{other}=true" in p for p in problems)


def test_the_fingerprint_of_a_model_without_nope_is_what_it_was() -> None:
    """The option left unset (false) keeps the checkpoint fingerprint every existing model has."""
    assert model_config_fingerprint(_config()) == model_config_fingerprint(_config(nope=False))
    assert model_config_fingerprint(_config(nope=True)) != model_config_fingerprint(_config())
