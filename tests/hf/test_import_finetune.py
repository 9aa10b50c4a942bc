"""Fine-tuning an imported model as a user does it, end to end, for OLMo 3 (an ``Olmo3ForCausalLM`` directory:
windows, YaRN, GQA) and OLMo Hybrid (an ``OlmoHybridForCausalLM`` one: three Gated DeltaNet layers to one attention
layer, GQA in both): ``convert_from_hf.py`` -> ``train.py --load_path=... --reset_trainer_state`` on chat SFT data from
``prepare_sft_data.py`` (stopped halfway and resumed: the same run, bitwise) -> ``hf_export`` -> transformers loads the
result and computes the same logits as our checkpoint of it, not the original's."""

import json

import pytest
import torch
from test_hf import _ours

from olmo.config import TrainConfig
from olmo.testing import BYTE_EOS, run_main, run_train, tiny_config_dict, write_byte_tokenizer, write_config

transformers = pytest.importorskip("transformers")

W = 8
SEQ = 48
L, F = "linear_attention", "full_attention"
SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    eos_token_id=BYTE_EOS,
    pad_token_id=BYTE_EOS,
    tie_word_embeddings=False,
)
"""What both transformers models share: 4 layers of width 64, 2 key/value heads, the byte tokenizer's ids."""


def _olmo3_dir(path):
    """A random OLMo-3-shaped transformers model (4 layers, window 8 on three of them, YaRN on the last, 2 KV heads)
    with the byte tokenizer, saved as a user downloads one."""
    torch.manual_seed(0)
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0)
    config = transformers.Olmo3Config(
        **SHAPE,
        sliding_window=W,
        rope_parameters={
            "full_attention": {**yarn, "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
        },
    )
    transformers.Olmo3ForCausalLM(config).save_pretrained(path)
    write_byte_tokenizer(path / "tokenizer.json")
    return path


def _hybrid_dir(path):
    """A random OLMo-Hybrid-shaped transformers model (4 layers, [L, L, L, F], 2 key/value heads in attention, 2 key
    heads for 4 value heads in Gated DeltaNet) with the byte tokenizer."""
    torch.manual_seed(0)
    config = transformers.OlmoHybridConfig(
        **SHAPE,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=[L, L, L, F],
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    transformers.OlmoHybridForCausalLM(config).save_pretrained(path)
    write_byte_tokenizer(path / "tokenizer.json")
    return path


def _import_finetune_export(tmp_path, hf_dir, steps: int):
    """Import ``hf_dir``, fine-tune it ``steps`` steps on chats (and again stopped at half and resumed: the same
    losses), export at the end; check transformers' logits of the export are ours and not the original's; return
    the imported config and the exported directory's config.json."""
    assert run_main("convert_from_hf.py", hf_dir, tmp_path / "imported") == 0
    imported = TrainConfig.load(tmp_path / "imported" / "config.yaml")
    chats = [
        [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
        for a in range(6)
        for b in range(4)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    sft = tmp_path / "sft"
    tokenizer = str(hf_dir / "tokenizer.json")
    args = [tmp_path / "chat.jsonl", "-o", sft, "--seq-len", SEQ, "-t", tokenizer, "--eos", BYTE_EOS]
    assert run_main("prepare_sft_data.py", *args, "--pad", BYTE_EOS) == 0

    def finetune(name, *extra, record):
        cfg = tiny_config_dict(tmp_path / name, [], global_train_batch_size=4, max_duration=steps)
        cfg["model"] = imported.asdict()["model"]
        cfg["tokenizer"] = {"identifier": tokenizer}
        cfg["hf_export"] = {"enabled": True, "dtype": "float32"}
        cfg["save_interval_unsharded"] = steps // 2
        config = write_config(tmp_path / f"{name}.yaml", cfg)
        data = [f"--data.paths=[{sft}/input_ids.npy]", f"--data.label_mask_paths=[{sft}/label_mask.npy]"]
        return run_train(config, *data, *extra, record=record)

    load = [f"--load_path={tmp_path / 'imported'}", "--reset_trainer_state"]
    full, resumed = [], []
    assert finetune("full", *load, record=full) == 0
    assert [r["step"] for r in full] == list(range(1, steps + 1))
    assert full[-1]["train/CrossEntropyLoss"] < full[0]["train/CrossEntropyLoss"]
    assert finetune("part", *load, f"--stop_at={steps // 2}", record=resumed) == 0
    assert finetune("part", "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    assert [r["train/CrossEntropyLoss"] for r in resumed] == [r["train/CrossEntropyLoss"] for r in full]

    exported = tmp_path / "full" / f"step{steps}-hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    ours = _ours(tmp_path / "full" / f"step{steps}-unsharded")
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)
        original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
        assert not torch.allclose(original(ids).logits, hf(ids).logits, atol=1e-3)
    return imported, json.loads((exported / "config.json").read_text())


def test_olmo3_import_finetune_on_chats_export_and_resume(tmp_path):
    imported, exported = _import_finetune_export(tmp_path, _olmo3_dir(tmp_path / "hf"), steps=6)
    assert imported.model.layer_windows() == [W, W, W, None] and imported.model.rope_scaling.name == "yarn"
    assert exported["architectures"] == ["Olmo3ForCausalLM"] and exported["sliding_window"] == W


def test_olmo_hybrid_import_finetune_on_chats_export_and_resume(tmp_path):
    imported, exported = _import_finetune_export(tmp_path, _hybrid_dir(tmp_path / "hf"), steps=4)
    assert imported.model.layer_types == [L, L, L, F] and imported.model.n_kv_heads == 2
    assert exported["architectures"] == ["OlmoHybridForCausalLM"] and exported["layer_types"] == [L, L, L, F]
