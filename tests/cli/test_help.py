"""``--help`` on every script, and ``scripts/train.py CONFIG --help``: every config field with its value and doc."""

import dataclasses
import importlib.util
import inspect
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import pytest
import torch.distributed

from olmo.config import TrainConfig
from olmo.config.docs import field_docs, format_value, undocumented_fields
from olmo.exceptions import OLMoConfigurationError, OLMoDataError
from olmo.testing import run_main, run_script, tiny_config_dict, write_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def config(tmp_path) -> Path:
    values = tiny_config_dict(
        tmp_path / "run",
        ["train.npy"],
        evaluators=[{"label": "held-out", "data": {"paths": ["val.npy"]}}],
        wandb={"project": "help-test"},
    )
    return write_config(tmp_path / "tiny.yaml", values)


def _leaves(obj: Any, prefix: str = ""):
    """(dotted key, value) of every non-section field of a config, list entries as ``key[i]``."""
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{key}.")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from _leaves(item, f"{key}[{i}].")
        else:
            yield key, value, field_docs(type(obj)).get(f.name, "")


def _rows(output: str) -> dict[str, str]:
    """The listing's lines by their dotted key."""
    return {line.split()[0]: line for line in output.splitlines() if line.startswith("  ") and line.strip()}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_config_help_lists_every_field_with_its_value_and_doc(tmp_path, config, capsys, where):
    args = {
        "first": ["--help", config, "--model.n_layers=3", "--data.paths=[a.npy,b.npy]"],
        "middle": [config, "--model.n_layers=3", "-h", "--data.paths=[a.npy,b.npy]"],
        "last": [config, "--model.n_layers=3", "--data.paths=[a.npy,b.npy]", "--help"],
    }[where]
    assert run_main("train.py", *args) == 0
    out = capsys.readouterr().out
    assert "--try_load_latest_save" in out  # what the script does and how overrides work come first
    rows = _rows(out)
    cfg = TrainConfig.load(config, ["--model.n_layers=3", "--data.paths=[a.npy,b.npy]"])
    for key, value, doc in _leaves(cfg):
        assert key in rows, f"{key} is missing from the listing"
        assert format_value(value) in rows[key], f"{key}={value!r} is not shown as such: {rows[key]!r}"
        if doc:
            assert doc.splitlines()[0][:40] in rows[key], f"{key}'s doc is missing: {rows[key]!r}"
    assert rows["model.n_layers"].split()[1] == "3"  # the override, not the file's 2
    assert rows["data.paths"].split()[1:3] == ["[a.npy,", "b.npy]"]
    assert rows["model.d_model"].split()[1:] == ["32", "Hidden", "size."]
    assert rows["evaluators[0].label"].split()[1] == "held-out"
    assert rows["wandb.project"].split()[1] == "help-test"
    assert "compile.mode" in rows, "a null section's fields are listed with their defaults"
    assert not (tmp_path / "run").exists(), "--help wrote something"
    assert not torch.distributed.is_initialized()


def test_config_help_shortens_long_lists(config, capsys):
    paths = ",".join(f"/data/dolma/part-{i:05d}.npy" for i in range(1000))
    assert run_main("train.py", config, f"--data.paths=[{paths}]", "--help") == 0
    row = _rows(capsys.readouterr().out)["data.paths"]
    assert "/data/dolma/part-00000.npy" in row and "(1000 in all)" in row and len(row) < 250


def test_config_help_reports_a_config_error_as_usual(config, capsys):
    with pytest.raises(OLMoConfigurationError, match=r"model\.n_layer\b.*Did you mean: 'n_layers'"):
        run_main("train.py", config, "--model.n_layer=3", "--help")
    assert capsys.readouterr().out == ""


def test_every_config_field_has_a_docstring():
    """The --help listing shows each field's docstring: a new field must come with one."""
    missing = undocumented_fields(TrainConfig)
    assert not missing, (
        f"{len(missing)} config field(s) have no docstring (a string literal on the line after the field in "
        f"olmo/config/train_config.py): {', '.join(missing)}"
    )


@dataclasses.dataclass
class _Inner:
    documented: int = 1
    """Documented, on
    two lines."""
    bare: int = 2


@dataclasses.dataclass
class _Outer:
    inner: Optional[_Inner] = None
    """A section."""
    entries: list[_Inner] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Derived(_Inner):
    bare: int = 3
    """Documented in the subclass."""


