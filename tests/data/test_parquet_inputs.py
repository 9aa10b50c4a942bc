"""The data tools read a dataset as Hugging Face publishes it (parquet) as they read its JSON lines: the same
conversations, pairs and prompts give byte-identical outputs, and a damaged or absurd parquet file is refused
naming the file before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from olmo.exceptions import OLMoDataError
from olmo.testing import BYTE_EOS, run_main, write_byte_tokenizer
from olmo.util.json_lines import read_json_lines

CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a + b}"},
        ]
    }
    for a, b in ((1, 2), (3, 4), (5, 6))
]
PAIRS = [
    {"chosen": c["messages"], "rejected": [c["messages"][0], {"role": "assistant", "content": "No idea."}]}
    for c in CHATS
]
PROMPTS = [{"messages": c["messages"][:1], "ground_truth": c["messages"][1]["content"]} for c in CHATS]


def _write_both(folder: Path, name: str, rows: list[dict]) -> tuple[Path, Path]:
    jsonl, parquet = folder / f"{name}.jsonl", folder / f"{name}.parquet"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=2)  # two row groups
    return jsonl, parquet


@pytest.mark.parametrize(
    "script, rows, files",
    [
        ("prepare_sft_data.py", CHATS, ("input_ids.npy", "label_mask.npy")),
        ("prepare_preference_data.py", PAIRS, ("input_ids.npy", "label_mask.npy")),
        ("prepare_rl_prompts.py", PROMPTS, ("prompt_ids.npy", "prompt_offsets.npy", "input_ids.npy")),
    ],
)
def test_a_parquet_dataset_gives_what_its_json_lines_give(tmp_path, script, rows, files):
    tokenizer = write_byte_tokenizer(tmp_path / "tokenizer.json")
    flags = ["--seq-len", 64, "-t", tokenizer, "--eos", BYTE_EOS, "--pad", BYTE_EOS]
    for source in _write_both(tmp_path, "data", rows):
        assert run_main(script, source, "-o", tmp_path / source.suffix[1:], *flags) == 0
    for name in files:
        assert (tmp_path / "jsonl" / name).read_bytes() == (tmp_path / "parquet" / name).read_bytes(), name
    if script == "prepare_rl_prompts.py":  # each prompt's source names the file and its row, as a line
        ground = (tmp_path / "parquet/ground_truths.jsonl").read_text().splitlines()
        assert json.loads(ground[2])["id"].endswith("data.parquet:3")


def test_rows_are_numbered_as_lines_and_keep_their_nested_values(tmp_path):
    _, parquet = _write_both(tmp_path, "chats", CHATS)
    assert list(read_json_lines(parquet)) == list(enumerate(CHATS, start=1))


def test_a_damaged_or_absurd_parquet_file_is_refused_naming_it(tmp_path):
    _, parquet = _write_both(tmp_path, "chats", CHATS)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(parquet.read_bytes()[:-40])
    with pytest.raises(OLMoDataError, match=r"Cannot read '.*cut\.parquet' as a parquet file"):
        list(read_json_lines(cut))
    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_text('{"messages": []}\n')
    with pytest.raises(OLMoDataError, match=r"text\.parquet' as a parquet file"):
        list(read_json_lines(not_parquet))
    deep: object = "x"
    for _ in range(70):
        deep = [deep]
    pq.write_table(pa.Table.from_pylist([{"messages": deep}]), tmp_path / "deep.parquet")
    with pytest.raises(OLMoDataError, match=r"nest lists and structs 71 deep, past the limit of 64"):
        list(read_json_lines(tmp_path / "deep.parquet"))
    with pytest.raises(OLMoDataError, match=r"missing\.parquet' does not exist"):
        list(read_json_lines(tmp_path / "missing.parquet"))
