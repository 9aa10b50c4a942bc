"""OLMo Hybrid both ways with transformers' ``OlmoHybridForCausalLM``: random tiny models of each variant (linear or
attention layers first, GQA in both layer kinds, ``allow_neg_eigval`` both ways, plain RoPE and YaRN) import with the
same logits (fp32, sequences longer than one delta-rule chunk) and export back to the same weights; a tiny hybrid
run's ``hf_export`` and ``convert_to_hf.py`` give a model transformers loads with our logits, which imports back to
the same weights; the released OLMo-Hybrid-7B's config.json (tests/fixtures/olmo_hybrid_7b) gives the model
OLMo-core trains; what our model cannot hold (no RoPE, above all) is refused both ways, naming the key."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_hf import _assert_nothing_written, _ours
from test_hf_damaged import _edit_config, _refused

from olmo.config import LinearAttentionConfig, TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.hf import hf_config_kwargs, hf_model_type, model_config_from_hf
from olmo.hf.files import read_hf_config
from olmo.model import OLMo
from olmo.testing import (
    BYTE_EOS,
    BYTE_VOCAB,
    run_main,
    run_train,
    tiny_config_dict,
    tiny_model_config,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)

transformers = pytest.importorskip("transformers")

EMBEDDING = 320
SEQ = 72
"""Longer than one chunk (64 positions) of the chunked delta rule."""
L, F = "linear_attention", "full_attention"
YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=SEQ // 4,
    beta_fast=32.0,
    beta_slow=1.0,
    attention_factor=1.25,  # written by every export (OLMo 3's released config has it), so the round trip is exact
)
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "olmo_hybrid_7b"


def _hf_model(layer_types=(L, L, L, F), rope=None, **options):
    """A random ``OlmoHybridForCausalLM``: d_model 64, 4 heads of 16, untied, RoPE theta 500 unless ``rope`` says
    otherwise; every norm weight random too."""
    fields = dict(
        vocab_size=EMBEDDING,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        layer_types=list(layer_types),
        rope_parameters={"rope_type": "default", **(rope or {}), "rope_theta": 500.0},
        eos_token_id=BYTE_EOS,
        pad_token_id=BYTE_EOS,
        tie_word_embeddings=False,
    )
    config = transformers.OlmoHybridConfig(**{**fields, **options})
    torch.manual_seed(0)
    model = transformers.OlmoHybridForCausalLM._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def _assert_same_logits(ours: OLMo, hf, seq_len: int = SEQ) -> None:
    ids = torch.randint(0, BYTE_VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_logits, hf_logits = ours(ids).logits, hf(ids).logits
    assert ours_logits.shape == hf_logits.shape == (2, seq_len, EMBEDDING)
    torch.testing.assert_close(ours_logits, hf_logits, rtol=0, atol=1e-5)


VARIANTS = {
    # OLMo-Hybrid-7B's layout: three Gated DeltaNet layers, then attention; negative eigenvalues allowed.
    "linear-first": (dict(), [L, L, L, F]),
    # Attention first; GQA in both kinds (2 key/value heads for 4 query heads; 2 key heads for 4 value heads),
    # head sizes of their own, beta in (0, 1), tied embeddings.
    "attention-first-gqa": (
        dict(
            layer_types=(F, L, L),
            num_key_value_heads=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_allow_neg_eigval=False,
            linear_conv_kernel_dim=3,
            tie_word_embeddings=True,
        ),
        [F, L, L],
    ),
    "yarn-alternating": (dict(layer_types=(L, F, L, F), rope=YARN), [L, F]),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_olmo_hybrid_to_ours_and_back_is_exact(variant, tmp_path):
    options, pattern = VARIANTS[variant]
    hf = _hf_model(**options)
    hf.save_pretrained(tmp_path / "hf")
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")

    assert run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours") == 0
    model_cfg = TrainConfig.load(tmp_path / "ours" / "config.yaml").model
    layer_types = list(options.get("layer_types", (L, L, L, F)))
    assert model_cfg.layer_types == pattern and model_cfg.layer_kinds() == layer_types  # the shortest pattern
    la = model_cfg.linear_attention
    assert (la.key_heads(model_cfg), la.value_heads(model_cfg)) == (
        hf.config.linear_num_key_heads,
        hf.config.linear_num_value_heads,
    )
    assert la.allow_neg_eigval == hf.config.linear_allow_neg_eigval
    assert model_cfg.n_kv_heads == options.get("num_key_value_heads")
    assert (model_cfg.rope_scaling and model_cfg.rope_scaling.name) == ("yarn" if "rope" in options else None)
    ours = _ours(tmp_path / "ours")
    _assert_same_logits(ours, hf)

    assert run_main("convert_to_hf.py", tmp_path / "ours", tmp_path / "back") == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    assert type(back).__name__ == "OlmoHybridForCausalLM" and back.config.layer_types == layer_types
    assert back.config.rope_parameters == hf.config.rope_parameters
    # Written under the names transformers' save_pretrained writes (q/k/v_conv1d, attention/feedforward_layer_norm).
    assert (
        load_file(tmp_path / "back" / "model.safetensors").keys()
        == load_file(tmp_path / "hf" / "model.safetensors").keys()
    )
    expected, actual = hf.state_dict(), back.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_a_model_without_rope_converts_both_ways_as_nope(tmp_path):
    """transformers' "no RoPE" (``rope_parameters.rope_theta`` null: attention gets no position information, as the
    released OLMo-Hybrid-7B) imports as ``model.nope`` (no learned positions either), with the same logits, and
    exports back to a null theta; OLMo-core's top-level ``"rope_theta": null`` imports the same. ``model.rope=false``
    without ``model.nope`` (learned positions) is still refused."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")
    _edit_config(tmp_path / "hf", rope_parameters={"rope_type": "default", "rope_theta": None})
    hf = transformers.OlmoHybridForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.model.rotary_emb is None
    assert run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours") == 0
    model_cfg = TrainConfig.load(tmp_path / "ours" / "config.yaml").model
    assert (model_cfg.nope, model_cfg.rope) == (True, False)
    ours = _ours(tmp_path / "ours")
    assert "transformer.wpe.weight" not in ours.state_dict()
    _assert_same_logits(ours, hf)
    assert run_main("convert_to_hf.py", tmp_path / "ours", tmp_path / "back") == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    assert back.config.rope_parameters["rope_theta"] is None and back.model.rotary_emb is None
    expected, actual = hf.state_dict(), back.state_dict()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)

    _edit_config(tmp_path / "hf", rope_parameters=None, rope_theta=None)  # OLMo-core's export
    assert run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours-core") == 0
    assert TrainConfig.load(tmp_path / "ours-core" / "config.yaml").model.nope

    cfg = _our_hybrid(rope=False)
    with pytest.raises(OLMoConfigurationError, match=r"model.rope=False, model.alibi=False: .*--model.nope=true"):
        hf_model_type(cfg)


