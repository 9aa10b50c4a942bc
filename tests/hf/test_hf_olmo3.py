"""OLMo 3 both ways with transformers: ``Olmo3ForCausalLM`` (sliding-window layers, YaRN / llama3 RoPE scaling on
the full-attention ones, GQA) and ``Olmo2ForCausalLM`` with RoPE scaling convert to our model and back exactly:
the same logits as the real transformers model on the same weights (fp32, sequences longer than the window), the
same greedy tokens as its ``generate`` past the window, the same weights after a round trip, also after training;
what our model cannot hold is refused before anything is written."""

import json
import logging

import pytest
import torch
from test_hf import _assert_nothing_written, _ours
from test_hf_damaged import _edit_config, _refused

from olmo.checkpoint.save import write_unsharded_checkpoint
from olmo.config import RopeScalingConfig, SlidingWindowConfig, TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.hf import hf_config_kwargs, model_config_from_hf
from olmo.hf.files import read_hf_config
from olmo.hf.olmo3 import shortest_pattern
from olmo.model import OLMo
from olmo.testing import (
    BYTE_EOS,
    BYTE_VOCAB,
    run_main,
    run_train,
    tiny_config_dict,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)

transformers = pytest.importorskip("transformers")

EMBEDDING = 320
W = 8
"""The window of the random models: their sequences are five times as long."""
S, F = "sliding_attention", "full_attention"
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0)
LLAMA3 = dict(
    rope_type="llama3", factor=8.0, original_max_position_embeddings=16, low_freq_factor=1.0, high_freq_factor=4.0
)


def _hf_config(model_type: str = "olmo3", full: dict | None = None, theta: float = 500.0, **options):
    """A transformers config: 4 layers, d_model 64, 4 heads of 16 channels, 64 positions, untied; ``full`` is the
    RoPE of the full-attention layers (plain by default)."""
    rope = {"rope_type": "default", **(full or {}), "rope_theta": theta}
    fields = dict(
        vocab_size=EMBEDDING,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        eos_token_id=BYTE_EOS,
        pad_token_id=BYTE_EOS,
        tie_word_embeddings=False,
    )
    if model_type == "olmo3":
        fields.update(
            sliding_window=W, rope_parameters={F: rope, S: {"rope_type": "default", "rope_theta": theta}}
        )
        return transformers.Olmo3Config(**{**fields, **options})
    return transformers.Olmo2Config(**{**fields, **options}, rope_parameters=rope)


