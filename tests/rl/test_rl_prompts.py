"""scripts/prepare_rl_prompts.py and the prompt folder a run reads (issue 53, point 2): prompts in the layout the SFT
data of the same conversations has, their ground truths, and every bad line or damaged file refused by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from olmo.cli import prepare_rl_prompts, prepare_sft_data
from olmo.data.chat_templates import load_chat_template
from olmo.data.rl_prompts import PROMPT_FILES, RLPrompts
from olmo.exceptions import OLMoCliError, OLMoDataError
from olmo.tokenizer import Tokenizer

EOS, PAD = 50279, 1
QUESTION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 12 + 30?"},
]
ANSWER = {"role": "assistant", "content": "12 + 30 = 42. The answer is 42."}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file("allenai_gpt-neox-olmo-dolma-v1_5.json", EOS, PAD)


def _lines(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _prepare(src: Path, out: Path, *flags: str) -> int:
    return prepare_rl_prompts.main([str(src), "-o", str(out), "--seq-len", "48", *flags])


def _sft_ids(tmp_path: Path, conversation: list, *flags: str) -> list[int]:
    src = _lines(tmp_path / "sft.jsonl", [{"messages": conversation}])
    out = tmp_path / "sft"
    prepare_sft_data.main([str(src), "-o", str(out), "--seq-len", "96", "--overwrite", *flags])
    return np.fromfile(out / "input_ids.npy", dtype=np.uint16).tolist()


@pytest.mark.parametrize("template", [None, "olmo3"])
def test_a_conversation_prompt_is_its_sft_example_up_to_the_answer(tmp_path, tokenizer, template):
    flags = [] if template is None else ["--chat-template", template]
    src = _lines(tmp_path / "in.jsonl", [{"messages": QUESTION, "ground_truth": "42"}])
    assert _prepare(src, tmp_path / "out", *flags, "--seq-len", "128") == 0
    prompts = RLPrompts(tmp_path / "out")
    ids = prompts.prompt(0).tolist()
    sft = _sft_ids(tmp_path, [*QUESTION, ANSWER], *flags)
    # The model fine-tuned on the SFT example sees exactly this prefix before it writes the answer.
    assert sft[: len(ids)] == ids
    answer = tokenizer.decode(sft[len(ids) :], skip_special_tokens=False)
    assert answer.startswith(ANSWER["content"])
    if template is None:
        assert ids[0] == EOS and tokenizer.decode(ids, skip_special_tokens=False).endswith("<|assistant|>\n")
    else:
        text = load_chat_template(template).render(QUESTION, add_generation_prompt=True)
        assert ids == tokenizer.base.encode(text, add_special_tokens=False).ids
    assert prompts.ground_truths == ["42"] and prompts.sources == ["in.jsonl:1"]
    record = json.loads((tmp_path / "out/prompts.json").read_text())
    assert record["chat_template"] == (None if template is None else "'olmo3' (built in)")
    assert record["prompts"] == 1 and record["tokens"] == len(ids) == record["max_prompt_tokens"]


def test_plain_prompts_are_their_text_and_long_ones_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    rows = [
        {"prompt": "Q: 2 + 3 =", "ground_truth": 5},
        "",
        {"prompt": "why " * 100, "ground_truth": "because"},
        {"prompt": "Q: half of 1 =", "ground_truth": 0.5},
    ]
    caplog.set_level(logging.INFO)
    _prepare(_lines(tmp_path / "in.jsonl", rows), tmp_path / "out")
    prompts = RLPrompts(tmp_path / "out")
    assert len(prompts) == 2 and prompts.sources == ["in.jsonl:1", "in.jsonl:4"]
    assert prompts.prompt(0).tolist() == tokenizer.encode("Q: 2 + 3 =", add_special_tokens=False)
    assert prompts.prompt(1).tolist() == tokenizer.encode("Q: half of 1 =", add_special_tokens=False)
    assert prompts.ground_truths == ["5", "0.5"]  # numbers kept as written
    # Each prompt is also instance i of the token file the data order reads, padded on the left with --pad.
    rows = np.fromfile(tmp_path / "out/input_ids.npy", dtype=np.uint16).reshape(2, 48)
    for i in range(2):
        ids = prompts.prompt(i).tolist()
        assert rows[i, 48 - len(ids) :].tolist() == ids and (rows[i, : 48 - len(ids)] == 1).all()
    assert "Dropped 1 prompts longer than 48 tokens (input lines 3)" in caplog.text
    assert json.loads((tmp_path / "out/prompts.json").read_text())["dropped_too_long"] == 1
    prompts.check_vocab(50280)
    with pytest.raises(
        OLMoDataError, match=r"rl\.prompts .* holds token id \d+, but the model has 100 embeddings"
    ):
        prompts.check_vocab(100)


@pytest.mark.parametrize(
    "row, message",
    [
        ('{"prompt": "x", ', "is not valid JSON"),
        ({"ground_truth": "1"}, "has neither 'prompt' nor 'messages'"),
        (
            {"prompt": "x", "messages": QUESTION, "ground_truth": "1"},
            r"has both 'prompt' and 'messages' \(pass --prompt-field to choose one\)",
        ),
        ({"prompt": "x"}, "has no 'ground_truth'"),
        ({"prompt": "x", "ground_truth": ["1", "2"]}, "a 'ground_truth' list of 2 values"),
        ({"prompt": "x", "ground_truth": [["1"]]}, "a 'ground_truth' that is an array"),
        ({"prompt": "x", "ground_truth": True}, "a 'ground_truth' that is a boolean"),
        ({"prompt": "  ", "ground_truth": "1"}, "'prompt' is empty"),
        ({"prompt": 3, "ground_truth": "1"}, "'prompt' is a number, not a string"),
        ({"messages": [], "ground_truth": "1"}, "'messages' is an empty list"),
        (
            {"messages": [{"role": "bot", "content": "x"}], "ground_truth": "1"},
            r"messages\[0\] has the role 'bot'",
        ),
        ({"messages": [*QUESTION, ANSWER], "ground_truth": "42"}, "ends with an assistant message"),
    ],
)
def test_a_bad_line_stops_the_run_naming_file_and_line_before_anything_is_written(tmp_path, row, message):
    src = _lines(tmp_path / "in.jsonl", [{"prompt": "fine", "ground_truth": "1"}, row])
    with pytest.raises(OLMoDataError, match=f"in.jsonl' line 2.*{message}|{message}.*in.jsonl' line 2"):
        _prepare(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")]  # the staging folder is gone


def test_an_earlier_output_is_replaced_only_with_overwrite(tmp_path):
    src = _lines(tmp_path / "in.jsonl", [{"prompt": "Q: 1 + 1 =", "ground_truth": "2"}])
    _prepare(src, tmp_path / "out")
    with pytest.raises(OLMoCliError, match="already holds prompt_ids.npy.*--overwrite"):
        _prepare(src, tmp_path / "out")
    _lines(src, [{"prompt": "Q: 1 + 2 =", "ground_truth": "3"}, {"prompt": "Q: 2 + 2 =", "ground_truth": "4"}])
    _prepare(src, tmp_path / "out", "--overwrite")
    assert RLPrompts(tmp_path / "out").ground_truths == ["3", "4"]


def test_only_prompts_that_fit_or_no_output(tmp_path):
    src = _lines(tmp_path / "in.jsonl", [{"prompt": "why " * 100, "ground_truth": "x"}])
    with pytest.raises(OLMoDataError, match="holds no prompt of at most --seq-len 48 tokens \\(1 longer ones"):
        _prepare(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "ground_truths.jsonl").unlink(), "has no ground_truths.jsonl"),
        (lambda d: (d / "prompts.json").write_text("{"), "cannot be read as JSON"),
        (lambda d: (d / "prompts.json").write_text('{"format": "x"}'), "not the record of a prompt folder"),
        (lambda d: _truncate(d / "prompt_ids.npy"), "prompt_ids.npy' has .* bytes, but its record says"),
        (lambda d: _truncate(d / "prompt_offsets.npy"), "prompt_offsets.npy' has .* bytes"),
        (lambda d: np.zeros(3, np.int64).tofile(d / "prompt_offsets.npy"), "does not describe 2 prompts"),
        (lambda d: _lines(d / "ground_truths.jsonl", [{"id": "a", "ground_truth": "1"}]), "1 ground truths for 2"),
        (lambda d: _lines(d / "ground_truths.jsonl", [{"id": "a"}, {"id": "b"}]), "line 1 is not"),
        (lambda d: _truncate(d / "input_ids.npy"), "input_ids.npy' has .* bytes, not 2 prompts of 48 tokens"),
        (lambda d: _swap_rows(d / "input_ids.npy"), "input_ids.npy' instance 0 is not prompt 0"),
    ],
)
def test_a_damaged_prompt_folder_is_refused_naming_the_file(tmp_path, damage, message):
    rows = [{"prompt": "Q: 1 + 1 =", "ground_truth": "2"}, {"prompt": "Q: 2 + 2 =", "ground_truth": "4"}]
    _prepare(_lines(tmp_path / "in.jsonl", rows), tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(PROMPT_FILES)
    damage(tmp_path / "out")
    with pytest.raises(OLMoDataError, match=message) as e:
        RLPrompts(tmp_path / "out")
    assert "scripts/prepare_rl_prompts.py" in str(e.value)


def _swap_rows(path: Path) -> None:
    rows = np.fromfile(path, dtype=np.uint16).reshape(2, -1)
    rows[::-1].tofile(path)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-2])


def test_max_prompt_tokens_leaves_room_for_the_completions(tmp_path, tokenizer, caplog):
    rows = [
        {"prompt": "Q: 2 + 3 =", "ground_truth": "5"},
        {"prompt": "Q: what is two plus three?", "ground_truth": "5"},
    ]
    caplog.set_level(logging.INFO)
    _prepare(_lines(tmp_path / "in.jsonl", rows), tmp_path / "out", "--max-prompt-tokens", "6")
    prompts = RLPrompts(tmp_path / "out")
    assert len(prompts) == 1 and prompts.max_prompt_tokens <= 6 and prompts.seq_len == 48
    assert "Dropped 1 prompts longer than 6 tokens (input lines 2)" in caplog.text


def test_absurd_flags_are_refused_before_any_work(tmp_path, capsys):
    src = _lines(tmp_path / "in.jsonl", [{"prompt": "x", "ground_truth": "1"}])
    with pytest.raises(SystemExit):
        prepare_rl_prompts.main([str(src), "-o", str(tmp_path / "out"), "--seq-len", "0"])
    assert "--seq-len 0 is not a length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _prepare(src, tmp_path / "out", "--max-prompt-tokens", "49")
    assert "--max-prompt-tokens 49 must be in [1, --seq-len 48]" in capsys.readouterr().err
    with pytest.raises(OLMoCliError, match="INPUT .* is not a file"):
        prepare_rl_prompts.main([str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out"), "--seq-len", "8"])


def test_a_published_rl_set_is_read_by_its_prompt_field_and_verifier(tmp_path, tokenizer, caplog):
    """Ai2's RL sets hold both a prompt text and its messages, a list of one ground truth, and the verifier of each
    row in ``dataset``: --prompt-field messages and --keep dataset=math take the rows an exact answer scores."""
    rows = [
        {"prompt": "What is 12 + 30?", "messages": QUESTION, "ground_truth": ["42"], "dataset": ["math"]},
        {"prompt": "Write a haiku.", "messages": [QUESTION[1]], "ground_truth": ["{...}"], "dataset": ["ifeval"]},
        {"prompt": "What is 1 + 1?", "messages": QUESTION, "ground_truth": ["2"], "dataset": "math"},
    ]
    caplog.set_level(logging.INFO)
    flags = ["--prompt-field", "messages", "--keep", "dataset=math"]
    _prepare(_lines(tmp_path / "in.jsonl", rows), tmp_path / "out", *flags)
    prompts = RLPrompts(tmp_path / "out")
    assert prompts.sources == ["in.jsonl:1", "in.jsonl:3"] and prompts.ground_truths == ["42", "2"]
    question = _prepare(
        _lines(tmp_path / "q.jsonl", [{"messages": QUESTION, "ground_truth": "42"}]), tmp_path / "q"
    )
    assert question == 0 and prompts.prompt(0).tolist() == RLPrompts(tmp_path / "q").prompt(0).tolist()
    assert "Skipped 1 lines without dataset=math (--keep)" in caplog.text
    record = json.loads((tmp_path / "out/prompts.json").read_text())
    assert (record["keep"], record["dropped_by_keep"], record["prompt_field"]) == ("dataset=math", 1, "messages")
    with pytest.raises(OLMoDataError, match=r"with dataset=code \(3 lines without\).*or check --keep"):
        _prepare(tmp_path / "in.jsonl", tmp_path / "none", "--prompt-field", "messages", "--keep", "dataset=code")
    with pytest.raises(OLMoDataError, match=r"in.jsonl' line 1 has no 'messages' \(--prompt-field messages\)"):
        _prepare(_lines(tmp_path / "in.jsonl", [{"prompt": "x", "ground_truth": "1"}]), tmp_path / "o", *flags[:2])
    with pytest.raises(SystemExit):
        _prepare(tmp_path / "in.jsonl", tmp_path / "o", "--keep", "dataset")
