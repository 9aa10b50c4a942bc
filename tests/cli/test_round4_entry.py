"""The training command's front (issue 50, round 4): ``--help``, usage and config errors answered before torch is
imported; a value of the wrong type named as a bad value, not as a bad key; ``make`` installing the package only
when the setup files changed."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from olmo.config import TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import REPO, tiny_config_dict, write_config

# Each case calls main() with these arguments, expects this exception (or None: return 0) and this text in it.
FRONT_CASES = [
    (["--help"], None, ""),
    (["-h", "CONFIG"], None, ""),
    ([], "OLMoCliError", "Usage: scripts/train.py CONFIG.yaml"),
    (["--dry_run"], "OLMoCliError", "Usage: scripts/train.py CONFIG.yaml"),
    (["MISSING.yaml"], "OLMoConfigurationError", "does not exist"),
    (
        ["CONFIG", "--model.n_layers=abc"],
        "OLMoConfigurationError",
        "Invalid value for config key 'model.n_layers'",
    ),
    (["CONFIG", "--model.nlayers=2"], "OLMoConfigurationError", "Invalid config key 'model.nlayers'"),
    (["CONFIG", "--save_folder"], "OLMoCliError", "--save_folder needs a value"),
    (["CONFIG", "--model.n_heads=3"], "OLMoConfigurationError", "must be divisible by model.n_heads=3"),
    (["CONFIG", "--max_duration=-1"], "OLMoConfigurationError", "max_duration"),
]
PROBE = """
import contextlib, io, sys
from olmo.cli.train import main
config = sys.argv[1]
for argv, error, text in {cases!r}:
    argv = [config if a == "CONFIG" else a for a in argv]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main(argv)
        assert error is None and code == 0 and "scripts/train.py CONFIG.yaml" in out.getvalue(), (argv, code)
    except Exception as e:
        assert type(e).__name__ == error and text in str(e), (argv, e)
    assert "torch" not in sys.modules, f"{{argv}} imported torch"
print("ok", len({cases!r}))
"""


def test_help_usage_and_config_errors_are_answered_before_torch_is_imported(tmp_path):
    # With a downstream evaluator, as the quickstart's config has: its label is checked against ai2-olmo-eval's list,
    # read without importing olmo_eval (which imports torch).
    raw = tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")])
    raw["evaluators"] = [{"label": "piqa", "type": "downstream"}]
    config = write_config(tmp_path / "c.yaml", raw)
    cases = [
        *FRONT_CASES,
        (["CONFIG", "--evaluators.0.label=piqaa"], "OLMoConfigurationError", "Did you mean 'piqa'"),
    ]
    probe = PROBE.format(cases=cases)
    result = subprocess.run(
        [sys.executable, "-c", probe, str(config)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"ok {len(cases)}"
    assert not (tmp_path / "run").exists()


def _load_error(tmp_path: Path, overrides: list[str], **in_file) -> str:
    raw = tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")])
    raw.update(in_file)
    config = write_config(tmp_path / "c.yaml", raw)
    with pytest.raises(OLMoConfigurationError) as e:
        TrainConfig.load(config, overrides)
    return str(e.value)


@pytest.mark.parametrize(
    "overrides, in_file, key",
    [
        (["--model.n_layers=abc"], {}, "model.n_layers"),  # the example
        (["--seed=[1,2]"], {}, "seed"),  # a list for a number
        (["--model.n_layers={a: 1}"], {}, "model.n_layers"),  # a mapping for a number
        (["--save_overwrite=maybe"], {}, "save_overwrite"),  # not a boolean
        (["--model.sliding_window=4096"], {}, "model.sliding_window"),  # one value for a section
        (["--optimizer=adamw"], {}, "optimizer"),
        ([], {"seed": "x"}, "seed"),  # in the YAML file
        ([], {"max_grad_norm": [1.0]}, "max_grad_norm"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_as_a_bad_value_of_its_key(tmp_path, overrides, in_file, key):
    message = _load_error(tmp_path, overrides, **in_file)
    assert message.startswith(f"Invalid value for config key '{key}' ("), message
    assert "Invalid config key" not in message
    assert "Fix the value" in message or f"--{key}.FIELD=VALUE" in message


@pytest.mark.parametrize(
    "overrides, in_file, key",
    [
        (["--model.nlayers=2"], {}, "model.nlayers"),
        (["--model={a: 1}"], {}, "model.a"),  # an unknown key inside a mapping value
        ([], {"sed": 1}, "sed"),
    ],
)
def test_an_unknown_key_keeps_its_own_wording(tmp_path, overrides, in_file, key):
    message = _load_error(tmp_path, overrides, **in_file)
    assert f"Invalid config key '{key}' (" in message, message
    assert "Invalid value for" not in message and "Remove or rename that key" in message


@pytest.fixture
def make_tree(tmp_path):
    """The Makefile and setup files in a folder of their own, with a stand-in virtualenv (its interpreter exists)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "setup.py", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "venv/bin").mkdir(parents=True)
    (tmp_path / "venv/bin/python").touch()
    return tmp_path


def _planned(tree: Path, target: str) -> str:
    """What ``make TARGET`` would run (``make -n``: nothing runs)."""
    result = subprocess.run(
        ["make", "-n", target, "VENV=venv"], cwd=tree, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_make_installs_the_package_only_when_the_setup_files_changed(make_tree):
    pip = "pip install --progress-bar off -e"
    assert pip in _planned(make_tree, "install")  # a fresh clone (no stamp): installed
    stamp = make_tree / "venv/.installed"
    stamp.touch()
    later = stamp.stat().st_mtime + 10
    os.utime(stamp, (later, later))
    for target in ("install", "test", "test-quick", "checks"):
        assert pip not in _planned(make_tree, target), target
    for setup in ("pyproject.toml", "setup.py"):
        os.utime(make_tree / setup, (later + 10, later + 10))  # edited after the install
        assert pip in _planned(make_tree, "test"), setup
        os.utime(stamp, (later + 20, later + 20))
        later += 20
    stamp.unlink()  # the documented way to force a reinstall
    assert pip in _planned(make_tree, "test-quick")
