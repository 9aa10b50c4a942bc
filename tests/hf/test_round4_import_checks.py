"""Imports the trainer would refuse are refused at import (issue 50): a config.json whose converted config fails the
trainer's own validation (NaN or infinite RoPE factors and loss weights, scales past a million, negative scales), and
weights holding NaN or infinite values, stop ``convert_from_hf.py`` before anything is written, in one paragraph that
names config.json's field, or the tensor and its file; a config.json, index or weight file that is a FIFO, a device
or too large is refused without being read. The export refuses a checkpoint whose model section a launch refuses, or
whose weights are not finite. And the first hour: ``convert_to_hf.py`` without the run's
tokenizer tells one story, and both commands' ``--help`` list every family the code converts."""

import json
import logging
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_hf_damaged import _edit_config, _edit_weights, _refused, _save_hf

from olmo.checkpoint.save import write_imported_checkpoint
from olmo.config import RopeScalingConfig, TrainConfig
from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError
from olmo.hf import HF_MODEL_TYPES, conversion_checks
from olmo.hf import files as hf_files
from olmo.model import OLMo
from olmo.testing import run_main, tiny_config_dict

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
OLMO2 = {
    "model.norm_after": True,
    "model.layer_norm_type": "rms",
    "model.attention_layer_norm": True,
    "model.init_fn": "normal",
}
"""What makes the tiny config an OLMo-2 architecture transformers can hold."""
LLAMA3 = {**YARN, "rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory) -> Path:
    """A tiny transformers Olmo2 model directory (no tokenizer), saved once; each test edits a copy."""
    return _save_hf(tmp_path_factory.mktemp("round4-hf") / "olmo2")


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory) -> Path:
    config = transformers.OlmoeConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        eos_token_id=256,
        pad_token_id=256,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("round4-hf") / "olmoe"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "hf"))


CONFIGS = [
    # The issue's examples: RoPE scaling factors and loss weights that are not finite.
    (
        "rope-factor-inf",
        {"rope_parameters": {**YARN, "factor": float("inf")}},
        "factor=inf must be a finite number",
    ),
    (
        "yarn-attention-factor-nan",
        {"rope_parameters": {**YARN, "attention_factor": float("nan")}},
        "attention_factor=nan",
    ),
    (
        "yarn-beta-fast-inf",
        {"rope_parameters": {**YARN, "beta_fast": float("inf")}},
        "beta_fast=inf must be a finite",
    ),
    ("yarn-beta-slow-nan", {"rope_parameters": {**YARN, "beta_slow": float("nan")}}, "beta_slow=nan"),
    (
        "llama3-low-freq-inf",
        {"rope_parameters": {**LLAMA3, "low_freq_factor": float("-inf")}},
        "low_freq_factor=-inf",
    ),
    # Absurd but finite scales: the bound every launch applies.
    (
        "yarn-attention-factor-1e300",
        {"rope_parameters": {**YARN, "attention_factor": 1e300}},
        "attention_factor=1e\\+300 is beyond 1,000,000",
    ),
    ("yarn-factor-1e9", {"rope_parameters": {**YARN, "factor": 1e9}}, "factor=1e\\+09 is beyond 1,000,000"),
    # Fields outside RoPE, named by their config.json name.
    (
        "rms-norm-eps-nan",
        {"rms_norm_eps": float("nan")},
        "rms_norm_eps: model.layer_norm_eps=nan must be a finite",
    ),
    ("rms-norm-eps-1e300", {"rms_norm_eps": 1e300}, "rms_norm_eps: model.layer_norm_eps=1e\\+300 is beyond"),
    ("initializer-range-inf", {"initializer_range": float("inf")}, "initializer_range: model.init_std=inf"),
    (
        "initializer-range-negative",
        {"initializer_range": -0.02},
        "initializer_range: model.init_std=-0.02 must be a positive",
    ),
    (
        "attention-dropout-nan",
        {"attention_dropout": float("nan")},
        "attention_dropout: model.attention_dropout=nan must be in",
    ),
    ("positions-2e40", {"max_position_embeddings": 2**40}, "max_position_embeddings: model.max_sequence_length="),
    (
        "eos-outside",
        {"eos_token_id": 10**9},
        "eos_token_id: model.eos_token_id=1000000000 is outside the embedding",
    ),
]


