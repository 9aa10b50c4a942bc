"""Issue 50 (robustness round 4), the GPU checks (scripts/gpu_checks.py, ``make gpu-wheels``) under hostile and
mistaken input: every file they read is a regular file within a stated size (a FIFO, ``/dev/zero`` or a directory
named like a wheel, a report or a table is refused without blocking or reading it), a zip member unpacks within its
limit, a member name that leaves the install folder refuses its wheel, every numeric flag is checked, and a wheel
file name that is not the wheel spec's is one problem naming the file, never a traceback."""

import json
import os
import socket
import sys
import threading
import zipfile

import pytest

from olmo.bench import gpu_checks, gpu_checks_table, gpu_wheels
from olmo.bench.gpu_checks import Part, run_part
from olmo.bench.gpu_checks_table import Result, markdown_table
from olmo.bench.gpu_wheels import check_wheels, parse_wheel_name, tags_fit
from olmo.exceptions import OLMoDataError
from olmo.util.bounded_files import (
    member_name_problem,
    open_regular,
    open_zip,
    read_bounded,
    read_member,
    read_tail,
)


def _wheel(folder, name="x", version="1.0", tag="py3-none-any", files=None, metadata=None, filename=None):
    """A real wheel (a zip pip installs) holding its metadata and ``files``."""
    info = f"{name}-{version}.dist-info"
    path = folder / (filename or f"{name}-{version}-{tag}.whl")
    contents = {
        **(files or {}),
        f"{info}/METADATA": metadata or f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nbody\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in contents.items():
            z.writestr(member, data)
        z.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in [*contents, f"{info}/RECORD"]))
    return path


def _problems(folder):
    """The problems of ``folder`` that are not about the gathered set being incomplete."""
    return [str(p) for p in check_wheels(folder, "3.12") if "missing: run" not in str(p)]


