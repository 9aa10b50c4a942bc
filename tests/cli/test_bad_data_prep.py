"""Bad input to the data-prep scripts (prepare_memmap_dataset.py, prepare_sft_data.py), run as a user runs them:
each mistake stops the run with one paragraph naming the file, line, key or flag and the fix, not a
traceback, and leaves the output folder as it was (a new one is not created)."""

import gzip
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from olmo.testing import run_script
from olmo.tokenizer import Tokenizer

MEMMAP, SFT = "prepare_memmap_dataset.py", "prepare_sft_data.py"
CHAT = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
AS_ROOT = os.geteuid() == 0  # root reads and writes whatever the permission bits say


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file("allenai_gpt-neox-olmo-dolma-v1_5.json")


def snapshot(folder: Path) -> dict[str, Optional[bytes]]:
    """Every file (with its bytes) and folder (None) under ``folder``, hidden ones included, to prove that a
    failed run changed nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def assert_refused(result, error: str, *named: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert f"{error}:" in result.stderr, result.stderr
    for text in named:
        assert text in result.stderr, (text, result.stderr)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_help_exits_zero():
    for script in (MEMMAP, SFT):
        result = run_script(script, "--help")
        assert result.returncode == 0 and "--overwrite" in result.stdout


MALFORMED_LINES = {
    "no text key": (
        MEMMAP,
        '{"content": "A document.", "id": 7}',
        ["no 'text' key", "'content', 'id'", "--text-key"],
    ),
    "text not a string": (MEMMAP, '{"text": ["a", "list"]}', ["'text' is an array, not a string"]),
    "invalid JSON": (MEMMAP, '{"text": "unterminated', ["not valid JSON"]),
    "JSON array": (MEMMAP, '["text", "in a list"]', ["is an array, not a JSON object"]),
    "JSON string": (MEMMAP, '"just a string"', ["is a string, not a JSON object"]),
    "no messages": (SFT, '{"text": "not a chat"}', ["no 'messages' key (its keys: 'text')"]),
    "messages not a list": (SFT, '{"messages": "hi"}', ["'messages' is a string, not a list"]),
    "message without role": (SFT, '{"messages": [{"content": "hi"}]}', ["messages[0] has no 'role'"]),
    "content not a string": (
        SFT,
        '{"messages": [{"role": "user", "content": 3}]}',
        ["'content' that is a number"],
    ),
    "unknown role": (SFT, '{"messages": [{"role": "bot", "content": "hi"}]}', ["role 'bot'", "assistant"]),
}


@pytest.mark.parametrize("script, line, named", MALFORMED_LINES.values(), ids=MALFORMED_LINES.keys())
def test_malformed_json_lines(tmp_path, script, line, named):
    """The bad line comes after a good one, so the run fails midway; nothing it wrote survives."""
    good = json.dumps(CHAT if script == SFT else {"text": "A good document."})
    src = write_lines(tmp_path / "docs.jsonl", [good, line])
    before = snapshot(tmp_path)
    result = run_script(script, src, "-o", tmp_path / "out")
    assert_refused(result, "OLMoDataError", "docs.jsonl' line 2", *named)
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.fixture
def unreadable(tmp_path) -> Path:
    """A JSON-lines input whose reading fails: no read permission, or as root a file that fails with EIO."""
    path = tmp_path / "locked.jsonl"
    if AS_ROOT:
        path.symlink_to("/proc/self/mem")  # reading offset 0 of a process's memory fails
    else:
        write_lines(path, [json.dumps(CHAT)])
        path.chmod(0)
    return path


@pytest.mark.parametrize("script", [MEMMAP, SFT])
def test_unreadable_input(tmp_path, unreadable, script):
    result = run_script(script, unreadable, "-o", tmp_path / "out")
    assert_refused(result, "OLMoDataError", "Cannot read", "locked.jsonl", "readable")
    assert [p.name for p in tmp_path.iterdir()] == ["locked.jsonl"]


@pytest.mark.parametrize(
    "script, problem",
    [
        (MEMMAP, "not gzip"),
        (MEMMAP, "truncated gzip"),
        (MEMMAP, "not UTF-8"),
        (SFT, "not gzip"),
        (SFT, "not UTF-8"),
    ],
)
def test_undecodable_files(tmp_path, script, problem):
    line = json.dumps(CHAT if script == SFT else {"text": "Ünïcødé"}).encode() + b"\n"
    if problem == "not UTF-8":
        src, named = tmp_path / "latin1.jsonl", ["latin1.jsonl' line 2 is not UTF-8", "byte 0xe9"]
        src.write_bytes(line + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    else:
        src = tmp_path / "docs.jsonl.gz"
        src.write_bytes(line if problem == "not gzip" else gzip.compress(line * 500)[:-20])
        named = ["docs.jsonl.gz' is not a complete gzip file", "drop '.gz'"]
    before = snapshot(tmp_path)
    result = run_script(script, src, "-o", tmp_path / "out")
    assert_refused(result, "OLMoDataError", *named)
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "script, args, named",
    [
        (MEMMAP, ["--val-fraction", "2"], ["--val-fraction 2.0 is not in [0, 1)"]),
        (MEMMAP, ["--val-fraction", "-0.1"], ["--val-fraction -0.1 is not in [0, 1)"]),
        (
            MEMMAP,
            ["--batch-size", "0", "--max-tokens-per-file", "-5"],
            ["--batch-size 0", "--max-tokens-per-file -5"],
        ),
        (SFT, ["--seq-len", "1", "--pad", "-1"], ["--seq-len 1 is too short", "--pad -1 is negative"]),
    ],
    ids=["val-fraction 2", "val-fraction negative", "zero sizes", "sft"],
)
def test_impossible_numbers_are_refused_by_argparse(tmp_path, script, args, named):
    src = write_lines(tmp_path / "docs.jsonl", [json.dumps({"text": "A document.", **CHAT})])
    result = run_script(script, src, "-o", tmp_path / "out", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert all(text in result.stderr for text in named), result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "script, lines, args, named",
    [
        (MEMMAP, ['{"text": "  "}', '{"text": ""}'], [], ["hold no document (2 empty ones skipped)"]),
        (
            MEMMAP,
            ['{"text": "One document."}'],
            ["--val-fraction", "0.5"],
            ["--val-fraction 0.5 put none of the 1"],
        ),
        (SFT, [], [], ["holds no conversation"]),
        (SFT, ['{"messages": [{"role": "user", "content": "No answer."}]}'], [], ["nothing would be trained on"]),
    ],
    ids=["empty documents", "empty val split", "empty chat file", "no assistant"],
)
def test_runs_that_would_write_nothing_fail(tmp_path, script, lines, args, named):
    src = write_lines(tmp_path / "docs.jsonl", lines)
    before = snapshot(tmp_path)
    result = run_script(script, src, "-o", tmp_path / "out", *args)
    assert_refused(result, "OLMoDataError", "docs.jsonl" if script == SFT else "out", *named)
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_input_mistakes(tmp_path):
    (tmp_path / "docs").mkdir()
    write_lines(tmp_path / "docs/a.jsonl", ['{"text": "A document."}'])
    result = run_script(MEMMAP, tmp_path / "docs", "-o", tmp_path / "out")  # --glob defaults to *.py
    assert_refused(result, "OLMoCliError", "docs' has no files matching --glob '*.py'", "--glob '*.jsonl'")
    result = run_script(SFT, tmp_path / "docs", "-o", tmp_path / "out")
    assert_refused(result, "OLMoCliError", "docs' is not a file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", [MEMMAP, SFT])
@pytest.mark.parametrize(
    "output, named",
    [
        ("taken.txt", "taken.txt' is a file"),
        ("taken.txt/out", "taken.txt' is a file"),
        pytest.param(
            "locked/out", "cannot write in", marks=pytest.mark.skipif(AS_ROOT, reason="root writes anywhere")
        ),
    ],
)
def test_unusable_output_paths(tmp_path, script, output, named):
    src = write_lines(tmp_path / "docs.jsonl", [json.dumps({"text": "A document.", **CHAT})])
    (tmp_path / "taken.txt").write_text("not a folder")
    (tmp_path / "locked").mkdir(mode=0o500)
    before = snapshot(tmp_path)
    result = run_script(script, src, "-o", tmp_path / output)
    assert_refused(result, "OLMoCliError", "-o/--output", named)
    assert snapshot(tmp_path) == before


def test_stale_part_files_are_refused_and_kept_when_a_run_fails(tmp_path):
    out = tmp_path / "out"
    for name in ("part-00000.npy", "part-00001.npy", "val/part-00000.npy", "notes.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b"old run " + name.encode())
    good = write_lines(tmp_path / "good.jsonl", ['{"text": "A document."}'])
    bad = write_lines(tmp_path / "bad.jsonl", ['{"text": "Fine."}', "not json"])
    before = snapshot(out)

    result = run_script(MEMMAP, good, "-o", out)
    assert_refused(result, "OLMoCliError", "already holds 3 part file(s)", "--overwrite")
    # --overwrite replaces the old parts only once the new run has succeeded.
    result = run_script(
        MEMMAP, good, bad, "-o", out, "--overwrite", "--batch-size", "1", "--max-tokens-per-file", "1"
    )
    assert_refused(result, "OLMoDataError", "bad.jsonl' line 2")
    assert snapshot(out) == before  # hidden files included: the run wrote its parts in out/.out.partial-*

    (out / "input_ids.npy").write_bytes(b"old run")
    result = run_script(SFT, write_lines(tmp_path / "chat.jsonl", [json.dumps(CHAT)]), "-o", out)
    assert_refused(result, "OLMoCliError", "already holds input_ids.npy", "--overwrite")
    assert snapshot(out) == {**before, "input_ids.npy": b"old run"}


def test_overwrite_leaves_exactly_the_new_runs_files(tmp_path, tokenizer):
    out = tmp_path / "out"
    for name in ("part-00000.npy", "part-00001.npy", "val/part-00000.npy", "train/part-00009.npy", "notes.txt"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b"old run")
    docs = [f"Document number {i}." for i in range(20)]
    src = write_lines(tmp_path / "docs.jsonl", [json.dumps({"text": d}) for d in docs])

    result = run_script(MEMMAP, src, "-o", out, "--overwrite", "--val-fraction", "0.5")
    assert result.returncode == 0, result.stderr
    assert set(snapshot(out)) == {"notes.txt", "train", "train/part-00000.npy", "val", "val/part-00000.npy"}
    tokens = np.concatenate(
        [np.memmap(out / f"{s}/part-00000.npy", dtype=np.uint16, mode="r") for s in ("train", "val")]
    )
    assert sorted(tokens.tolist()) == sorted(i for d in docs for i in tokenizer.encode(d))
    assert "Replaced 4 part file(s)" in result.stderr

    # Back to one folder: the train/ and val/ that now hold no part file go too.
    result = run_script(MEMMAP, src, "-o", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert set(snapshot(out)) == {"notes.txt", "part-00000.npy"}

    chat = write_lines(tmp_path / "chat.jsonl", [json.dumps(CHAT)])
    assert run_script(SFT, chat, "-o", out, "--seq-len", "16").returncode == 0
    (out / "label_mask.npy").write_bytes(b"old run")
    assert run_script(SFT, chat, "-o", out, "--seq-len", "16", "--overwrite").returncode == 0
    assert np.memmap(out / "label_mask.npy", dtype=np.bool_, mode="r").shape == (16,)


def test_text_key_reads_another_field(tmp_path, tokenizer):
    docs = ["The quick brown fox.", "Jumps over\nthe lazy dog!"]
    src = write_lines(tmp_path / "docs.jsonl", [json.dumps({"content": d, "id": i}) for i, d in enumerate(docs)])
    result = run_script(MEMMAP, src, "-o", tmp_path / "out", "--text-key", "content")
    assert result.returncode == 0, result.stderr
    written = np.memmap(tmp_path / "out/part-00000.npy", dtype=np.uint16, mode="r")
    assert written.tolist() == [i for d in docs for i in tokenizer.encode(d)]
