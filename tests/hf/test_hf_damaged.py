"""Damaged or odd transformers directories: each is refused with one paragraph that names the file and the fix,
before anything is written, or (a tokenizer that does not load) converted with a warning and without it."""

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from olmo.config import TrainConfig
from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError
from olmo.testing import BYTE_EOS, run_main

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _save_hf(path: Path, **save_options) -> Path:
    config = transformers.Olmo2Config(
        vocab_size=320,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        eos_token_id=BYTE_EOS,
        pad_token_id=BYTE_EOS,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, **save_options)
    return path


def _edit_config(path: Path, **values) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(values)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    state = safetensors_torch.load_file(file)
    edit(state)
    safetensors_torch.save_file(state, file, metadata={"format": "pt"})


def _refused(tmp_path: Path, hf: Path, error, match: str) -> str:
    with pytest.raises(error, match=match) as refusal:
        run_main("convert_from_hf.py", hf, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    message = str(refusal.value)
    assert "\n" not in message.strip() and "Traceback" not in message
    return message


@pytest.mark.parametrize(
    "values, match",
    [
        ({"num_attention_heads": 0}, "num_attention_heads=0 must be a positive whole number"),
        ({"hidden_size": "wide"}, "hidden_size.*wide"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers.*2.5"),
        ({"hidden_size": 30}, "hidden_size=30 is not a multiple of num_attention_heads=4"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        ({"num_hidden_layers": 100_000_000}, "num_hidden_layers=100,000,000 is more than 4,096"),
    ],
)
def test_a_damaged_config_json_is_refused_naming_the_size(tmp_path, values, match):
    hf = _save_hf(tmp_path / "hf")
    _edit_config(hf, **values)
    message = _refused(tmp_path, hf, OLMoConfigurationError, match)
    assert "config.json" in message


def test_weights_of_another_shape_or_kind_are_refused(tmp_path):
    hf = _save_hf(tmp_path / "hf")
    name = "model.layers.1.mlp.down_proj.weight"

    def narrower(state):
        state[name] = state[name][:, :48].contiguous()

    _edit_weights(hf, narrower)
    message = _refused(tmp_path, hf, OLMoConfigurationError, "has shape")
    assert name in message and "[32, 48]" in message and "different models" in message

    hf = _save_hf(tmp_path / "hf-int8")

    def quantized(state):
        state[name] = state[name].to(torch.int8)

    _edit_weights(hf, quantized)
    message = _refused(tmp_path, hf, OLMoConfigurationError, "is int8, not floating point")
    assert name in message

    hf = _save_hf(tmp_path / "hf-qkv")
    q = "model.layers.0.self_attn.q_proj.weight"

    def mismatched_qkv(state):  # q, k, v are concatenated into one of our weights: their widths must agree
        state[q] = state[q][:, :16].contiguous()

    _edit_weights(hf, mismatched_qkv)
    message = _refused(tmp_path, hf, OLMoConfigurationError, "do not fit together")
    assert q in message


@pytest.mark.parametrize(
    "index, match",
    [
        ("{not json", "not a safetensors index"),
        ('{"metadata": {}}', "weight_map"),
        ('{"weight_map": {"lm_head.weight": "../../etc/passwd"}}', "plain names in its folder"),
        ('{"weight_map": {"lm_head.weight": 7}}', "not a safetensors index"),
        ('{"weight_map": []}', "not a safetensors index"),
    ],
)
def test_a_malformed_shard_index_is_refused(tmp_path, index, match):
    hf = _save_hf(tmp_path / "hf", max_shard_size="40KB")
    assert (hf / "model.safetensors.index.json").is_file()
    (hf / "model.safetensors.index.json").write_text(index)
    message = _refused(tmp_path, hf, OLMoCheckpointError, match)
    assert "model.safetensors.index.json" in message and "save_pretrained" in message


def test_a_tokenizer_that_does_not_load_is_left_out_with_a_warning(tmp_path, caplog):
    """The weights convert; config.yaml does not name the broken file; the export back works without it."""
    hf = _save_hf(tmp_path / "hf")
    (hf / "tokenizer.json").write_text('{"model": "truncated')
    with caplog.at_level(logging.WARNING):
        assert run_main("convert_from_hf.py", hf, tmp_path / "ours") == 0
    assert "no tokenizer.json that loads" in caplog.text
    identifier = TrainConfig.load(tmp_path / "ours" / "config.yaml").tokenizer.identifier
    assert "tokenizer.json" not in identifier

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert run_main("convert_to_hf.py", tmp_path / "ours", tmp_path / "back") == 0
    assert "Exporting without tokenizer files" in caplog.text
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True)
    original = safetensors_torch.load_file(hf / "model.safetensors")
    for name, value in back.state_dict().items():
        assert torch.equal(value, original[name]), name
    assert not (tmp_path / "back" / "tokenizer.json").exists()


def test_exported_files_are_readable_by_the_group_as_plain_writes_are(tmp_path):
    hf = _save_hf(tmp_path / "hf")
    assert run_main("convert_from_hf.py", hf, tmp_path / "ours") == 0
    old = os.umask(0o022)
    try:
        assert run_main("convert_to_hf.py", tmp_path / "ours", tmp_path / "back") == 0
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "back").iterdir()}
    assert modes["model.safetensors"] == 0o644, modes
    assert set(modes.values()) == {0o644}, modes
