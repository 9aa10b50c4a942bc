"""Mixture-of-experts models both ways with transformers (issue 38): random ``OlmoeForCausalLM`` and
``FlexOlmoForCausalLM`` models convert to ours with logits within 1e-5 and the same greedy tokens (our KV cache), and
back to the same weights; transformers 5's fused expert tensors read as the per-expert files do; a trained MoE run
exports through ``hf_export`` and transformers computes what our model does; what transformers cannot hold is
refused before anything is written."""

import json

import pytest
import torch
from test_hf import _assert_nothing_written, _ours
from test_hf_olmo3 import _assert_same_greedy_tokens, _assert_same_logits

from olmo.checkpoint.save import write_unsharded_checkpoint
from olmo.config import TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.hf import from_hf_state, model_config_from_hf
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


def _hf_model(model_type: str, **options):
    """A random transformers MoE model (3 layers, d_model 64, 4 heads, 6 experts of width 24, 2 per token), every
    weight random (norms around 1, a decisive router) so that no routing decision is a near tie."""
    fields = dict(
        vocab_size=EMBEDDING,
        hidden_size=64,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        eos_token_id=BYTE_EOS,
        pad_token_id=BYTE_EOS,
        tie_word_embeddings=False,
    )
    config_class = transformers.OlmoeConfig if model_type == "olmoe" else transformers.FlexOlmoConfig
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_class(**{**fields, **options}), attn_implementation="eager"
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.05)
    return model.eval()


