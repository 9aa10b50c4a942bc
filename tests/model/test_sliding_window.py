"""OLMo 3's attention options in the model: sliding-window attention (``model.sliding_window``) and RoPE scaling
(``model.rope_scaling``). Equality with transformers' ``Olmo3ForCausalLM`` is in tests/hf/test_hf_olmo3.py; these
tests check the semantics from first principles: which keys a windowed query sees, that the window combines with
document masking and the KV cache, which layers RoPE scaling reaches, and that a window hiding nothing changes
nothing."""

import dataclasses

import pytest
import torch

from olmo.config import RopeScalingConfig, SlidingWindowConfig
from olmo.model import OLMo
from olmo.model.layers import rotary_cos_sin, scaled_inverse_frequencies
from olmo.testing import tiny_model_config

VOCAB = 100
T = 24
TIGHT = dict(rtol=1e-5, atol=1e-5)


def config(**overrides):
    return tiny_model_config(**{"vocab_size": VOCAB, "max_sequence_length": T, **overrides})


def build(**overrides) -> OLMo:
    torch.manual_seed(0)
    model = OLMo(config(**overrides)).eval()
    with torch.no_grad():  # larger than init so that every position's attention matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def same_weights(model: OLMo, **overrides) -> OLMo:
    other = OLMo(dataclasses.replace(model.config, **overrides)).eval()
    other.load_state_dict(model.state_dict())
    return other


def ids(batch=2, length=T, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def windows(pattern, first=False, last=False):
    return SlidingWindowConfig(
        pattern=pattern, force_full_attention_on_first_layer=first, force_full_attention_on_last_layer=last
    )


def test_pattern_is_cycled_and_first_and_last_layers_can_be_forced_full():
    # OLMo 3's default: [4096] * 3 + [-1], and the last layer full.
    olmo3 = config(n_layers=8, sliding_window=SlidingWindowConfig())
    assert olmo3.layer_windows() == [4096, 4096, 4096, None] * 2
    assert config(n_layers=5, sliding_window=windows([8, 4, -1])).layer_windows() == [8, 4, None, 8, 4]
    forced = config(n_layers=5, sliding_window=windows([8], first=True, last=True))
    assert forced.layer_windows() == [None, 8, 8, 8, None]
    # A forced first layer starts the cycle at layer 1, as OLMo-core's _get_window_size does.
    shifted = config(n_layers=8, sliding_window=windows([4, 4, 4, -1], first=True, last=True))
    assert shifted.layer_windows() == [None, 4, 4, 4, None, 4, 4, None]
    assert config(n_layers=3).layer_windows() == [None, None, None]


def test_a_window_is_that_many_keys_the_query_itself_included():
    """One windowed layer and relative positions: position t's logits are those of the last W tokens run alone.
    W - 1 or W + 1 keys would fail this at every position past the window."""
    W = 5
    model = build(n_layers=1, sliding_window=windows([W]))
    x = ids(batch=1)
    logits = model(x).logits[0]
    for t in range(T):
        alone = model(x[:, max(0, t - W + 1) : t + 1]).logits[0, -1]
        torch.testing.assert_close(logits[t], alone, **TIGHT)
    assert not torch.allclose(logits, same_weights(model, sliding_window=None)(x).logits[0], **TIGHT)


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_windowed_layers_equal_an_explicit_window_mask(kv_heads):
    """The model's windowed bias equals the same window given as OLMo's ``attention_bias`` (another code path)
    on a windowless model: windows [6, 3] cycled over 4 layers, QK-norm and GQA as in OLMo 3."""
    model = build(n_layers=2, n_kv_heads=kv_heads, attention_layer_norm=True, sliding_window=windows([6]))
    x = ids()
    positions = torch.arange(T)
    allowed = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 6)  # (T, T)
    explicit = same_weights(model, sliding_window=None)(x, attention_bias=allowed[None, None]).logits
    torch.testing.assert_close(model(x).logits, explicit, **TIGHT)


def test_a_window_as_long_as_the_sequence_changes_nothing_bitwise():
    model = build(n_layers=3, sliding_window=windows([T, T, -1]))
    x = ids()
    assert torch.equal(model(x).logits, same_weights(model, sliding_window=None)(x).logits)


