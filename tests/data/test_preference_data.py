"""prepare_preference_data.py (issue 40, point 2's data): ``{"chosen", "rejected"}`` lines into the SFT format, pair i
at instances 2i and 2i + 1, each side formatted as prepare_sft_data.py formats a conversation; a pair losing its
answer on one side is dropped whole; bad pairs stop the run naming the file and line, before anything is written."""

import json

import numpy as np
import pytest

from olmo.data.chat_templates import load_chat_template
from olmo.data.sft import Formatter
from olmo.exceptions import OLMoDataError
from olmo.testing import run_main
from olmo.tokenizer import DEFAULT_TOKENIZER, Tokenizer

SEQ = 48


def _turns(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


PAIRS = [
    {"chosen": _turns("Capital of France?", "Paris."), "rejected": _turns("Capital of France?", "Berlin.")},
    {"chosen": _turns("2+2?", "Four."), "rejected": _turns("2+2?", "Five, probably.")},
    # Both answers fall beyond --seq-len: the pair is dropped whole.
    {
        "chosen": _turns("Say hi. " + "please " * 60, "Hi."),
        "rejected": _turns("Say hi. " + "please " * 60, "Hello there."),
    },
]


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _read(folder):
    ids = np.fromfile(folder / "input_ids.npy", dtype=np.uint16).reshape(-1, SEQ)
    mask = np.fromfile(folder / "label_mask.npy", dtype=np.bool_).reshape(-1, SEQ)
    return ids, mask


@pytest.mark.parametrize("template", [None, "olmo3"])
def test_pair_i_is_at_instances_2i_and_2i_plus_1(tmp_path, template):
    source = _write(tmp_path / "pairs.jsonl", PAIRS)
    extra = [] if template is None else ["--chat-template", template]
    assert (
        run_main("prepare_preference_data.py", source, "-o", tmp_path / "out", "--seq-len", str(SEQ), *extra) == 0
    )
    ids, mask = _read(tmp_path / "out")
    assert ids.shape == (4, SEQ)  # two pairs kept, the third dropped whole
    tokenizer = Tokenizer.from_file(DEFAULT_TOKENIZER)
    sides = [side for pair in PAIRS[:2] for side in (pair["chosen"], pair["rejected"])]
    if template is None:
        expected = [(i, m) for i, m, _ in Formatter(tokenizer, SEQ, tokenizer.eos_token_id, 1).batch(sides)]
    else:
        expected = []
        for side in sides:
            side_ids, side_mask = load_chat_template(template).tokenize(side, tokenizer.base)
            pad = SEQ - len(side_ids)
            expected.append((side_ids + [1] * pad, side_mask + [False] * pad))
    for row, (side_ids, side_mask) in enumerate(expected):
        assert ids[row].tolist() == side_ids and mask[row].tolist() == side_mask
    answers = [tokenizer.decode(ids[row][mask[row]].tolist()).strip() for row in range(4)]
    assert answers == ["Paris.", "Berlin.", "Four.", "Five, probably."]


@pytest.mark.parametrize(
    "line, expected",
    [
        ({"chosen": _turns("q", "a")}, "has no 'rejected' key"),
        ({"chosen": _turns("q", "a"), "rejected": _turns("q", "a")}, "the same conversation"),
        (
            {"chosen": _turns("q", "a"), "rejected": _turns("q", "  ")},
            "'rejected' ends with an empty assistant answer",
        ),
        ({"chosen": _turns("q", "a")[:1], "rejected": _turns("q", "b")}, "'chosen' ends with a user message"),
        ({"chosen": "a", "rejected": _turns("q", "b")}, "'chosen' is a string, not a non-empty list"),
    ],
)
def test_bad_pairs_stop_the_run_naming_the_line(tmp_path, line, expected):
    source = _write(tmp_path / "pairs.jsonl", [PAIRS[0], line])
    with pytest.raises(OLMoDataError, match=expected) as info:
        run_main("prepare_preference_data.py", source, "-o", tmp_path / "out", "--seq-len", str(SEQ))
    assert "pairs.jsonl' line 2" in str(info.value)
    assert not (tmp_path / "out").exists()