def _finishes(fn, fifo=None):
    """Run ``fn`` in a thread and return its result; fail (instead of hanging the suite) if it blocks, and then
    release a reader blocked on ``fifo``."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the test's own thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not thread.is_alive(), "blocked on a file it should have refused by its type"
    if "error" in box:
        raise box["error"]
    return box["result"]


# Memory and time without bound: only regular files within a stated size are read.


def test_a_wheel_that_is_a_symlink_to_dev_zero_is_refused_unread(tmp_path):
    (tmp_path / "zero-1.0-py3-none-any.whl").symlink_to("/dev/zero")
    assert _problems(tmp_path) == [
        "zero-1.0-py3-none-any.whl: is a character device, not a regular file: only regular files (or symlinks to "
        "them) are read; remove it or run `make gpu-wheels` again"
    ]


def test_a_fifo_named_like_a_wheel_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo-1.0-py3-none-any.whl"
    os.mkfifo(fifo)
    problems = _finishes(lambda: _problems(tmp_path), fifo)
    assert len(problems) == 1 and "fifo-1.0-py3-none-any.whl: is a named pipe (FIFO)" in problems[0]


def test_a_zip_bomb_metadata_is_refused_once_it_unpacks_past_its_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_wheels, "METADATA_LIMIT", 1 << 16)
    bomb = "Metadata-Version: 2.1\nName: bomb\nVersion: 1.0\n" + "\n" * (1 << 20)  # 1 MiB deflates to ~1 KB
    _wheel(tmp_path, "bomb", metadata=bomb)
    (problem,) = _problems(tmp_path)
    assert "has a member 'bomb-1.0.dist-info/METADATA' that unpacks past its limit of 64.0 KiB" in problem


@pytest.mark.parametrize("kind", ["directory", "symlink to a directory", "dangling symlink", "socket"])
def test_other_entries_named_like_wheels_are_refused_by_their_type(tmp_path, kind):
    entry = tmp_path / "odd-1.0-py3-none-any.whl"
    if kind == "directory":
        entry.mkdir()
    elif kind == "symlink to a directory":
        entry.symlink_to(tmp_path)
    elif kind == "dangling symlink":
        entry.symlink_to(tmp_path / "gone.whl")
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(entry))
        server.close()
    expected = {
        "directory": "is a directory, not a regular file",
        "symlink to a directory": "is a directory, not a regular file",
        "dangling symlink": "is a symlink whose target does not exist",
        "socket": "is a socket, not a regular file",
    }[kind]
    assert [p.split(": ", 1) for p in _problems(tmp_path)] == [
        ["odd-1.0-py3-none-any.whl", f"{expected}" + _rest(expected)]
    ]


def _rest(expected):
    if "not a regular file" in expected:
        return ": only regular files (or symlinks to them) are read; remove it or run `make gpu-wheels` again"
    return "; remove it or run `make gpu-wheels` again"


def test_a_wheel_over_its_size_limit_is_refused_by_its_size_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_wheels, "WHEEL_LIMIT", 1000)
    _wheel(tmp_path, "big", files={"big/data.bin": os.urandom(4000)})
    (problem,) = _problems(tmp_path)
    assert problem.startswith("big-1.0-py3-none-any.whl: is 4.") and "over its limit of 1000 bytes" in problem


def test_too_many_members_or_too_large_an_unpacked_total_refuse_a_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_wheels, "MAX_MEMBERS", 5)
    _wheel(tmp_path, "many", files={f"many/{i}.py": "" for i in range(10)})
    (problem,) = _problems(tmp_path)
    assert "is a zip archive of 13 members" in problem and "at most 5 are read" in problem
    monkeypatch.setattr(gpu_wheels, "MAX_MEMBERS", 100)
    monkeypatch.setattr(gpu_wheels, "UNPACKED_LIMIT", 1 << 16)
    (tmp_path / "many-1.0-py3-none-any.whl").unlink()
    _wheel(tmp_path, "huge", files={"huge/zeros.bin": b"\0" * (1 << 20)})
    (problem,) = _problems(tmp_path)
    assert "unpacks to 1.0 MiB, over its limit of 64.0 KiB" in problem


def test_a_zip64_end_record_is_refused_before_zipfile_reads_its_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 2)  # makes zipfile write a ZIP64 end record
    _wheel(tmp_path, "z64")
    monkeypatch.undo()
    (problem,) = _problems(tmp_path)
    assert "is a ZIP64 archive" in problem


def test_a_folder_with_too_many_entries_is_one_problem_not_an_endless_listing(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_wheels, "MAX_ENTRIES", 3)
    for i in range(6):
        (tmp_path / f"junk{i}.txt").write_text("")
    assert f"{tmp_path}: holds more than 3 entries; clean it" in _problems(tmp_path)
    (tmp_path / "original").write_text("not a folder")
    assert any(p.startswith(f"{tmp_path / 'original'}: cannot be listed") for p in _problems(tmp_path))


def test_the_bounded_readers_refuse_by_type_and_size(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OLMoDataError, match="^The table 'x' is a named pipe"):
        _finishes(lambda: read_bounded(fifo, 10, "The table 'x'"), fifo)
    with pytest.raises(OLMoDataError, match="is a character device"):
        open_regular("/dev/zero", 10)
    with pytest.raises(OLMoDataError, match="does not exist"):
        read_bounded(tmp_path / "absent", 10)
    (tmp_path / "f").write_bytes(b"0123456789abc")
    with pytest.raises(OLMoDataError, match="is 13 bytes, over its limit of 12 bytes"):
        read_bounded(tmp_path / "f", 12)
    assert read_bounded(tmp_path / "f", 13) == b"0123456789abc"
    assert read_tail(tmp_path / "f", 3) == b"abc" and read_tail(tmp_path / "f", 100) == b"0123456789abc"
    with pytest.raises(OLMoDataError, match="not a readable zip archive"):
        with open_zip(tmp_path / "f", 100):
            pass


def test_a_member_is_read_in_chunks_and_refused_past_its_limit_whatever_its_header_says(tmp_path):
    path = _wheel(tmp_path, "m", files={"m/a.txt": "a" * 5000})
    with open_zip(path, 1 << 20) as z:
        assert len(read_member(z, "m/a.txt", 5000)) == 5000
        with pytest.raises(
            OLMoDataError, match=f"^'{path}' has a member 'm/a.txt' that unpacks past its limit of 4.9 KiB"
        ):
            read_member(z, "m/a.txt", 4999)
        with pytest.raises(OLMoDataError, match="cannot be unpacked"):
            read_member(z, "m/absent.txt", 10)
    # A header that declares fewer bytes than the member holds: the member is cut there and its CRC fails.
    data = bytearray(path.read_bytes())
    declared = (5000).to_bytes(4, "little")
    assert data.count(declared) == 2  # the uncompressed size in the local header and in the directory
    path.write_bytes(bytes(data).replace(declared, (10).to_bytes(4, "little")))
    with open_zip(path, 1 << 20) as z:
        with pytest.raises(OLMoDataError, match="cannot be unpacked"):
            read_member(z, "m/a.txt", 100)


def test_a_report_or_log_that_is_not_a_regular_file_or_too_large_becomes_a_note(tmp_path, monkeypatch):
    report = tmp_path / "r.json"
    link = run_part(
        Part("zero", "links", [["ln", "-s", "/dev/zero", str(report)]], 30, report=str(report)), {}, 30
    )
    assert link.status == "ok" and link.numbers == {}
    assert link.note.startswith("its report could not be read (OLMoDataError: its report is a character device")
    monkeypatch.setattr(gpu_checks_table, "REPORT_LIMIT", 100)
    report.unlink()
    big = f"open({str(report)!r}, 'w').write('{{\"results\": {{}}, \"pad\": \"' + 'x' * 1000 + '\"}}')"
    large = run_part(Part("big", "writes", [[sys.executable, "-c", big]], 30, report=str(report)), {}, 30)
    assert "over its limit of 100 bytes" in large.note
    # A part that prints without end: only the last LOG_TAIL bytes are read back.
    monkeypatch.setattr(gpu_checks, "LOG_TAIL", 4096)
    noisy = [sys.executable, "-c", "print('ValueError: early ' * 100000); print('last line')"]
    loud = run_part(Part("loud", "prints", [noisy], 30), {}, 30)
    assert loud.status == "ok" and loud.tail.endswith("last line\n") and len(loud.tail) <= 3000


# Silent wrong results: a member name that leaves the install folder refuses its wheel.


@pytest.mark.parametrize(
    "member, why",
    [
        ("../../etc/evil.py", "has a '..' component"),
        ("x/../../evil.py", "has a '..' component"),
        ("/etc/evil.py", "is an absolute path"),
        ("x\\..\\evil.py", "holds a backslash"),
        ("C:/evil.py", "starts with a drive letter"),
        ("x/evil\n.py", "holds a control character"),
    ],
)
def test_a_wheel_with_a_member_outside_its_folder_is_refused_naming_the_member(tmp_path, member, why):
    _wheel(tmp_path, "evil", files={member: "print('owned')"})
    (problem,) = _problems(tmp_path)
    assert problem.startswith(f"evil-1.0-py3-none-any.whl: holds a member {member!r} that {why}"), problem


def test_a_member_name_with_a_nul_or_a_symlink_member_is_refused(tmp_path):
    path = _wheel(tmp_path, "nul", files={"nul/aXb.py": ""})
    path.write_bytes(path.read_bytes().replace(b"nul/aXb.py", b"nul/a\0b.py"))  # zipfile cannot write a NUL
    (problem,) = _problems(tmp_path)
    assert "holds a member 'nul/a\\x00b.py' that holds a control character" in problem
    path.unlink()
    link = _wheel(tmp_path, "lnk")
    with zipfile.ZipFile(link, "a") as z:
        info = zipfile.ZipInfo("lnk/escape")
        info.external_attr = 0o120777 << 16
        z.writestr(info, "/etc/passwd")
    (problem,) = _problems(tmp_path)
    assert "holds a member 'lnk/escape' that is a symlink" in problem
    assert member_name_problem("olmo/__init__.py") is None and member_name_problem("a/..b/c..") is None


# Numeric flags: finite, in range, one paragraph naming the flag.


@pytest.mark.parametrize("budget", ["nan", "-5", "inf", "-inf", "1e300", "86401", "-0.001"])
def test_a_budget_that_is_not_finite_or_out_of_range_is_refused_naming_the_flag(budget, capsys, tmp_path):
    assert gpu_checks.main([f"--budget={budget}", "--out", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"--budget {float(budget)} is not a number of seconds from 0 to 86400") and "\n" not in (
        out.strip()
    )
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_budget_that_is_not_a_number_is_argparses_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_checks.main(["--budget", "soon"])
    assert stop.value.code == 2 and "argument --budget: invalid float value: 'soon'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "version", ["3.x", "python3.12", "3", "3.12.1", "2.7", "", "3.123", "\u0663.\u0661\u0662"]
)
def test_a_python_version_that_is_not_3_n_is_refused_naming_the_flag(version, capsys):
    assert gpu_checks.main(["--dry-run", "--python-version", version]) == 2
    assert capsys.readouterr().out.startswith(f"--python-version {version!r} is not a CPython 3 version")


def test_unknown_parts_are_refused_before_anything_is_written(tmp_path, capsys):
    assert gpu_checks.main(["--only", "environment,nope", "--out", str(tmp_path / "out")]) == 2
    assert "--only names unknown parts ['nope']" in capsys.readouterr().out and not (tmp_path / "out").exists()


# Tracebacks: a wheel file name is parsed by the wheel spec; a malformed one is one problem naming the file.

MALFORMED = [
    "x-1.0-py3-any.whl",  # a field missing
    "x-1.0.whl",
    "x.whl",
    ".whl",
    "x-1.0-cp3x-none-any.whl",  # a python tag that is no implementation and version
    "x-1.0-cp312abi3-none-any.whl",
    "x-1.0-1-2-py3-none-any.whl",  # too many dashes
    "x-1.0-abc-py3-none-any.whl",  # a build tag must start with a digit
    "\u1e8b-1.0-py3-none-any.whl",  # not ASCII
    "x-1.0-py3..py2-none-any.whl",  # an empty tag
    "x-1.0-py3-NONE-any.whl",  # tags are lowercase
    "x-1.0-py3-none-any\n- fake line.whl",  # a newline cannot forge a line of the report
]


@pytest.mark.parametrize("filename", MALFORMED)
def test_a_malformed_wheel_file_name_is_one_problem_naming_the_file(tmp_path, filename):
    _wheel(tmp_path, filename=filename)
    (problem,) = _problems(tmp_path)
    shown = filename if filename.isprintable() else ascii(filename)
    assert problem.startswith(f"{shown}: is not a wheel's file name: ") and "rename it or remove it" in problem
    assert "\n" not in problem


def test_a_file_name_that_is_not_utf8_is_a_problem_not_a_crash_and_the_dry_run_says_not_ready(tmp_path, capsys):
    os.close(os.open(os.fsencode(tmp_path) + b"/x\xff-1.0-py3-none-any.whl", os.O_CREAT | os.O_WRONLY))
    _wheel(tmp_path, filename="x-1.0-cp3x-none-any.whl")
    assert gpu_checks.main(["--dry-run", "--wheels", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "NOT ready" in out and "'x\\udcff-1.0-py3-none-any.whl': is not a wheel's file name" in out
    assert "x-1.0-cp3x-none-any.whl: is not a wheel's file name: its python tag 'cp3x' is not" in out


@pytest.mark.parametrize(
    "filename, fits",
    [
        ("cryptography-50.0.2-cp311-abi3-manylinux_2_28_x86_64.whl", True),
        ("numpy-2.0.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
        ("six-1.0-py2.py3-none-any.whl", True),
        ("x-1.0-1build-py3-none-any.whl", True),
        ("x-1.0-cp313-abi3-manylinux_2_17_x86_64.whl", False),
        ("x-1.0-cp312-cp312-win_amd64.whl", False),
        ("x-1.0-cp312-cp312-musllinux_1_1_x86_64.whl", False),
        ("x-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", False),
        ("x-1.0-pp310-pypy310_pp73-any.whl", False),
    ],
)
def test_well_formed_names_fit_or_not_by_their_tags(filename, fits):
    assert tags_fit(parse_wheel_name(filename), "3.12") is fits


# --out: the table is written only over an earlier table, never through a link or into a FIFO.


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "foreign file", "foreign json"])
def test_an_out_folder_whose_table_files_are_not_earlier_results_is_refused_untouched(tmp_path, kind, capsys):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    path = out / ("gpu_checks.json" if kind == "foreign json" else "gpu_checks.md")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(target)
    elif kind == "directory":
        path.mkdir()
    elif kind == "foreign file":
        path.write_text("# my notes\n")
    else:
        path.write_text(json.dumps({"name": "x"}))
    code = _finishes(lambda: gpu_checks.main(["--out", str(out), "--only", "environment"]), path)
    assert code == 2
    message = capsys.readouterr().out
    assert message.startswith(f"--out {out} ") and "pick a writable folder" in message
    assert target.read_text() == "keep me"
    assert (
        path.is_fifo()
        or path.is_symlink()
        or path.is_dir()
        or path.read_text() in ("# my notes\n", '{"name": "x"}')
    )


def test_an_out_that_is_a_symlink_loop_is_one_paragraph(tmp_path, capsys):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert gpu_checks.main(["--out", str(tmp_path / "loop" / "out")]) == 2
    assert "cannot be" in capsys.readouterr().out


def test_report_numbers_of_the_wrong_type_never_break_the_table(tmp_path):
    report = tmp_path / "r.json"
    for content in (
        '{"results": {"tokens_per_second": "fast", "mfu": "high", "peak_memory_mb": [1]}}',
        '{"summary": {"loss": 1.5, "deep": {"a": 1}, "text": "a|b\\nc"}}',
        "[1, 2]",
        "[" * 100000 + "]" * 100000,
    ):
        report.write_text(content)
        result = run_part(Part("r", "reads", [["true"]], 30, report=str(report)), {}, 30)
        table = markdown_table([result])
        assert result.status == "ok" and len(table.splitlines()) == 3, table
        assert all(isinstance(v, (int, float, str)) for v in result.numbers.values())
    probe = run_part(Part("environment", "probes", [[sys.executable, "-c", "print(5)"]], 30), {}, 30)
    assert (
        probe.numbers == {}
        and probe.note == "its report could not be read (TypeError: a JSON int where an object belongs)"
    )
    assert "| environment | probes | ok |" in markdown_table([probe, Result("p", "w", "not run")])


def test_a_wheel_folder_that_is_not_a_folder_is_one_problem(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert [str(p) for p in _finishes(lambda: check_wheels(fifo), fifo)] == [
        f"{fifo}: is not a folder: run `make gpu-wheels` here first"
    ]
    (problem,) = check_wheels(tmp_path / ("a" * 5000))
    assert "cannot be read (File name too long)" in str(problem)
    folder = tmp_path / "wheels"
    folder.mkdir()
    os.mkfifo(folder / "original")
    assert f"{folder / 'original'}: cannot be listed (Not a directory); it must be a folder" in _finishes(
        lambda: _problems(folder), folder / "original"
    )


def test_gathering_refuses_a_manifest_link_and_an_unsafe_downloaded_wheel_before_writing(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    (tmp_path / "precious.json").write_text("keep me")
    (folder / "manifest.json").symlink_to(tmp_path / "precious.json")
    with pytest.raises(RuntimeError, match="manifest.json is not a regular file"):
        gpu_wheels.gather(folder)  # refused before pip is asked for anything
    assert (tmp_path / "precious.json").read_text() == "keep me"
    source = _wheel(tmp_path, "ai2-olmo", files={"olmo/../../evil.py": ""})
    with pytest.raises(OLMoDataError, match="holds a member 'olmo/../../evil.py' that has a '..' component"):
        gpu_wheels.trim_wheel(source, tmp_path / "trimmed.whl", ("olmo/",))
    assert not (tmp_path / "trimmed.whl").exists()
