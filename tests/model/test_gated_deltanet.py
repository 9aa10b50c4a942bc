"""Gated DeltaNet (``model.layer_types`` with ``linear_attention``): the chunked delta rule against the step-by-step
recurrence, the mixer against transformers' ``OlmoHybridGatedDeltaNet`` on the same weights, document resets, a tiny
hybrid model training through the trainer, what is refused, and every shipped config unchanged."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from olmo.config import LinearAttentionConfig, ModelConfig, TrainConfig
from olmo.config.validation import config_problems
from olmo.distributed import model_config_fingerprint
from olmo.exceptions import OLMoConfigurationError
from olmo.model import OLMo
from olmo.model.delta_rule import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from olmo.testing import run_train, tiny_config_dict, write_byte_corpus, write_config

REPO = Path(__file__).resolve().parents[2]
HYBRID = ["linear_attention", "full_attention"]


def _inputs(T: int, neg: bool, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    B, H, dk, dv = 2, 3, 5, 7
    q = l2_normalize(torch.randn(B, H, T, dk, generator=gen, dtype=dtype)) * dk**-0.5
    k = l2_normalize(torch.randn(B, H, T, dk, generator=gen, dtype=dtype))
    v = torch.randn(B, H, T, dv, generator=gen, dtype=dtype)
    g = -torch.rand(B, H, T, generator=gen, dtype=dtype)
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype) * (2.0 if neg else 1.0)
    return q, k, v, g, beta


@pytest.mark.parametrize("neg", [False, True])
@pytest.mark.parametrize("T", [1, 37, 64, 130])
def test_chunked_delta_rule_equals_the_recurrence(T: int, neg: bool) -> None:
    q, k, v, g, beta = _inputs(T, neg)
    resets = torch.rand(2, T, generator=torch.Generator().manual_seed(1)) < 0.1
    for r in (None, resets):
        want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, r)
        for chunk in (1, 8, 16, 64):
            got, state = chunk_gated_delta_rule(q, k, v, g, beta, r, chunk_size=chunk)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
            torch.testing.assert_close(state, want_state, rtol=0, atol=1e-12)


def test_a_document_start_resets_the_state() -> None:
    """A packed row gives each document the outputs it gives alone, and the initial state continues a sequence."""
    q, k, v, g, beta = _inputs(50, True)
    resets = torch.zeros(2, 50, dtype=torch.bool)
    resets[:, 20] = True
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, resets, chunk_size=16)
    second, _ = chunk_gated_delta_rule(*(t[:, :, 20:] for t in (q, k, v, g, beta)), chunk_size=16)
    torch.testing.assert_close(packed[:, :, 20:], second, rtol=0, atol=1e-12)
    first, state = chunk_gated_delta_rule(*(t[:, :, :20] for t in (q, k, v, g, beta)), chunk_size=16)
    rest, _ = chunk_gated_delta_rule(
        *(t[:, :, 20:] for t in (q, k, v, g, beta)), initial_state=state, chunk_size=16
    )
    whole, _ = recurrent_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(torch.cat((first, rest), dim=2), whole, rtol=0, atol=1e-12)


def _hybrid_config(neg: bool, **linear: int) -> ModelConfig:
    la = LinearAttentionConfig(allow_neg_eigval=neg, **linear)  # type: ignore[arg-type]
    return ModelConfig(
        d_model=64,
        n_heads=4,
        n_layers=2,
        layer_types=HYBRID,
        linear_attention=la,
        vocab_size=100,
        embedding_size=128,
        eos_token_id=0,
        pad_token_id=0,
        layer_norm_type="rms",  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("neg", "linear"),
    [(True, {"num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 8, "value_head_dim": 12}), (False, {})],
)
def test_mixer_equals_transformers(neg: bool, linear: dict[str, int]) -> None:
    """Our block's mixer and transformers' OlmoHybridGatedDeltaNet (its pure-PyTorch path) on the same weights,
    copied by name (ours are transformers' names): forward and the gradients of the input and every weight."""
    hf_modeling = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
    from transformers.models.olmo_hybrid.configuration_olmo_hybrid import OlmoHybridConfig

    torch.manual_seed(0)
    cfg = _hybrid_config(neg, **linear)
    block = OLMo(cfg).transformer.blocks[0]
    hf_cfg = OlmoHybridConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        layer_types=HYBRID,
        linear_allow_neg_eigval=neg,
        **{f"linear_{name}": size for name, size in linear.items()},
    )
    ref = hf_modeling.OlmoHybridGatedDeltaNet(hf_cfg, 0)
    names = {name for name, _ in ref.named_parameters()}
    ref.load_state_dict({name: p for name, p in block.state_dict().items() if name in names}, strict=True)
    x = torch.randn(2, 150, 64, requires_grad=True)  # more than two chunks
    ours, theirs = block.mix(x), ref(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(ours)
    got = torch.autograd.grad(ours, [x, *(dict(block.named_parameters())[n] for n in sorted(names))], dy)
    want = torch.autograd.grad(theirs, [x, *(dict(ref.named_parameters())[n] for n in sorted(names))], dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_model_resets_at_documents_and_linear_layers_are_pre_norm() -> None:
    """doc_lens: a document gives the logits it gives alone (RoPE, no learned positions); the hybrid model with
    norm_after keeps its linear-attention layer pre-norm."""
    torch.manual_seed(0)
    cfg = _hybrid_config(True)
    cfg.rope, cfg.norm_after = True, True
    model = OLMo(cfg).eval()
    assert [b.norm_after for b in model.transformer.blocks] == [False, True]
    ids = torch.randint(1, 100, (1, 40))
    doc_lens = torch.tensor([[15, 25]])
    with torch.no_grad():
        packed = model(ids, doc_lens=doc_lens).logits
        alone = model(ids[:, 15:]).logits
    torch.testing.assert_close(packed[:, 15:], alone, rtol=1e-4, atol=1e-5)


def test_what_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = OLMo(_hybrid_config(True)).eval()
    ids = torch.randint(1, 100, (1, 8))
    with pytest.raises(OLMoConfigurationError, match="linear_attention"):
        model.generate(ids, max_steps=2)
    with pytest.raises(OLMoConfigurationError, match="linear_attention"):
        model(ids, use_cache=True)
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=(torch.arange(8) >= 2).long()[None])  # left padding
    data = write_byte_corpus(tmp_path)
    base = {"model.layer_types": HYBRID, "model.linear_attention": {"kind": "gated_deltanet"}}
    for key, value in [("tensor_parallel.degree", 2), ("context_parallel.degree", 2), ("hf_export.enabled", True)]:
        cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", data, **base, **{key: value}))
        problems = " ".join(p for p in config_problems(cfg, 4) if "linear_attention" in p)
        assert key in problems, (key, config_problems(cfg, 4))
    no_section = TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", data, **{"model.layer_types": HYBRID}))
    assert any("model.linear_attention is not set" in p for p in config_problems(no_section, 1))
    bad = {**base, "model.linear_attention": {"num_key_heads": 2, "num_value_heads": 3}}
    assert any(
        "num_value_heads=3" in p
        for p in config_problems(TrainConfig.from_dict(tiny_config_dict(tmp_path, data, **bad)), 1)
    )


def test_tiny_hybrid_trains(tmp_path: Path) -> None:
    data = write_byte_corpus(tmp_path / "data")
    overrides = {
        "model.layer_types": HYBRID,
        "model.linear_attention": {
            "num_key_heads": 2,
            "num_value_heads": 2,
            "key_head_dim": 16,
            "value_head_dim": 16,
        },
        "model.layer_norm_type": "rms",
        "data.generate_doc_lengths": True,
        "max_duration": 8,
        "console_log_interval": 1,
    }
    path = write_config(tmp_path / "hybrid.yaml", tiny_config_dict(tmp_path / "run", data, **overrides))
    record: list[dict[str, float]] = []
    assert run_train(path, record=record) == 0
    losses = [r["train/CrossEntropyLoss"] for r in record if "train/CrossEntropyLoss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5


# The state dict (keys and shapes, hashed) and config fingerprint of every shipped model before layer_types existed.
UNCHANGED = {
    "configs/official/OLMo-1B.yaml": ("f8bf10132d731b70", 65, "00b8f1413c683ffa"),
    "configs/official/OLMo-3-32B-long-context.yaml": ("4e3a2bc371beb3cb", 515, "2be934facadc48d7"),
    "configs/official/OLMo-3-32B-midtrain.yaml": ("4e3a2bc371beb3cb", 515, "49126a7276406afb"),
    "configs/official/OLMo-3-32B.yaml": ("4e3a2bc371beb3cb", 515, "49126a7276406afb"),
    "configs/official/OLMo-3-7B-long-context.yaml": ("c0692ec5b1889345", 259, "92a6a2d0b25730a1"),
    "configs/official/OLMo-3-7B-midtrain.yaml": ("c0692ec5b1889345", 259, "fcd685726b7160b7"),
    "configs/official/OLMo-3-7B.yaml": ("c0692ec5b1889345", 259, "fcd685726b7160b7"),
    "configs/official/OLMo-300M.yaml": ("c6bff324eb1fae55", 33, "536f689475c75241"),
    "configs/official/OLMo-7B.yaml": ("18b64fbcf26dd5c3", 130, "b307e40487b191e7"),
    "configs/official/OLMoE-1B-7B.yaml": ("4ccefe32626024b4", 163, "fd4843e6f45e27c2"),
    "configs/tiny/OLMo-tiny-mix.yaml": ("519810b952d433a3", 17, "854e18605951bef9"),
    "configs/tiny/OLMo-tiny-two-stage.yaml": ("519810b952d433a3", 17, "854e18605951bef9"),
    "configs/tiny/OLMo-tiny.yaml": ("519810b952d433a3", 17, "854e18605951bef9"),
}


@pytest.mark.parametrize("config", sorted(UNCHANGED))
def test_shipped_configs_build_what_they_built(config: str) -> None:
    cfg = TrainConfig.load(REPO / config)
    with torch.device("meta"):
        model = OLMo(cfg.model)
    keys = [f"{k}:{tuple(v.shape)}" for k, v in model.state_dict().items()]
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
    assert (digest, len(keys), model_config_fingerprint(cfg.model)) == UNCHANGED[config]


def test_a_linear_attention_layer_counts_flops_linear_in_the_sequence_length() -> None:
    """The attention layers' term grows with the sequence length, the linear layer's recurrence does not: 18 FLOPs
    per token for each entry of each value head's (dk, dv) state, forward and backward."""
    cfg = _hybrid_config(True, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12)
    model = OLMo(cfg)
    n_matmul = model.num_active_params(include_embedding=False) + cfg.effective_embedding_size * cfg.d_model
    attention_layers = cfg.layer_kinds().count("full_attention")
    assert attention_layers == 1 and cfg.layer_kinds().count("linear_attention") == 1
    for T in (16, 256):
        attention = 12 * cfg.d_model * T * attention_layers
        assert model.num_flops_per_token(T) == 6 * n_matmul + attention + 18 * 4 * 8 * 12
