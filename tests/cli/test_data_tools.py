"""The data tools: prepare_sft_data.py, inspect_batch.py and validate_data.py, on real tokens and runs."""

import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from olmo.data import MemMapDataset, file_checks, read_data_indices
from olmo.exceptions import OLMoDataError
from olmo.testing import BYTE_EOS, run_train, tiny_config_dict, write_byte_memmap, write_config
from olmo.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
EOS, PAD = 50279, 1
REAL_VOCAB = {
    "model.vocab_size": 50280,
    "model.embedding_size": 50304,
    "model.eos_token_id": EOS,
    "model.pad_token_id": PAD,
    "model.max_sequence_length": 64,
}


def _script(name):
    """The script's command module, to call its ``main(argv)`` in this process (faster than a subprocess)."""
    return importlib.import_module(f"olmo.cli.{name}")


def _cli(name, *args):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, str(REPO / "scripts" / f"{name}.py"), *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file("allenai_gpt-neox-olmo-dolma-v1_5.json", EOS, PAD)


def olmo_reference(tokenizer, messages, seq_len):
    """OLMo's prepare_tulu_data.preprocess: strings (with the EOS text) encoded as it does."""
    encode = lambda text: tokenizer.base.encode(text, add_special_tokens=False).ids  # noqa: E731
    ids, mask = [EOS], [False]
    for m in messages:
        role = encode(f"<|{m['role']}|>\n")
        ids, mask = ids + role, mask + [False] * len(role)
        if m["role"] == "assistant":
            content = encode(m["content"].strip() + "<|endoftext|>" + "\n")
            assert content[-2] == EOS
            mask += [True] * (len(content) - 1) + [False]
        else:
            content = encode(m["content"].strip() + "\n")
            mask += [False] * len(content)
        ids += content
    ids, mask = ids[:seq_len], mask[:seq_len]
    return ids + [PAD] * (seq_len - len(ids)), mask + [False] * (seq_len - len(mask))


def write_conversations(path, conversations):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


TWO_TURNS = [
    {"role": "system", "content": "You answer in one word. "},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "  Blue.\n"},
    {"role": "user", "content": "And grass?"},
    {"role": "assistant", "content": "Green."},
]


def test_prepare_sft_data_matches_olmo_tulu_format(tmp_path, tokenizer, caplog):
    long_question = [{"role": "user", "content": "why " * 80}, {"role": "assistant", "content": "Because."}]
    no_answer = [{"role": "user", "content": "Hello?"}]
    src = write_conversations(tmp_path / "chat.jsonl", [TWO_TURNS, long_question, no_answer])
    caplog.set_level(logging.INFO)
    _script("prepare_sft_data").main([str(src), "-o", str(tmp_path / "out"), "--seq-len", "64"])

    ids = np.memmap(tmp_path / "out/input_ids.npy", dtype=np.uint16, mode="r")
    mask = np.memmap(tmp_path / "out/label_mask.npy", dtype=np.bool_, mode="r")
    expected_ids, expected_mask = olmo_reference(tokenizer, TWO_TURNS, 64)
    assert ids.tolist() == expected_ids and mask.tolist() == expected_mask
    # Only the answers and their EOS are trained on; the conversation is short enough to end in padding.
    assert (
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False) == "Blue.<|endoftext|>Green.<|endoftext|>"
    )
    assert ids[0] == EOS and not mask[0] and ids[-1] == PAD
    assert "Kept 1 examples, dropped 2 (1 without an assistant message, 1 whose assistant tokens" in caplog.text


