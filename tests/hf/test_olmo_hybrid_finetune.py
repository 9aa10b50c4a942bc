"""Fine-tuning OLMo Hybrid as a user does it, end to end: an ``OlmoHybridForCausalLM`` directory (three Gated
DeltaNet layers to one attention layer, GQA in both) -> ``convert_from_hf.py`` -> ``train.py --load_path=...
--reset_trainer_state`` on chat SFT data from ``prepare_sft_data.py`` -> ``hf_export`` -> transformers loads the
result and computes the same logits as our checkpoint of it."""

import json

import pytest
import torch
from test_hf import _ours

from olmo.config import TrainConfig
from olmo.testing import BYTE_EOS, run_main, run_train, tiny_config_dict, write_byte_tokenizer, write_config

transformers = pytest.importorskip("transformers")

SEQ = 48
"""Positions per instance (the logits across delta-rule chunks are tests/hf/test_hf_olmo_hybrid.py's)."""
L, F = "linear_attention", "full_attention"


def _hybrid_dir(path):
    """A random OLMo-Hybrid-shaped transformers model (4 layers, [L, L, L, F], 2 key/value heads in attention, 2 key
    heads for 4 value heads in Gated DeltaNet) with the byte tokenizer, saved as a user downloads one."""
    torch.manual_seed(0)
    config = transformers.OlmoHybridConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=SEQ,
        layer_types=[L, L, L, F],
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        eos_token_id=BYTE_EOS,
        pad_token_id=BYTE_EOS,
        tie_word_embeddings=False,
    )
    transformers.OlmoHybridForCausalLM(config).save_pretrained(path)
    write_byte_tokenizer(path / "tokenizer.json")
    return path


def test_import_finetune_on_chats_export_and_resume(tmp_path):
    hf_dir = _hybrid_dir(tmp_path / "hf")
    assert run_main("convert_from_hf.py", hf_dir, tmp_path / "imported") == 0
    imported = TrainConfig.load(tmp_path / "imported" / "config.yaml")
    assert imported.model.layer_types == [L, L, L, F] and imported.model.n_kv_heads == 2

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
        cfg = tiny_config_dict(tmp_path / name, [], global_train_batch_size=4, max_duration=4)
        cfg["model"] = imported.asdict()["model"]
        cfg["tokenizer"] = {"identifier": tokenizer}
        cfg["hf_export"] = {"enabled": True, "dtype": "float32"}
        cfg["save_interval_unsharded"] = 2
        config = write_config(tmp_path / f"{name}.yaml", cfg)
        data = [f"--data.paths=[{sft}/input_ids.npy]", f"--data.label_mask_paths=[{sft}/label_mask.npy]"]
        return run_train(config, *data, *extra, record=record)

    load = [f"--load_path={tmp_path / 'imported'}", "--reset_trainer_state"]
    full, resumed = [], []
    assert finetune("full", *load, record=full) == 0
    assert [r["step"] for r in full] == list(range(1, 5))
    assert full[-1]["train/CrossEntropyLoss"] < full[0]["train/CrossEntropyLoss"]
    # Stopped at step 2 and resumed from its own checkpoint: the same run, bitwise.
    assert finetune("part", *load, "--stop_at=2", record=resumed) == 0
    assert finetune("part", "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    assert [r["train/CrossEntropyLoss"] for r in resumed] == [r["train/CrossEntropyLoss"] for r in full]

    # The export at the end is an OlmoHybridForCausalLM with the fine-tuned weights: transformers' logits are ours.
    exported = tmp_path / "full" / "step4-hf"
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["OlmoHybridForCausalLM"] and config["layer_types"] == [L, L, L, F]
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    ours = _ours(tmp_path / "full" / "step4-unsharded")
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=0, atol=1e-5)
        original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
        assert not torch.allclose(original(ids).logits, hf(ids).logits, atol=1e-3)
