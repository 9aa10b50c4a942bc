"""``prepare_sft_data.py --pack`` (issue 40, point 1): several conversations per instance, each ending with its one
EOS, trained with ``data.generate_doc_lengths`` so that attention stays within each. The same conversations packed
and one per instance train the same labels to the same mean loss (RoPE scores depend on relative positions only,
so a conversation's logits do not depend on where in an instance it sits, up to float rounding)."""

import csv
import gzip
import json

import numpy as np
import pytest

from olmo.exceptions import OLMoDataError
from olmo.testing import (
    BYTE_EOS,
    metric_by_step,
    run_main,
    run_train,
    tiny_config_dict,
    write_byte_tokenizer,
    write_config,
)

SEQ = 256


def _conversations(n):
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"{i}+{2 * i}?"}, {"role": "assistant", "content": f"{3 * i}."}]
        if i % 3 == 0:  # some multi-turn, some with a system prompt
            turns += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
        if i % 4 == 0:
            turns.insert(0, {"role": "system", "content": "Be brief."})
        out.append({"messages": turns})
    return out


def _prepare(tmp_path, name, *flags):
    tokenizer = tmp_path / "tokenizer.json"
    if not tokenizer.exists():
        write_byte_tokenizer(tokenizer)
    args = ["-o", tmp_path / name, "--seq-len", SEQ, "-t", tokenizer, "--eos", BYTE_EOS, "--pad", 1]
    return run_main("prepare_sft_data.py", tmp_path / "chat.jsonl", *args, *flags)


def test_packed_and_unpacked_conversations_train_to_the_same_loss(tmp_path, caplog):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _conversations(24)))
    caplog.set_level("INFO")
    assert _prepare(tmp_path, "one", "--chat-template", "olmo3") == 0
    assert _prepare(tmp_path, "packed", "--chat-template", "olmo3", "--pack") == 0
    one = np.fromfile(tmp_path / "one/input_ids.npy", dtype=np.uint16).reshape(-1, SEQ)
    packed = np.fromfile(tmp_path / "packed/input_ids.npy", dtype=np.uint16).reshape(-1, SEQ)
    masks = {n: np.fromfile(tmp_path / n / "label_mask.npy", dtype=np.bool_) for n in ("one", "packed")}
    assert len(one) == 24 and len(packed) <= len(one) / 2
    assert masks["one"].sum() == masks["packed"].sum()  # every label kept
    # Each conversation's tokens appear whole and in order, one EOS each; only the instances' tails are padding.
    assert (packed == BYTE_EOS).sum() == (one == BYTE_EOS).sum() == 24
    content = [row[: np.flatnonzero(row == BYTE_EOS)[-1] + 1] for row in one]
    assert np.array_equal(
        np.concatenate(content), np.concatenate([r[: np.flatnonzero(r == BYTE_EOS)[-1] + 1] for r in packed])
    )
    # The conversations file beside the tokens says where each input line's tokens are (inspect_batch.py reads it).
    with gzip.open(tmp_path / "packed/input_ids.csv.gz", "rt") as f:
        spans = [(int(a), int(b), name) for a, b, name in csv.reader(f)]
    assert [name for _, _, name in spans] == [f"chat.jsonl:{i}" for i in range(1, 25)]
    for (start, end, _), row in zip(spans, one):
        assert np.array_equal(packed.reshape(-1)[start:end], row[: end - start])
    report = caplog.text
    assert "Packed 24 conversations into" in report and "one conversation per instance" in report

    losses = {}
    for name, rows in (("one", len(one)), ("packed", len(packed))):
        cfg = tiny_config_dict(
            tmp_path / f"run-{name}",
            [str(tmp_path / name / "input_ids.npy")],
            **{
                "data.label_mask_paths": [str(tmp_path / name / "label_mask.npy")],
                "data.generate_doc_lengths": True,  # without it the packed loss is 6.133, not 6.083
                "model.max_sequence_length": SEQ,
                "global_train_batch_size": rows,  # every conversation in the one step
                "device_train_microbatch_size": rows,
                "max_duration": 1,
                "save_interval_unsharded": None,
            },
        )
        assert run_train(write_config(tmp_path / f"{name}.yaml", cfg)) == 0
        losses[name] = (
            metric_by_step(tmp_path / f"run-{name}")[1],
            metric_by_step(tmp_path / f"run-{name}", "optim/total_grad_norm")[1],
        )
    assert losses["packed"][0] == pytest.approx(losses["one"][0], rel=1e-5)
    assert losses["packed"][1] == pytest.approx(losses["one"][1], rel=1e-4)


def test_pack_refuses_a_layout_whose_eos_would_split_a_conversation(tmp_path):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _conversations(3)))
    with pytest.raises(OLMoDataError, match="line 1: with --pack .* --chat-template olmo3"):
        _prepare(
            tmp_path, "tulu", "--pack"
        )  # OLMo's Tulu layout: an EOS before each conversation and after each answer
    assert not (tmp_path / "tulu").exists()