def _hf_model(**options):
    """A random transformers model of :func:`_hf_config`, its norm weights random too."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(**options), attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def _assert_same_logits(ours: OLMo, hf, seq_len: int = 5 * W) -> float:
    """Our logits equal transformers' within 1e-5 on a (2, seq_len) batch (else the positions that differ);
    returns the largest difference."""
    ids = torch.randint(0, BYTE_VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_logits, hf_logits = ours(ids).logits, hf(ids).logits
    assert ours_logits.shape == hf_logits.shape == (2, seq_len, EMBEDDING)
    diff = (ours_logits - hf_logits).abs()
    if not diff.max() <= 1e-5:
        bad = (diff.amax(dim=(0, 2)) > 1e-5).nonzero().flatten().tolist()
        pytest.fail(
            f"logits differ by up to {diff.max():.3g}, at positions {bad[:10]}{'...' if len(bad) > 10 else ''}"
        )
    return float(diff.max())


def _assert_same_greedy_tokens(ours: OLMo, hf, prompt_len: int = W + 4, n: int = 28) -> None:
    """``OLMo.generate`` (KV cache) continues a prompt longer than the window by ``n`` tokens exactly as
    transformers' ``generate`` (its sliding-window cache) does; EOS is held back until then on both sides."""
    prompt = torch.randint(0, BYTE_VOCAB, (2, prompt_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            use_cache=True,
            max_new_tokens=n,
            min_new_tokens=n,
        )[:, prompt_len:]
        generated = ours.generate(prompt, max_steps=n, min_steps=n).token_ids[:, 0]
    assert torch.equal(generated, expected), (generated, expected)


VARIANTS = {
    # OLMo 3's layout: three windowed layers, then full attention (OLMo-core: [W, W, W, -1], last layer forced).
    "window-last-forced": (dict(layer_types=[S, S, S, F]), ([W], False, True), None),
    "window-first-forced-tied": (
        dict(layer_types=[F, S, S, S], tie_word_embeddings=True),
        ([W], True, False),
        None,
    ),
    "yarn-all-full": (dict(layer_types=[F] * 4, full=YARN), None, "yarn"),
    # YaRN with DeepSeek's mscale pair instead of an attention factor, on OLMo 3's layout.
    "yarn-window-mscale": (
        dict(layer_types=[S, S, S, F], full={**YARN, "mscale": 1.5, "mscale_all_dim": 0.5}),
        ([W], False, True),
        "yarn",
    ),
    "llama3-window": (dict(layer_types=[S, F, S, F], full=LLAMA3), ([W, -1], False, True), "llama3"),
    # The 32B's shape: GQA (8 key/value heads for 40 query heads there), untied, YaRN with its attention factor.
    "gqa-yarn-window": (
        dict(layer_types=[S, S, S, F], num_key_value_heads=2, full={**YARN, "attention_factor": 1.25}),
        ([W], False, True),
        "yarn",
    ),
    "olmo2-yarn": (dict(model_type="olmo2", full=YARN), None, "yarn"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_olmo3_to_ours_and_back_is_exact(variant, tmp_path):
    options, pattern, scaling = VARIANTS[variant]
    hf = _hf_model(**options)
    hf.save_pretrained(tmp_path / "hf")
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")

    assert run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours") == 0
    model_cfg = TrainConfig.load(tmp_path / "ours" / "config.yaml").model
    window = model_cfg.sliding_window
    if pattern is None:
        assert window is None
    else:
        flags = (window.force_full_attention_on_first_layer, window.force_full_attention_on_last_layer)
        assert (window.pattern, *flags) == pattern
    assert (model_cfg.rope_scaling and model_cfg.rope_scaling.name) == scaling
    assert model_cfg.n_kv_heads == options.get("num_key_value_heads")
    ours = _ours(tmp_path / "ours")
    _assert_same_logits(ours, hf)
    _assert_same_greedy_tokens(ours, hf)

    assert run_main("convert_to_hf.py", tmp_path / "ours", tmp_path / "back") == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", local_files_only=True, attn_implementation="eager"
    ).eval()
    assert type(back).__name__ == "Olmo3ForCausalLM"  # olmo2 with scaling comes back as olmo3, all layers full
    assert back.config.layer_types == getattr(hf.config, "layer_types", [F] * 4)
    expected, actual = hf.state_dict(), back.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
    ids = torch.randint(0, BYTE_VOCAB, (1, 5 * W))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)  # the same config, read back by transformers


def _windows(layer_types: str) -> list:
    return [None if t == "F" else W for t in layer_types]


@pytest.mark.parametrize(
    "layers, pattern, first, last",
    [
        ("SSSF" * 8, [W, W, W, -1], False, True),  # OLMo 3 7B and 32B: OLMo-core's own config comes back
        ("SSSF", [W], False, True),
        ("FSSS", [W], True, False),
        ("FSSF", [W], True, True),
        ("SFSF", [W, -1], False, True),
        ("SFFS", [W, -1, -1], False, False),
        ("SSSS", [W], False, False),
    ],
)
def test_layer_types_become_the_shortest_pattern(layers, pattern, first, last):
    found = shortest_pattern(_windows(layers))
    assert found is not None
    assert (
        found.pattern,
        found.force_full_attention_on_first_layer,
        found.force_full_attention_on_last_layer,
    ) == (
        pattern,
        first,
        last,
    )
    assert shortest_pattern(_windows("FFFF")) is None


def test_no_shorter_pattern_reproduces_any_layout_of_up_to_six_layers():
    for n in range(1, 7):
        for bits in range(2**n):
            windows = [W if bits >> i & 1 else None for i in range(n)]
            found = shortest_pattern(windows)
            if found is None:
                assert windows == [None] * n
                continue
            assert found.windows(n) == windows
            for k in range(1, len(found.pattern)):
                for cycle in range(2**k):
                    shorter = [W if cycle >> j & 1 else -1 for j in range(k)]
                    for first in (False, True):
                        for last in (False, True):
                            candidate = type(found)(shorter, first, last)
                            assert candidate.windows(n) != windows, (windows, found, candidate)


@pytest.mark.parametrize(
    "rope, match",
    [
        (
            {F: {**YARN, "rope_theta": 500.0}, S: {**YARN, "rope_theta": 500.0}},
            r"rope_parameters.sliding_attention.rope_type='yarn': our model scales RoPE on the full-attention layers",
        ),
        (
            {F: {"rope_type": "default", "rope_theta": 500.0}, S: {"rope_type": "default", "rope_theta": 10000.0}},
            r"rope_parameters.sliding_attention.rope_theta=10000 but rope_parameters.full_attention.rope_theta=500",
        ),
        (
            {F: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}, S: {"rope_theta": 500.0}},
            r"rope_parameters.full_attention.rope_type='dynamic': our RoPE scaling is one of",
        ),
        (  # no RoPE: only OLMo Hybrid's attention may go without (model.nope)
            {F: {"rope_type": "default", "rope_theta": None}, S: {"rope_type": "default", "rope_theta": None}},
            r"rope_theta is null or missing: only OLMo Hybrid's attention goes without RoPE \(model.nope\)",
        ),
    ],
)
def test_rope_our_model_cannot_hold_is_refused_naming_the_key(tmp_path, rope, match):
    _hf_model(layer_types=[S, S, S, F]).save_pretrained(tmp_path / "hf")
    _edit_config(tmp_path / "hf", rope_parameters=rope)
    message = _refused(tmp_path, tmp_path / "hf", OLMoConfigurationError, match)
    assert "nothing was written" in message