@pytest.mark.parametrize(
    "values, match",
    [
        (
            {"linear_num_key_heads": 2, "linear_num_value_heads": 3},
            r"linear_num_value_heads: model.linear_attention.num_value_heads=3 must be a multiple",
        ),
        (
            {"layer_types": ["sliding_attention", L, L, F]},
            r"layer_types holds \['sliding_attention'\]: each layer",
        ),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu': our SwiGLU MLP uses silu"),
    ],
)
def test_a_config_json_our_model_cannot_hold_is_refused_naming_the_field(tmp_path, values, match):
    _hf_model().save_pretrained(tmp_path / "hf")
    _edit_config(tmp_path / "hf", **values)
    _refused(tmp_path, tmp_path / "hf", OLMoConfigurationError, match)


def _our_hybrid(**overrides):
    fields = dict(
        layer_types=[L, F],
        linear_attention=LinearAttentionConfig(),
        norm_after=True,
        layer_norm_type="rms",
        layer_norm_with_affine=True,
        attention_layer_norm=True,
        attention_layer_norm_with_affine=True,
        include_bias=False,
    )
    return tiny_model_config(**{**fields, **overrides})


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            dict(layer_types=[L]),
            r"model.layer_types=\['linear_attention'\] gives the 2 layers only linear_attention",
        ),
        (
            dict(norm_after=False),
            r"model.norm_after=false: the attention layers of OlmoHybridForCausalLM are OLMo 3's",
        ),
        (
            dict(sliding_window={"pattern": [8], "force_full_attention_on_last_layer": False}),
            r"model.sliding_window gives the full_attention layers \[1\] a window",
        ),
        (dict(attention_layer_norm=False), r"model.attention_layer_norm=False.*OlmoHybridForCausalLM always has"),
    ],
)
def test_what_olmo_hybrid_cannot_hold_is_refused_naming_the_key(overrides, match):
    if "sliding_window" in overrides:
        from olmo.config import SlidingWindowConfig

        overrides = {"sliding_window": SlidingWindowConfig(**overrides["sliding_window"])}
    with pytest.raises(OLMoConfigurationError, match=match) as refusal:
        hf_model_type(_our_hybrid(**overrides))
    assert "\n" not in str(refusal.value)


def test_a_window_on_linear_layers_only_exports(tmp_path):
    """OLMo-core's hybrid keeps OLMo 3's window pattern [W, W, W, -1], which on [L, L, L, F] windows no attention
    layer: transformers' model (no windows) computes the same, so it exports."""
    from olmo.config import SlidingWindowConfig

    cfg = _our_hybrid(
        layer_types=[L, L, L, F], n_layers=4, sliding_window=SlidingWindowConfig(pattern=[8, 8, 8, -1])
    )
    assert hf_model_type(cfg) == "olmo_hybrid" and hf_config_kwargs(cfg)["layer_types"] == [L, L, L, F]