def test_sft_finetune_then_inspect_batches(tmp_path, tokenizer, capsys):
    """prepare_sft_data -> the README fine-tune command -> inspect_batch agrees with data-indices."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:3]
    assert _cli("prepare_memmap_dataset", *stdlib, "-o", tmp_path / "tokens").returncode == 0
    pretrain = write_config(
        tmp_path / "pretrain.yaml",
        tiny_config_dict(tmp_path / "base", [str(tmp_path / "tokens/part-00000.npy")], **REAL_VOCAB),
    )
    assert (
        run_train(pretrain, "--max_duration=2", "--global_train_batch_size=4", "--save_interval_unsharded=2") == 0
    )

    chats = [
        [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
        for a in range(6)
        for b in range(4)
    ]
    src = write_conversations(tmp_path / "chat.jsonl", chats)
    out = tmp_path / "sft"
    _script("prepare_sft_data").main([str(src), "-o", str(out), "--seq-len", "64"])
    run = tmp_path / "finetune"
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(run, [], **REAL_VOCAB, global_train_batch_size=4))
    record = []
    code = run_train(
        config,
        f"--data.paths=[{out}/input_ids.npy]",
        f"--data.label_mask_paths=[{out}/label_mask.npy]",
        f"--load_path={tmp_path}/base/step2-unsharded",
        "--reset_trainer_state",
        "--max_duration=8",  # 24 examples / 4 = 6 steps per epoch: steps 7-8 are in epoch 1
        record=record,
    )
    assert code == 0 and len(record) == 8
    assert record[-1]["train/CrossEntropyLoss"] < record[0]["train/CrossEntropyLoss"]

    inspect = _script("inspect_batch")
    logged = read_data_indices(run)
    for step in (3, 8):
        capsys.readouterr()
        rows = inspect.main([str(run), "--step", str(step), "--decode"])
        assert [r.index for r in rows] == logged[step][0]
        assert all(r.path == f"{out}/input_ids.npy" and r.offset == r.index * 64 for r in rows)
        assert all(r.label_tokens == len(tokenizer.encode(chats[r.index][1]["content"], False)) + 1 for r in rows)
        assert "<|user|>\\nWhat is" in capsys.readouterr().out
    rank1 = inspect.main([str(run), "--step", "3", "--rank", "1", "--world-size", "2"])
    assert [(r.position, r.index) for r in rank1] == [(1, logged[3][0][1]), (3, logged[3][0][3])]

    # A config and an order file copied from elsewhere; a missing epoch file is recomputed from the seed.
    order = shutil.copy(run / "train_data/global_indices.npy", tmp_path / "order.npy")
    rows = inspect.main([str(run / "config.yaml"), "--step", "3", "--order-file", str(order)])
    assert [r.index for r in rows] == logged[3][0]
    (run / "train_data/global_indices_epoch1.npy").unlink()
    assert [r.index for r in inspect.main([str(run), "--step", "8"])] == logged[8][0]

    capsys.readouterr()
    _script("validate_data").main([str(run / "config.yaml")])
    table = capsys.readouterr().out
    assert f"{np.memmap(out / 'label_mask.npy', dtype=np.bool_, mode='r').mean() * 100:.1f}%" in table
    assert f"{24 * 64:,}" in table and "uint16" in table


def test_validate_data_statistics(tmp_path, tokenizer, capsys, monkeypatch):
    validate = _script("validate_data")
    data = write_byte_memmap(tmp_path / "bytes.npy", 30_000)
    ends = np.flatnonzero(data == BYTE_EOS)
    # Documents span chunks, both of validate()'s one pass and of the scan of files validate() does not read.
    monkeypatch.setattr(file_checks, "SCAN_CHUNK_TOKENS", 1000)
    monkeypatch.setattr(validate, "CHUNK_TOKENS", 1500)
    dataset = MemMapDataset(tmp_path / "bytes.npy", chunk_size=64)
    one_pass = validate.Scan(dataset, 257, BYTE_EOS, total=30_000)
    dataset.validate(257, on_chunk=one_pass)
    for stats in (*one_pass.finish(), *validate.Scan(dataset, 257, BYTE_EOS, total=30_000).finish()):
        assert (stats.tokens, stats.eos, stats.min_id, stats.max_id) == (30_000, len(ends), data.min(), data.max())
        assert stats.doc_lengths.tolist() == np.diff(ends, prepend=-1).tolist()

    capsys.readouterr()
    validate.main([str(tmp_path / "bytes.npy"), "--vocab-size", "257", "--eos", str(BYTE_EOS), "--seq-len", "64"])
    out = capsys.readouterr().out
    assert f"{30_000 // 64:,}" in out and f"{30_000 % 64}" in out and f"{len(ends)} documents ending in EOS" in out

    docs = ["The quick brown fox.", "Jumps over\nthe lazy dog!", "A third, slightly longer document."]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert _cli("prepare_memmap_dataset", tmp_path / "docs.jsonl", "-o", tmp_path / "tok").returncode == 0
    validate.main([str(tmp_path / "tok/part-00000.npy"), "--vocab-size", "50280", "--seq-len", "8"])
    lengths = sorted(len(tokenizer.encode(d)) for d in docs)
    assert f"3 documents ending in EOS: min {lengths[0]}" in capsys.readouterr().out

    with pytest.raises(OLMoDataError, match="bytes.npy.*token id 300"):
        bad = np.memmap(tmp_path / "bytes.npy", dtype=np.uint16, mode="r+")
        bad[12_345] = 300
        bad.flush()
        validate.main([str(tmp_path / "bytes.npy"), "--vocab-size", "257", "--eos", str(BYTE_EOS)])


def test_validate_data_cli_exits_nonzero_naming_each_bad_file(tmp_path):
    good = tmp_path / "good.npy"
    write_byte_memmap(good, 5_000)
    bad = tmp_path / "bad.npy"
    tokens = write_byte_memmap(bad, 5_000, skip_bytes=100_000)
    tokens[4_000] = 999
    np.memmap(bad, dtype=np.uint16, mode="r+")[:] = tokens
    (tmp_path / "odd.npy").write_bytes(b"\x01\x00\x02")
    result = _cli("validate_data", good, bad, tmp_path / "odd.npy", "--vocab-size", "257", "--eos", "256")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "bad.npy' holds token id 999 at token offset 4000" in result.stderr
    assert "odd.npy' is 3 bytes" in result.stderr and "good.npy" in result.stdout
    assert _cli("validate_data", good, "--vocab-size", "257", "--eos", "256").returncode == 0