VARIANTS = {
    "olmoe": ("olmoe", {}),
    "olmoe-gqa-normtopk": ("olmoe", dict(num_key_value_heads=2, norm_topk_prob=True)),
    "flex_olmo": ("flex_olmo", {}),
    "flex_olmo-tied": ("flex_olmo", dict(tie_word_embeddings=True, num_experts_per_tok=3)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformers_moe_to_ours_and_back_is_exact(variant, tmp_path):
    model_type, options = VARIANTS[variant]
    hf = _hf_model(model_type, **options)
    hf.save_pretrained(tmp_path / "hf")
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")

    assert run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours") == 0
    model_cfg = TrainConfig.load(tmp_path / "ours" / "config.yaml").model
    assert model_cfg.moe is not None and model_cfg.is_moe
    assert (model_cfg.moe.num_experts, model_cfg.moe.top_k, model_cfg.moe.hidden_size) == (
        6,
        options.get("num_experts_per_tok", 2),
        24,
    )
    assert model_cfg.norm_after == (model_type == "flex_olmo")
    assert model_cfg.moe.norm_topk_prob == options.get("norm_topk_prob", False)
    ours = _ours(tmp_path / "ours")
    _assert_same_logits(ours, hf, seq_len=24)
    _assert_same_greedy_tokens(ours, hf, prompt_len=6, n=20)

    assert run_main("convert_to_hf.py", tmp_path / "ours", tmp_path / "back") == 0
    assert json.loads((tmp_path / "back/config.json").read_text())["model_type"] == model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", local_files_only=True, attn_implementation="eager"
    ).eval()
    expected, actual = hf.state_dict(), back.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_fused_and_per_expert_weights_read_the_same():
    """transformers 5 holds each layer's experts as two fused tensors; the released files hold them one by one."""
    hf = _hf_model("olmoe")
    fused = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    cfg = model_config_from_hf(hf.config, vocab_size=BYTE_VOCAB)
    ours = from_hf_state(fused, cfg, "memory")
    per_expert = {k: v for k, v in fused.items() if ".mlp.experts." not in k}
    for i in range(3):
        gate_up, down = (
            fused[f"model.layers.{i}.mlp.experts.gate_up_proj"],
            fused[f"model.layers.{i}.mlp.experts.down_proj"],
        )
        for j in range(6):
            gate, up = gate_up[j].chunk(2, dim=0)
            per_expert[f"model.layers.{i}.mlp.experts.{j}.gate_proj.weight"] = gate
            per_expert[f"model.layers.{i}.mlp.experts.{j}.up_proj.weight"] = up
            per_expert[f"model.layers.{i}.mlp.experts.{j}.down_proj.weight"] = down[j]
    again = from_hf_state(per_expert, cfg, "memory")
    assert ours.keys() == again.keys() and all(torch.equal(ours[k], again[k]) for k in ours)
    del per_expert["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(OLMoConfigurationError, match=r"missing \['model.layers.1.mlp.experts.5.up_proj.weight'\]"):
        from_hf_state(per_expert, cfg, "memory")
    per_expert["model.layers.1.mlp.experts.5.up_proj.weight"] = torch.zeros(24, 63)
    with pytest.raises(OLMoConfigurationError, match="expert weights of layer 1 in 'memory' do not fit together"):
        from_hf_state(per_expert, cfg, "memory")


MOE_RUN = {
    "model.moe": {"num_experts": 4, "top_k": 2, "hidden_size": 16},
    "model.layer_norm_type": "rms",
    "model.attention_layer_norm": True,
}


def test_a_trained_moe_model_exports_with_equal_logits_and_tokens(tmp_path):
    write_byte_memmap(tmp_path / "a.npy", 20_000)
    settings = {
        **MOE_RUN,
        "max_duration": 4,
        "save_interval_unsharded": 4,
        "hf_export": {"enabled": True, "dtype": "float32", "every_unsharded": True},
        "tokenizer.identifier": str(write_byte_tokenizer(tmp_path / "tokenizer.json")),
    }
    config = write_config(
        tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")], **settings)
    )
    assert run_train(config) == 0
    hf_dir = tmp_path / "run/step4-hf"
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "olmoe"
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    ours = _ours(tmp_path / "run/step4-unsharded")
    _assert_same_logits(ours, hf, seq_len=32)
    _assert_same_greedy_tokens(ours, hf, prompt_len=6, n=20)


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            {"model.moe.shared_expert_hidden_size": 8},
            "model.moe.shared_expert_hidden_size=8: OlmoeForCausalLM has no shared expert",
        ),
        (
            {"model.sliding_window": {"pattern": [8, -1]}},
            "model.sliding_window with model.moe: OlmoeForCausalLM has no",
        ),
        ({"model.layer_norm_type": "default"}, "OlmoeForCausalLM uses RMSNorm with weights"),
        (
            {"model.norm_after": True, "model.clip_qkv": 1.0},
            "model.clip_qkv=1.0: FlexOlmoForCausalLM has no clip_qkv",
        ),
    ],
)
def test_what_transformers_cannot_hold_is_refused_before_anything_is_written(tmp_path, extra, match):
    settings = {**MOE_RUN, "model.moe": {**MOE_RUN["model.moe"]}}
    for key, value in extra.items():
        if key.startswith("model.moe."):
            settings["model.moe"][key.removeprefix("model.moe.")] = value
        else:
            settings[key] = value
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, [str(tmp_path / "a.npy")], **settings))
    cfg.tokenizer.identifier = str(write_byte_tokenizer(tmp_path / "tokenizer.json"))
    cfg.save(tmp_path / "c.yaml")
    write_unsharded_checkpoint(tmp_path / "ckpt", OLMo(cfg.model), None, {}, tmp_path / "c.yaml", step=0)
    with pytest.raises(OLMoConfigurationError, match=match) as refusal:
        run_main("convert_to_hf.py", tmp_path / "ckpt", tmp_path / "out")
    assert "\n" not in str(refusal.value)
    _assert_nothing_written(tmp_path, "out")


def test_an_olmoe_model_with_clip_qkv_is_refused_on_import(tmp_path):
    _hf_model("olmoe", clip_qkv=0.5).save_pretrained(tmp_path / "hf")
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(
        OLMoConfigurationError, match="clip_qkv=0.5: transformers' OlmoeForCausalLM clamps"
    ) as refusal:
        run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours")
    assert "\n" not in str(refusal.value)
    _assert_nothing_written(tmp_path, "ours")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_experts_per_tok", 7, "num_experts=6 and num_experts_per_tok=7 must satisfy"),
        ("num_experts", 0, "num_experts=0 must be a positive whole number"),
        ("num_experts", "many", "is damaged; nothing was written: .*'num_experts'"),
    ],
)
def test_a_damaged_expert_count_is_refused_naming_it(tmp_path, field, value, match):
    _hf_model("olmoe").save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf/config.json").read_text())
    config[field] = value
    (tmp_path / "hf/config.json").write_text(json.dumps(config))
    write_byte_tokenizer(tmp_path / "hf" / "tokenizer.json")
    with pytest.raises(OLMoConfigurationError, match=match):
        run_main("convert_from_hf.py", tmp_path / "hf", tmp_path / "ours")
    _assert_nothing_written(tmp_path, "ours")