@pytest.fixture(scope="module")
def trained_hybrid(tmp_path_factory):
    """A tiny OLMo Hybrid run (attention first, GQA in both layer kinds, YaRN, document masking) trained 4 steps,
    exported by hf_export."""
    root = tmp_path_factory.mktemp("hybrid")
    write_byte_memmap(root / "a.npy", 20_000)
    settings = {
        "max_duration": 4,
        "save_interval_unsharded": 4,
        "hf_export": {"enabled": True, "dtype": "float32", "every_unsharded": True},
        "tokenizer.identifier": str(write_byte_tokenizer(root / "tokenizer.json")),
        "model.norm_after": True,
        "model.layer_norm_type": "rms",
        "model.attention_layer_norm": True,
        "model.n_layers": 3,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.max_sequence_length": SEQ,
        "model.layer_types": [F, L],
        "model.linear_attention": {
            "num_key_heads": 2,
            "num_value_heads": 4,
            "key_head_dim": 8,
            "value_head_dim": 8,
        },
        "model.rope_scaling": {"name": "yarn", "factor": 2.0, "old_context_len": 16},
        "data.generate_doc_lengths": True,
    }
    config = write_config(root / "config.yaml", tiny_config_dict(root / "run", [str(root / "a.npy")], **settings))
    assert run_train(config) == 0
    return root / "run"


def test_a_trained_hybrid_exports_with_equal_logits_and_imports_back(trained_hybrid, tmp_path):
    hf_dir = trained_hybrid / "step4-hf"
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["OlmoHybridForCausalLM"] and config["layer_types"] == [F, L, F]
    assert (config["linear_num_key_heads"], config["linear_num_value_heads"], config["num_key_value_heads"]) == (
        2,
        4,
        2,
    )
    assert config["rope_parameters"]["rope_type"] == "yarn"
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    checkpoint = trained_hybrid / "step4-unsharded"
    ours = _ours(checkpoint)
    _assert_same_logits(ours, hf)

    # convert_to_hf.py writes the same weights as hf_export did; importing them gives back our checkpoint's.
    assert run_main("convert_to_hf.py", checkpoint, tmp_path / "hf") == 0
    exported, again = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in exported)
    assert run_main("convert_from_hf.py", hf_dir, tmp_path / "ours") == 0
    before, after = ours.state_dict(), _ours(tmp_path / "ours").state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    imported = TrainConfig.load(tmp_path / "ours" / "config.yaml").model
    assert imported.layer_kinds() == [F, L, F] and imported.rope_scaling.factor == 2.0


def _released_config(**changes):
    config = json.loads((FIXTURE / "config.json").read_text())
    return {**config, **changes}


def test_the_released_7b_config_json_gives_olmo_cores_model(tmp_path):
    """OLMo-Hybrid-7B's config.json (no RoPE after its long-context stage: model.nope) and the same with the RoPE of
    its pretraining and midtraining stages (theta 500,000) pass every check of convert_from_hf.py up to the weights,
    which the directory lacks, and give OLMo-core's model, sized on the meta device."""
    with pytest.raises(OLMoConfigurationError, match=r"it has no model.safetensors"):
        run_main("convert_from_hf.py", FIXTURE, tmp_path / "out")
    released = model_config_from_hf(read_hf_config(FIXTURE))
    assert (released.nope, released.rope) == (True, False)
    (tmp_path / "hf").mkdir()
    with_rope = _released_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(with_rope))
    with pytest.raises(OLMoConfigurationError, match=r"it has no model.safetensors"):
        run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "out")  # the config passed; weights are next
    _assert_nothing_written(tmp_path, "out")
    hf = read_hf_config(tmp_path / "hf")
    cfg = model_config_from_hf(hf)
    assert cfg.layer_types == [L, L, L, F] and cfg.layer_kinds() == [L, L, L, F] * 8
    assert cfg.linear_attention == LinearAttentionConfig(
        num_key_heads=30, num_value_heads=30, key_head_dim=96, value_head_dim=192, conv_kernel_size=4
    )
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers) == (3840, 30, None, 32)
    assert (cfg.effective_mlp_hidden_size, cfg.effective_embedding_size) == (22016, 100352)
    assert (cfg.max_sequence_length, cfg.weight_tying) == (65536, False)
    assert (cfg.rope, cfg.rope_theta, cfg.norm_after, cfg.layer_norm_eps) == (True, 500000, True, 1e-6)

    # The parameters, counted from first principles, on our model and on transformers' (both on the meta device).
    d, v, mlp = 3840, 100352, 11008
    norms_and_mlp = 3 * d * mlp + 2 * d
    attention = 4 * d * d + 2 * d + norms_and_mlp
    keys, values = 30 * 96, 30 * 192
    linear = (
        d * (2 * keys + 2 * values + 2 * 30) + values * d + 4 * (2 * keys + values) + 2 * 30 + 192 + norms_and_mlp
    )
    expected = 2 * v * d + 8 * attention + 24 * linear + d
    with torch.device("meta"):
        ours = OLMo(cfg, init_params=False)
        theirs = transformers.OlmoHybridForCausalLM(hf)
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters()) == expected
    assert 7.0e9 < expected < 7.5e9

    # Exported again (config only): the released numbers, with the RoPE it was given.
    kwargs = hf_config_kwargs(cfg)
    released = _released_config()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert kwargs[key] == released[key], key
    for key in [k for k in released if k.startswith("linear_") and k in kwargs] + ["layer_types", "rms_norm_eps"]:
        assert kwargs[key] == released[key], key