def test_field_docs_are_read_from_the_source_of_any_dataclass():
    assert field_docs(_Inner) == {"documented": "Documented, on\ntwo lines."}
    assert field_docs(_Derived) == {
        "documented": "Documented, on\ntwo lines.",
        "bare": "Documented in the subclass.",
    }
    assert undocumented_fields(_Outer) == ["inner.bare", "entries"]
    assert undocumented_fields(_Derived) == []


def _command(path: Path) -> Any:
    """The ``olmo.cli`` module behind ``scripts/NAME.py``, or None for a script without one (shell scripts, and
    ``olmo_original_worker.py``, which runs in the original OLMo's virtualenv)."""
    if path.suffix != ".py" or importlib.util.find_spec(f"olmo.cli.{path.stem}") is None:
        return None
    return importlib.import_module(f"olmo.cli.{path.stem}")


def _help_in_process(module: Any, name: str, args: list[str]) -> Any:
    """Run ``module.main`` as ``python scripts/NAME ARGS`` would; return its exit code. ``main(argv=None)``
    takes the arguments without the program name, as argparse does; ``main(argv)`` takes ``sys.argv``."""
    without_program = next(iter(inspect.signature(module.main).parameters.values())).default is None
    try:
        result = module.main(args if without_program else [name, *args])
    except SystemExit as e:  # argparse's --help
        return e.code
    return result if isinstance(result, int) else 0


def test_every_script_honours_help_wherever_it_stands(config, capsys):
    """Scripts with ``main(argv)`` run in this process (no interpreter start or imports); the rest run as a
    user runs them, in parallel."""
    lines = [["--help"], [str(config), "--help"], ["-h", str(config)]]
    scripts = sorted(p for p in (REPO / "scripts").iterdir() if p.suffix in (".py", ".sh"))
    in_process = {}
    for path in scripts:
        module = _command(path)
        if module is not None and inspect.signature(getattr(module, "main", lambda: None)).parameters:
            in_process[path.name] = module
    with ThreadPoolExecutor(max_workers=4) as pool:
        launched = {
            (path.name, i): pool.submit(_run_as_user, path, args)
            for path in scripts
            if path.name not in in_process
            for i, args in enumerate(lines)
        }
        failures = []
        for name, module in in_process.items():
            for args in lines:
                code = _help_in_process(module, name, args)
                out = capsys.readouterr().out
                if code != 0 or not out.strip():
                    failures.append(f"{name} {' '.join(args)}: exit {code}, output {out[-300:]!r}")
        for (name, i), future in launched.items():
            result = future.result()
            if result.returncode != 0 or not result.stdout.strip():
                failures.append(f"{name} {' '.join(lines[i])}: exit {result.returncode}, {result.stderr[-300:]!r}")
    assert not failures, "\n".join(failures)


def _run_as_user(path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    if path.suffix == ".sh":
        return subprocess.run(["bash", str(path), *args], capture_output=True, text=True, timeout=60)
    return run_script(path.name, *args, timeout=120)


def test_help_and_plans_need_no_data(tmp_path, capsys):
    """On a fresh clone, before the quickstart prepared data/quickstart: --help lists the fields, --dry_run prints
    the plan and then names the missing data, and the ladder's dry run plans every size."""
    import shutil

    shutil.copytree(REPO / "configs", tmp_path / "configs")  # their paths are relative to the working directory
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        assert run_main("train.py", "configs/tiny/OLMo-tiny.yaml", "--help") == 0
        assert "data.paths" in capsys.readouterr().out
        with pytest.raises(
            OLMoDataError, match=r"data\.paths entry 'data/quickstart/train/\*\.npy' matches no file"
        ):
            run_main("train.py", "configs/tiny/OLMo-tiny.yaml", "--dry_run")
        assert "duration: 150 steps" in capsys.readouterr().out
        assert run_main("ladder.py", "dry-run", "configs/ladder/tiny.yaml", "--json") == 0
        assert len(json.loads(capsys.readouterr().out)) >= 2
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]  # nothing written


def test_help_piped_into_a_reader_that_stops_early_ends_quietly(config):
    """``train.py CONFIG --help | head``: no BrokenPipeError traceback, exit 0."""
    import sys

    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts/train.py"), str(config), "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the help is printed (seconds of imports), as `| head -0`
    assert proc.wait(timeout=120) == 0
    assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()


@pytest.mark.slow
def test_help_under_torchrun_is_printed_once(config):
    from olmo.testing import run_torchrun

    result = run_torchrun(2, config, "--help", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("Train an OLMo model.") == 1