@pytest.mark.parametrize("window", [0, -8, 10**30, "8"])
def test_a_window_our_config_cannot_hold_is_refused_naming_it(tmp_path, window):
    _hf_model(layer_types=[S, S, S, F]).save_pretrained(tmp_path / "hf")
    _edit_config(tmp_path / "hf", sliding_window=window)
    _refused(
        tmp_path,
        tmp_path / "hf",
        OLMoConfigurationError,
        r"sliding_window.*(must be a whole number of tokens|expected int)",
    )


def test_yarn_truncate_is_what_transformers_reads(tmp_path, caplog):
    """olmo3: transformers reads ``truncate`` from the top of rope_parameters, so a false one in full_attention is
    ignored (the model runs truncated, as ours); olmo2 honours it, and our YaRN cannot hold an unrounded range."""
    hf = _hf_config(layer_types=[S, S, S, F], full={**YARN, "truncate": False})
    with caplog.at_level(logging.WARNING):
        assert model_config_from_hf(hf).rope_scaling.name == "yarn"
    assert "full_attention.truncate=False is ignored" in caplog.text
    _hf_model(model_type="olmo2", full=YARN).save_pretrained(tmp_path / "hf")
    _edit_config(tmp_path / "hf", rope_parameters={**YARN, "rope_theta": 500.0, "truncate": False})
    _refused(
        tmp_path, tmp_path / "hf", OLMoConfigurationError, r"rope_parameters.truncate=False: transformers' YaRN"
    )


def test_a_pattern_with_two_window_sizes_is_refused_before_anything_is_written(tmp_path):
    data = [str(tmp_path / "unused.npy")]
    settings = {
        "model.norm_after": True,
        "model.layer_norm_type": "rms",
        "model.attention_layer_norm": True,
        "model.n_layers": 3,
        "model.sliding_window": {"pattern": [8, 4, -1]},
    }
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, data, **settings))
    cfg.tokenizer.identifier = str(write_byte_tokenizer(tmp_path / "tokenizer.json"))
    cfg.save(tmp_path / "c.yaml")
    write_unsharded_checkpoint(tmp_path / "ckpt", OLMo(cfg.model), None, {}, tmp_path / "c.yaml", step=0)
    with pytest.raises(
        OLMoConfigurationError, match=r"model.sliding_window.pattern=\[8, 4, -1\] gives"
    ) as refusal:
        run_main("convert_to_hf.py", tmp_path / "ckpt", tmp_path / "out")
    assert "\n" not in str(refusal.value) and "one sliding_window" in str(refusal.value)
    _assert_nothing_written(tmp_path, "out")


@pytest.fixture(scope="module")
def trained_olmo3(tmp_path_factory):
    """A tiny OLMo-3 run (OLMo 3's window layout on 4 layers, YaRN, GQA) trained 4 steps, exported by hf_export."""
    root = tmp_path_factory.mktemp("olmo3")
    write_byte_memmap(root / "a.npy", 20_000)
    settings = {
        "max_duration": 4,
        "save_interval_unsharded": 4,
        "hf_export": {"enabled": True, "dtype": "float32", "every_unsharded": True},
        "tokenizer.identifier": str(write_byte_tokenizer(root / "tokenizer.json")),
        "model.norm_after": True,
        "model.layer_norm_type": "rms",
        "model.attention_layer_norm": True,
        "model.n_layers": 4,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.sliding_window": {"pattern": [W, W, W, -1], "force_full_attention_on_last_layer": True},
        "model.rope_scaling": {"name": "yarn", "factor": 2.0, "old_context_len": 16},
    }
    config = write_config(root / "config.yaml", tiny_config_dict(root / "run", [str(root / "a.npy")], **settings))
    assert run_train(config) == 0
    return root / "run"