def test_windowed_documents_give_the_logits_of_separate_windowed_runs():
    model = build(n_layers=3, sliding_window=windows([4, 4, -1], last=True))
    x = ids(batch=2)
    doc_lens = torch.tensor([[7, 11, 6], [24, 0, 0]])
    logits = model(x, doc_lens=doc_lens).logits
    for row, lengths in enumerate(doc_lens.tolist()):
        start = 0
        for length in lengths:
            if length:
                alone = model(x[row : row + 1, start : start + length]).logits[0]
                torch.testing.assert_close(logits[row, start : start + length], alone, **TIGHT)
            start += length


@pytest.mark.parametrize("scaling", [None, "yarn"])
def test_cached_decoding_past_the_window_equals_the_full_forward(scaling):
    rope_scaling = RopeScalingConfig(name="yarn", factor=4, old_context_len=8) if scaling else None
    model = build(n_layers=4, n_kv_heads=2, sliding_window=windows([5, 5, 5, -1]), rope_scaling=rope_scaling)
    x = ids(batch=2)
    full = model(x).logits
    with torch.no_grad():
        out = model(x[:, :9], use_cache=True)  # a prompt longer than the window
        torch.testing.assert_close(out.logits, full[:, :9], **TIGHT)
        cache = out.attn_key_values
        for t in range(9, T):
            out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.attn_key_values
            torch.testing.assert_close(out.logits[:, -1], full[:, t], **TIGHT)
        # A chunk of several new tokens after the cache (the offset causal mask with the window).
        chunk = model(x[:, 12:], past_key_values=model(x[:, :12], use_cache=True).attn_key_values)
        torch.testing.assert_close(chunk.logits, full[:, 12:], **TIGHT)


def test_greedy_generation_past_the_window_follows_the_full_forward():
    model = build(n_layers=4, sliding_window=windows([4, 4, 4, -1]), eos_token_id=VOCAB - 1)
    prompt = ids(batch=1, length=10)
    generated = model.generate(prompt, max_steps=12).token_ids[0, 0].tolist()
    sequence = prompt
    with torch.no_grad():
        for _ in range(12):
            next_id = model(sequence).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_id], dim=1)
    expected = sequence[0, 10:].tolist()
    if VOCAB - 1 in expected:
        expected = expected[: expected.index(VOCAB - 1) + 1]
    assert generated[: len(expected)] == expected


def test_rope_scaling_reaches_the_full_attention_layers_only():
    yarn = RopeScalingConfig(name="yarn", factor=8, old_context_len=8)
    every_layer_windowed = build(n_layers=2, sliding_window=windows([6]), rope_scaling=yarn)
    x = ids()
    assert torch.equal(
        every_layer_windowed(x).logits, same_weights(every_layer_windowed, rope_scaling=None)(x).logits
    )
    with_full_layer = build(n_layers=2, sliding_window=windows([6], last=True), rope_scaling=yarn)
    unscaled = same_weights(with_full_layer, rope_scaling=None)(x).logits
    assert not torch.allclose(with_full_layer(x).logits, unscaled, **TIGHT)


def test_yarn_keeps_fast_frequencies_divides_slow_ones_and_scales_attention():
    head_dim, theta = 64, 500_000
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    yarn = RopeScalingConfig(name="yarn", factor=8, old_context_len=8192, beta_fast=32, beta_slow=1)
    scaled = scaled_inverse_frequencies(head_dim, theta, yarn)
    # Frequencies turning more than beta_fast times within the old context are kept; fewer than beta_slow: / factor.
    turns = plain * 8192 / (2 * torch.pi)
    assert torch.equal(scaled[turns > 64], plain[turns > 64])
    torch.testing.assert_close(scaled[turns < 0.5], plain[turns < 0.5] / 8)
    assert ((scaled <= plain) & (scaled >= plain / 8 * (1 - 1e-6))).all()
    cos, sin = rotary_cos_sin(4, head_dim, theta, torch.device("cpu"), yarn)
    factor = 0.1 * torch.log(torch.tensor(8.0)) + 1
    torch.testing.assert_close(cos[0], torch.full((head_dim,), float(factor)))  # position 0: cos 1 * the factor


