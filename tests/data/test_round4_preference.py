"""Preference files under hostile and mistaken input (issue 50): the file's type, each line's size and nesting bounded
before it is parsed; pairs whose prompts differ or whose sides tokenize the same refused naming the file and line,
before anything is written. The limits are lowered here (a parameter, or the module constant) so that no test
allocates much."""

import gzip
import json
import os

import pytest

from olmo.data.preference import read_pairs
from olmo.exceptions import OLMoCliError, OLMoDataError
from olmo.testing import run_main
from olmo.util import json_lines
from olmo.util.json_lines import json_depth, read_json_lines

SEQ = 48


def _turns(question, answer, system=None):
    head = [] if system is None else [{"role": "system", "content": system}]
    return head + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


GOOD = {"chosen": _turns("Capital of France?", "Paris."), "rejected": _turns("Capital of France?", "Berlin.")}


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _prepare(source, out, *extra):
    return run_main("prepare_preference_data.py", source, "-o", out, "--seq-len", SEQ, *extra)


def _refused(tmp_path, lines, match):
    """The pairs file of ``lines`` is refused naming its line 2, and nothing is written."""
    source = _write(tmp_path / "pairs.jsonl", lines)
    with pytest.raises(OLMoDataError, match=match) as info:
        _prepare(source, tmp_path / "out")
    assert "pairs.jsonl' line 2" in str(info.value)
    assert not (tmp_path / "out").exists()
    return str(info.value)


# --- Memory and time: each line's size and nesting bounded before it is parsed --------------------------------------


def test_a_line_past_the_limit_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    """The issue's 100 MB line, at a limit lowered to 2 KB: refused naming the line and the limit."""
    monkeypatch.setattr(json_lines, "MAX_LINE_BYTES", 2000)
    huge = {"chosen": _turns("q", "a" * 5000), "rejected": _turns("q", "b")}
    message = _refused(tmp_path, [GOOD, huge], "longer than 2,000 bytes")
    assert "Shorten that line or remove it" in message


def test_the_line_limit_holds_after_gzip_and_without_a_newline(tmp_path):
    """A gzip file of 1 MB of zeros (a few KB compressed) with no newline stops at the limit, not at its end."""
    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip.compress(json.dumps(GOOD).encode() + b"\n" + b"0" * (1 << 20)))
    assert bomb.stat().st_size < 8192
    with pytest.raises(OLMoDataError, match="line 2 is longer than 4,096 bytes"):
        list(read_json_lines(bomb, max_line_bytes=4096))
    with pytest.raises(OLMoDataError, match="line 2 is longer than"):
        list(read_pairs(bomb, max_line_bytes=4096))


def test_a_line_of_exactly_the_limit_is_read(tmp_path):
    line = json.dumps(GOOD).encode()
    for ending in (b"\n", b""):  # with its newline, and as the file's last line without one
        path = tmp_path / "pairs.jsonl"
        path.write_bytes(b"\n" + line + ending)
        assert [n for n, _ in read_json_lines(path, max_line_bytes=len(line))] == [2]
        with pytest.raises(OLMoDataError, match="line 2 is longer than"):
            list(read_json_lines(path, max_line_bytes=len(line) - 1))


def test_deeply_nested_json_is_refused_not_a_traceback(tmp_path):
    """The issue's RecursionError: a line nested 100,000 deep (200 KB) is refused, naming the line and the limit."""
    deep = json.dumps(GOOD)[:-1] + ', "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"
    message = _refused(tmp_path, [GOOD, deep], "nests arrays and objects 100001 deep")
    assert "past the limit of 64" in message


@pytest.mark.parametrize(
    "nested",
    [
        '{"x": ' * 80 + "1" + "}" * 80,  # objects, not only arrays
        '"]]]]]]]]]]]]]]]]]]]]", "m": ' + "[" * 70 + "]" * 70,  # closing brackets inside a string do not count
        '"\\"]]]]]]]]]]]]]]]]]]", "m": ' + "[" * 70 + "]" * 70,  # nor do they after an escaped quote
    ],
)
def test_nesting_is_counted_outside_strings(tmp_path, nested):
    source = _write(tmp_path / "pairs.jsonl", [GOOD, json.dumps(GOOD)[:-1] + ', "meta": ' + nested + "}"])
    with pytest.raises(OLMoDataError, match="line 2 nests arrays and objects"):
        list(read_pairs(source))