def test_a_trained_windowed_model_exports_with_equal_logits_and_tokens(trained_olmo3, capsys):
    hf_dir = trained_olmo3 / "step4-hf"
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["layer_types"] == [S, S, S, F] and config["sliding_window"] == W
    assert (
        config["rope_parameters"][F]["rope_type"] == "yarn"
        and config["rope_parameters"][S]["rope_type"] == "default"
    )
    assert config["max_position_embeddings"] == 32  # model.max_sequence_length
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    ours = _ours(trained_olmo3 / "step4-unsharded")
    _assert_same_logits(ours, hf, seq_len=32)
    _assert_same_greedy_tokens(ours, hf, n=20)

    # scripts/generate.py, stopping at EOS as transformers' generate does.
    prompt = "def f(a, b):\n    return"  # 24 bytes: three windows
    capsys.readouterr()
    checkpoint = trained_olmo3 / "step4-unsharded"
    assert run_main("generate.py", checkpoint, f"--prompt={prompt}", "--max_new_tokens=30", "--json") == 0
    result = json.loads(capsys.readouterr().out)
    ids = torch.tensor([result["prompt_token_ids"]])
    assert ids.size(1) > W
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30)
    expected = expected[0, ids.size(1) :].tolist()
    assert result["token_ids"] == (expected[: expected.index(BYTE_EOS)] if BYTE_EOS in expected else expected)


def test_olmo3_7b_config_json_in_transformers_4_format_imports_as_olmo_core_configures_it(tmp_path):
    """OLMo 3 7B's config.json as released (transformers 4.57: a top-level rope_theta and rope_scaling, which
    transformers 5 moves to rope_parameters.full_attention) gives OLMo-core's sliding_window and YaRN settings."""
    config = {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 65536,
        "layer_types": [S, S, S, F] * 8,
        "sliding_window": 4096,
        "rope_theta": 500000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "beta_fast": 32,
            "beta_slow": 1,
            "attention_factor": 1.2079441541679836,
        },
        "rms_norm_eps": 1e-06,
        "vocab_size": 100278,
        "eos_token_id": 100257,
        "pad_token_id": 100277,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = model_config_from_hf(read_hf_config(tmp_path))
    assert cfg.sliding_window == SlidingWindowConfig(pattern=[4096, 4096, 4096, -1])  # last layer forced
    assert cfg.rope_scaling == RopeScalingConfig(
        name="yarn",
        factor=8.0,
        old_context_len=8192,
        beta_fast=32,
        beta_slow=1,
        attention_factor=1.2079441541679836,
    )
    assert (cfg.rope_theta, cfg.max_sequence_length, cfg.n_kv_heads, cfg.norm_after) == (500000, 65536, None, True)
    exported = hf_config_kwargs(cfg)
    assert exported["layer_types"] == config["layer_types"] and exported["sliding_window"] == 4096
    assert exported["rope_parameters"][F] == {**config["rope_scaling"], "rope_theta": 500000.0}


def test_transformers_4_configs_hold_the_rope_as_its_olmo3_reads_it(monkeypatch):
    """transformers 4.57 (the oldest the hf extra admits) has no rope_parameters: its Olmo3 reads one top-level
    rope_theta, and rope_scaling on the full-attention layers. Checked against 4.57.1 itself by hand (exported
    logits equal ours, the released OLMo 3 7B config.json imports; RESEARCH_LOG 2026-11-27); here, the two branches."""
    from types import SimpleNamespace

    from olmo.hf.olmo3 import olmo3_config_kwargs, read_rope

    yarn = {k: v for k, v in YARN.items()}
    old = SimpleNamespace(
        model_type="olmo3",
        layer_types=[S, S, S, F],
        rope_theta=500000.0,
        rope_scaling=yarn,
        max_position_embeddings=64,
    )
    rope = read_rope(old)
    assert rope.problems == [] and rope.theta == 500000.0
    assert (rope.scaling.name, rope.scaling.factor, rope.scaling.old_context_len) == ("yarn", 4.0, 16)
    plain = read_rope(SimpleNamespace(**{**vars(old), "rope_scaling": None}))
    assert plain.problems == [] and plain.scaling is None

    cfg = model_config_from_hf(_hf_config(full=YARN))
    import olmo.hf.olmo3

    monkeypatch.setattr(olmo.hf.olmo3, "_transformers_4", lambda: True)
    kwargs = olmo3_config_kwargs(cfg)
    assert "rope_parameters" not in kwargs and kwargs["rope_theta"] == 500.0
    assert kwargs["rope_scaling"]["rope_type"] == "yarn" and "rope_theta" not in kwargs["rope_scaling"]