@pytest.mark.parametrize("values, match", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_a_config_json_the_trainer_would_refuse_is_refused_at_import(tmp_path, olmo2_dir, values, match):
    hf = _copy(olmo2_dir, tmp_path)
    _edit_config(hf, **values)
    message = _refused(tmp_path, hf, OLMoConfigurationError, match)
    assert "config.json" in message and "nothing was written" in message


@pytest.mark.parametrize(
    "value, match",
    [
        (float("inf"), "router_aux_loss_coef: model.moe.lb_loss_weight=inf must be a finite number"),
        (float("nan"), "router_aux_loss_coef: model.moe.lb_loss_weight=nan must be a finite number"),
        (1e300, "router_aux_loss_coef: model.moe.lb_loss_weight=1e\\+300 is beyond 1,000,000"),
    ],
)
def test_a_router_loss_weight_the_trainer_would_refuse_is_refused_at_import(tmp_path, olmoe_dir, value, match):
    hf = _copy(olmoe_dir, tmp_path)
    _edit_config(hf, router_aux_loss_coef=value)
    message = _refused(tmp_path, hf, OLMoConfigurationError, match)
    assert f"'{hf / 'config.json'}'" in message


def test_what_the_import_refuses_is_what_a_launch_refuses(tmp_path, olmo2_dir):
    """The same check: a config.yaml written from an accepted import validates; the refused value, put into it,
    is refused by the trainer's validation in the same words."""
    run_main("convert_from_hf.py", olmo2_dir, tmp_path / "ours")
    config = tmp_path / "ours" / "config.yaml"
    TrainConfig.load(config).validate()
    with pytest.raises(OLMoConfigurationError, match="model.init_std=inf must be a finite number"):
        TrainConfig.load(config, ["--model.init_std=inf"]).validate()


def _nan_everywhere(name):
    def edit(state):
        state[name] = torch.full_like(state[name], float("nan"))

    return edit


def test_all_nan_weights_are_refused_naming_the_tensor_and_file(tmp_path, olmo2_dir):
    hf = _copy(olmo2_dir, tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    _edit_weights(hf, _nan_everywhere(name))
    message = _refused(tmp_path, hf, OLMoCheckpointError, "is damaged: all its 2,048 values are NaN or infinite")
    assert name in message and f"'{hf / 'model.safetensors'}'" in message and "Nothing was written" in message


def test_one_infinite_value_in_bfloat16_is_refused(tmp_path, olmo2_dir):
    hf = _copy(olmo2_dir, tmp_path)
    name = "model.embed_tokens.weight"

    def one_inf(state):
        for key in state:
            state[key] = state[key].to(torch.bfloat16)
        state[name][3, 5] = float("-inf")

    _edit_weights(hf, one_inf)
    message = _refused(tmp_path, hf, OLMoCheckpointError, "1 of its 10,240 values are NaN or infinite")
    assert name in message


def test_a_nan_in_one_shard_is_refused_naming_that_shard(tmp_path):
    hf = _save_hf(tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.norm.weight"
    shard = hf / index[name]
    state = safetensors_torch.load_file(shard)
    state[name][0] = float("nan")
    safetensors_torch.save_file(state, shard, metadata={"format": "pt"})
    message = _refused(tmp_path, hf, OLMoCheckpointError, "1 of its 32 values")
    assert name in message and f"'{shard}'" in message


def test_a_nan_in_pytorch_model_bin_is_refused(tmp_path, olmo2_dir):
    hf = _copy(olmo2_dir, tmp_path)
    state = safetensors_torch.load_file(hf / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name][:, 0] = float("nan")
    torch.save(state, hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    message = _refused(tmp_path, hf, OLMoCheckpointError, "32 of its 1,024 values")
    assert name in message and "pytorch_model.bin" in message


def test_an_expert_weight_with_nan_is_refused(tmp_path, olmoe_dir):
    hf = _copy(olmoe_dir, tmp_path)
    name = next(k for k in safetensors_torch.load_file(hf / "model.safetensors") if ".experts.3." in k)
    _edit_weights(hf, _nan_everywhere(name))
    assert name in _refused(tmp_path, hf, OLMoCheckpointError, "all its")


def test_the_count_takes_slices_of_bounded_size(monkeypatch):
    monkeypatch.setattr(conversion_checks, "_SLICE", 7)
    tensor = torch.zeros(10, 10)
    tensor[0, 0], tensor[5, 6], tensor[9, 9] = float("nan"), float("inf"), float("-inf")
    assert conversion_checks.non_finite_count(tensor) == 3
    assert conversion_checks.non_finite_count(tensor.T) == 3  # not contiguous
    assert conversion_checks.non_finite_count(torch.zeros(50, dtype=torch.float8_e4m3fn)) == 0
    assert conversion_checks.non_finite_count(torch.full((50,), float("nan")).to(torch.float8_e4m3fn)) == 50


def test_export_without_the_runs_tokenizer_tells_one_true_story(tmp_path, olmo2_dir, caplog):
    run_main("convert_from_hf.py", olmo2_dir, tmp_path / "ours")  # no tokenizer.json: config.yaml names another
    with caplog.at_level(logging.INFO):
        assert run_main("convert_to_hf.py", tmp_path / "ours", tmp_path / "back") == 0
    text = caplog.text
    assert "Nothing was written" not in text and "nothing was written" not in text, text
    assert (
        "Exporting without tokenizer files (config.json, generation_config.json and the weights are written"
        in text
    )
    assert "no tokenizer files) in" in text and "--tokenizer" in text
    assert (tmp_path / "back" / "config.json").is_file() and not (tmp_path / "back" / "tokenizer.json").exists()

    with pytest.raises(OLMoConfigurationError, match="Nothing was written") as e:  # asked for: refused
        run_main(
            "convert_to_hf.py", tmp_path / "ours", tmp_path / "back2", "--tokenizer", tmp_path / "missing.json"
        )
    assert "\n" not in str(e.value) and not (tmp_path / "back2").exists()


@pytest.mark.parametrize("script", ["convert_from_hf.py", "convert_to_hf.py"])
def test_help_lists_every_family_the_code_converts(script, capsys):
    with pytest.raises(SystemExit):
        run_main(script, "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert len(HF_MODEL_TYPES) == 6  # olmo, olmo2, olmo3, olmoe, flex_olmo, olmo_hybrid
    for model_type, name in HF_MODEL_TYPES.items():
        assert f"{name} ({model_type})" in text, (name, text)


@contextmanager
def _fifo(path: Path):
    """A named pipe at ``path``; should the code under test block opening it, a writer opens it after 10 s so that
    the test fails instead of hanging."""
    os.mkfifo(path)

    def unblock():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # no reader waiting: nothing blocked

    timer = threading.Timer(10, unblock)
    timer.start()
    try:
        yield path
    finally:
        timer.cancel()


def _first_shard(hf: Path) -> Path:
    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    return hf / sorted(set(weight_map.values()))[0]


def test_a_weight_file_that_is_a_fifo_or_a_device_is_refused_without_reading_it(tmp_path):
    hf = _save_hf(tmp_path / "hf", max_shard_size="40KB")
    shard = _first_shard(hf)
    shard.unlink()
    with _fifo(shard):
        message = _refused(tmp_path, hf, OLMoCheckpointError, "is a named pipe \\(FIFO\\), not a regular file")
    assert f"'{shard}'" in message
    shard.unlink()
    shard.symlink_to("/dev/zero")
    _refused(tmp_path, hf, OLMoCheckpointError, "model-00001-of-.* is a character device")
    index = hf / "model.safetensors.index.json"
    index.unlink()
    index.symlink_to("/dev/zero")
    _refused(tmp_path, hf, OLMoCheckpointError, "The safetensors index .* is a character device")


def test_a_config_json_that_is_a_fifo_too_large_or_too_deep_is_refused(tmp_path, olmo2_dir, monkeypatch):
    hf = _copy(olmo2_dir, tmp_path)
    config = hf / "config.json"
    text = config.read_text()
    config.unlink()
    with _fifo(config):
        _refused(tmp_path, hf, OLMoConfigurationError, "config.json of .* is a named pipe \\(FIFO\\)")
    config.unlink()
    monkeypatch.setattr(hf_files, "JSON_FILE_LIMIT", 4096)
    config.write_text(text[:-1] + ', "junk": "' + "x" * 5000 + '"}')
    _refused(tmp_path, hf, OLMoConfigurationError, "config.json of .* is 5.5 KiB, over its limit of 4.0 KiB")
    monkeypatch.setattr(hf_files, "JSON_FILE_LIMIT", 1 << 20)
    config.write_text('{"model_type": "olmo2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _refused(tmp_path, hf, OLMoConfigurationError, "its config.json is not a JSON object")


def test_a_tokenizer_json_that_is_a_fifo_is_left_out_with_a_warning(tmp_path, olmo2_dir, caplog):
    hf = _copy(olmo2_dir, tmp_path)
    with _fifo(hf / "tokenizer.json"), caplog.at_level(logging.WARNING):
        assert run_main("convert_from_hf.py", hf, tmp_path / "ours") == 0
    assert f"Ignoring '{hf / 'tokenizer.json'}'" in caplog.text and "no tokenizer.json that loads" in caplog.text


def _our_checkpoint(path: Path, edit_config=None, edit_model=None) -> Path:
    """One of our checkpoints of a tiny OLMo-2 model, its config or weights damaged as a checkpoint written before
    today's checks (or edited and committed again) can be."""
    cfg = TrainConfig.from_dict(tiny_config_dict(path.parent / "run", ["a.npy"], **OLMO2))
    if edit_config is not None:
        edit_config(cfg)
    torch.manual_seed(0)
    model = OLMo(cfg.model)
    if edit_model is not None:
        with torch.no_grad():
            edit_model(model)
    return write_imported_checkpoint(path, cfg, model)


def test_a_checkpoint_whose_model_config_a_launch_refuses_is_not_exported(tmp_path):
    def absurd(cfg):
        cfg.model.rope_scaling = RopeScalingConfig(factor=4.0, old_context_len=16, attention_factor=1e300)

    checkpoint = _our_checkpoint(tmp_path / "ours", edit_config=absurd)
    with pytest.raises(OLMoConfigurationError) as e:
        run_main("convert_to_hf.py", checkpoint, tmp_path / "back")
    message = str(e.value)
    assert "model.rope_scaling.attention_factor=1e+300 is beyond 1,000,000" in message and "\n" not in message
    assert f"checkpoint '{checkpoint}'" in message and "nothing was written" in message
    assert not (tmp_path / "back").exists() and not list(tmp_path.glob(".back.tmp-*"))


def test_a_checkpoint_with_nan_weights_is_not_exported(tmp_path):
    def nan(model):
        model.transformer.blocks[1].ff_out.weight[0, :3] = float("nan")

    checkpoint = _our_checkpoint(tmp_path / "ours", edit_model=nan)
    with pytest.raises(OLMoCheckpointError) as e:
        run_main("convert_to_hf.py", checkpoint, tmp_path / "back")
    message = str(e.value)
    assert "transformer.blocks.1.ff_out.weight" in message and "3 of its" in message, message
    assert "Export an earlier checkpoint" in message and not (tmp_path / "back").exists()