@pytest.mark.parametrize("name", ["yarn", "llama3"])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_scaled_frequencies_equal_transformers_definitions(name, head_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours = RopeScalingConfig(name=name, factor=8, old_context_len=8192, low_freq_factor=1, high_freq_factor=4)
    full = {"rope_type": name, "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 8192}
    full.update(
        {"beta_fast": 32.0, "beta_slow": 1.0}
        if name == "yarn"
        else {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    )
    hf = transformers.Olmo3Config(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_hidden_layers=4,
        max_position_embeddings=65536,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "full_attention": full,
        },
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[name](hf, torch.device("cpu"), layer_type="full_attention")
    assert torch.equal(scaled_inverse_frequencies(head_dim, 500_000, ours), inv_freq)
    assert ours.effective_attention_factor == attention_factor


def test_flops_count_a_windowed_layer_s_keys_not_the_sequence():
    full = build(n_layers=4)
    windowed = same_weights(full, sliding_window=windows([4, 4, 4, -1]))
    attention_per_key = 12 * 32  # 12 * n_heads * head_dim
    assert full.num_flops_per_token(T) - windowed.num_flops_per_token(T) == 3 * attention_per_key * (T - 4)
    assert windowed.num_flops_per_token(3) == full.num_flops_per_token(3)  # a window longer than the sequence


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.sliding_window.pattern=[]"], "model.sliding_window.pattern is empty"),
        (["model.sliding_window.pattern=[4096,0,-2]"], "holds [0, -2]"),
        (["model.sliding_window.pattern=[100000000000000000000]"], "window of 1 to 16,777,216 tokens, or -1"),
        (["model.rope_scaling.name=linear"], "model.rope_scaling.name='linear'"),
        (["model.rope_scaling.factor=0.5"], "model.rope_scaling.factor=0.5"),
        (["model.rope_scaling.beta_fast=1", "model.rope_scaling.beta_slow=32"], "beta_fast > beta_slow > 0"),
        (["model.rope_scaling.name=llama3", "model.rope_scaling.low_freq_factor=4"], "high_freq_factor > low"),
        (["model.rope=false", "model.rope_scaling.factor=2"], "model.rope_scaling is set but model.rope=false"),
    ],
)
def test_bad_window_and_scaling_values_are_named_before_training(tmp_path, overrides, key):
    from olmo.config import TrainConfig
    from olmo.config.validation import validate_train_config
    from olmo.exceptions import OLMoConfigurationError
    from olmo.testing import tiny_config_dict, write_config

    path = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")]))
    cfg = TrainConfig.load(path, overrides)
    with pytest.raises(OLMoConfigurationError) as e:
        validate_train_config(cfg, world_size=1)
    assert key in str(e.value)


def test_a_model_without_the_new_options_keeps_its_checkpoint_fingerprint():
    """train.pt records a hash of the model config; the new options, unset, must not change it (a resume of an
    older checkpoint would warn that the model config differs, and checkpoints would not be bitwise as before)."""
    from olmo.config import ModelConfig
    from olmo.distributed import model_config_fingerprint

    assert model_config_fingerprint(ModelConfig()) == "298ec748e49dad20"  # the value before the options existed
    assert model_config_fingerprint(ModelConfig(sliding_window=SlidingWindowConfig())) != "298ec748e49dad20"


@pytest.mark.parametrize("key, value", [("model.sliding_window", "4096"), ("model.rope_scaling", "yarn")])
def test_a_section_given_one_value_is_named_with_how_to_set_it(tmp_path, key, value):
    from olmo.exceptions import OLMoConfigurationError
    from olmo.testing import run_main, tiny_config_dict, write_config

    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")]))
    with pytest.raises(OLMoConfigurationError) as e:
        run_main("train.py", config, f"--{key}={value}")
    assert f"Invalid value for config key '{key}'" in str(e.value) and f"--{key}.FIELD=VALUE" in str(e.value)


def test_a_gigabyte_window_mask_warns_at_startup_unless_flash_attn_takes_the_window(tmp_path, caplog):
    from olmo.config import TrainConfig
    from olmo.config.validation import validate_train_config
    from olmo.testing import tiny_config_dict, write_config

    path = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")]))
    long = ["model.max_sequence_length=16384", "model.sliding_window.pattern=[4096,-1]"]
    for overrides, warned in (
        (long, True),
        ([*long, "model.flash_attention=true"], False),
        (["model.sliding_window.pattern=[4096,-1]"], False),  # 32 tokens: a small mask
    ):
        caplog.clear()
        validate_train_config(TrainConfig.load(path, overrides), world_size=1)
        assert ("a 16,384 x 16,384 attention mask, 1.0 GiB" in caplog.text) == warned, caplog.text