def test_brackets_inside_strings_are_not_nesting(tmp_path):
    """An answer full of brackets (code, a table) is no nesting; a value nested to the limit is read."""
    brackets = {"chosen": _turns("Show [[x]]", "[" * 500 + "{" * 500), "rejected": _turns("Show [[x]]", "no")}
    at_limit = json.dumps(GOOD)[:-1] + ', "meta": ' + "[" * 63 + "]" * 63 + "}"  # the line itself is level 1
    source = _write(tmp_path / "pairs.jsonl", [brackets, at_limit])
    assert [n for n, _, _ in read_pairs(source)] == [1, 2]
    assert json_depth(b'"[[[\\"[[[" ') == 0 and json_depth(b'"abc\\') == 0  # an unterminated string ends the line


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory", "dangling"])
def test_only_regular_files_are_read(tmp_path, kind):
    """A FIFO is refused without waiting on it, /dev/zero (through a symlink named like data) without reading it."""
    path = tmp_path / "pairs.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "gone.jsonl")
    expected = {
        "fifo": "named pipe",
        "dev_zero": "character device",
        "directory": "a directory",
        "dangling": "symlink whose target does not exist",
    }[kind]
    with pytest.raises(OLMoDataError, match=expected):
        list(read_pairs(path))
    with pytest.raises(OLMoCliError, match="is not a file"):
        _prepare(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- Silent wrong results: pairs that are no preference -----------------------------------------------------------


@pytest.mark.parametrize(
    "rejected, expected",
    [
        (
            _turns("Capital of Spain?", "Berlin."),
            r"differ at message \[0\] \(user 'Capital of France\?' against user",
        ),
        (_turns("Capital of France?", "Berlin.", system="Be terse."), r"differ at message \[0\] \(user .* system"),
        ([{"role": "assistant", "content": "Berlin."}], "have 1 and 0 messages before their answers"),
    ],
)
def test_pairs_with_different_prompts_are_refused(tmp_path, rejected, expected):
    message = _refused(tmp_path, [GOOD, {"chosen": GOOD["chosen"], "rejected": rejected}], expected)
    assert "not two answers to one prompt" in message and "same messages before their last" in message


def test_a_prompt_differing_in_another_key_is_refused(tmp_path):
    rejected = [{**GOOD["rejected"][0], "name": "someone else"}, GOOD["rejected"][1]]
    _refused(tmp_path, [GOOD, {"chosen": GOOD["chosen"], "rejected": rejected}], "in a key other than 'role'")


@pytest.mark.parametrize("answer", ["Paris. ", "\n Paris.\t"])
def test_sides_that_tokenize_the_same_are_refused(tmp_path, answer):
    """The Tulu layout strips each message: answers that differ only in surrounding whitespace are one answer."""
    pair = {"chosen": GOOD["chosen"], "rejected": _turns("Capital of France?", answer)}
    _refused(tmp_path, [GOOD, pair], "tokenize the same")


def test_a_template_that_keeps_whitespace_keeps_such_a_pair(tmp_path):
    """With a chat template that renders the whitespace, the same two answers are two token sequences."""
    pair = {"chosen": GOOD["chosen"], "rejected": _turns("Capital of France?", "Paris. ")}
    source = _write(tmp_path / "pairs.jsonl", [GOOD, pair])
    assert _prepare(source, tmp_path / "out", "--chat-template", "olmo3") == 0
    assert (tmp_path / "out/input_ids.npy").stat().st_size == 4 * SEQ * 2  # 2 pairs, uint16


def test_sides_that_differ_only_past_the_length_are_dropped(tmp_path):
    """Answers that differ after --seq-len would be two identical instances: the pair is dropped and counted; a
    file of only such pairs writes nothing and says to raise --seq-len."""
    long = "word " * 40
    pair = {"chosen": _turns("Repeat.", long + "yes"), "rejected": _turns("Repeat.", long + "no")}
    source = _write(tmp_path / "pairs.jsonl", [GOOD, pair])
    assert _prepare(source, tmp_path / "out") == 0
    assert (tmp_path / "out/input_ids.npy").stat().st_size == 2 * SEQ * 2  # GOOD only
    only = _write(tmp_path / "only.jsonl", [pair])
    with pytest.raises(OLMoDataError, match="two sides that differ, within --seq-len 48; raise --seq-len"):
        _prepare(only, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
