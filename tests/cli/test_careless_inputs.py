"""Careless and hostile inputs to the newest commands (issue 25), through their real entry points: a config that
comes with a checkpoint never reads the environment, outputs never land inside inputs, run names are names, and
URLs with a slash missing are refused before anything is written."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from olmo.checkpoint import MARKER
from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError
from olmo.testing import run_main, run_script, run_train, tiny_config_dict, write_config


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return h.hexdigest()


def test_a_checkpoints_config_never_reads_the_environment(tmp_path, run):
    checkpoint = tmp_path / "step2-unsharded"
    checkpoint.mkdir()
    for f in (run / "step2-unsharded").iterdir():
        (checkpoint / f.name).write_bytes(f.read_bytes())
    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    config["evaluators"] = [
        {"label": "leak-${oc.env:OLMO_TEST_SECRET}", "type": "lm", "data": {"paths": ["x.npy"]}}
    ]
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    marker = json.loads((checkpoint / MARKER).read_text())  # a crafted checkpoint comes with a matching marker
    marker["files"]["config.yaml"] = (checkpoint / "config.yaml").stat().st_size
    (checkpoint / MARKER).write_text(json.dumps(marker))
    os.environ["OLMO_TEST_SECRET"] = "hunter2-do-not-print"
    try:
        result = run_script("eval.py", checkpoint, cwd=tmp_path)
    finally:
        del os.environ["OLMO_TEST_SECRET"]
    assert result.returncode != 0
    assert "hunter2" not in result.stdout + result.stderr
    assert "evaluators[0].label holds the interpolation" in result.stderr and "Traceback" not in result.stderr
    assert not list(checkpoint.glob("eval-*")) and not list(tmp_path.glob("eval-*"))
    # The same refusal guards every command that reads a checkpoint's config.
    with pytest.raises(OLMoConfigurationError, match=r"refused, not resolved"):
        run_main("convert_to_hf.py", checkpoint, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_outputs_never_land_inside_inputs(tmp_path, run):
    before = _digest(run / "step2")
    with pytest.raises(OLMoCheckpointError, match=r"inside .*step2', which this command reads"):
        run_main("unshard.py", run / "step2", run / "step2" / "train" / "unsharded")
    with pytest.raises(OLMoCheckpointError, match=r"inside .*step2-unsharded', which this command reads"):
        run_main("convert_to_hf.py", run / "step2-unsharded", run / "step2-unsharded" / "hf")
    assert _digest(run / "step2") == before
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OLMoCheckpointError, match=r"OUTPUT_DIR .*dangling' is a symlink"):
        run_main("convert_to_hf.py", run / "step2-unsharded", tmp_path / "dangling")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("--run_name=../../escaped", r"run_name='\.\./\.\./escaped' is not a name"),
        ("--run_name=" + "é" * 100, r"run_name is 200 bytes long"),
        (
            "--remote_save_folder=s3:/bucket/prefix",
            r"remote_save_folder='s3:/bucket/prefix' is a s3:// URL with a slash",
        ),
        ("--data.paths=[https:/olmo-data.org/a.npy]", r"data\.paths\[0\]=.*https:// URL with a slash missing"),
        ("--max_duration=1e300T", r"max_duration='1e300T' is [0-9.e+]+ steps .* more than 1e\+12"),
        ("--model.n_layers=100000000", r"model\.n_layers=100,000,000 is more than 4,096"),
        ("--model.d_model=100000000", r"makes about [0-9.]+e\+17 parameters, more than 1e\+13"),
        ("--optimizer.learning_rate=nan", r"optimizer\.learning_rate=nan must be a positive, finite number"),
        ("--optimizer.weight_decay=inf", r"optimizer\.weight_decay=inf must be a finite number"),
        ("--console_log_interval=0", r"console_log_interval=0 must be a positive number of steps"),
        ("--save_num_checkpoints_to_keep=-5", r"save_num_checkpoints_to_keep=-5 must be -1 \(keep all\)"),
        ("--run_name=null", r"save_folder='runs/None' names a folder 'None'.*--run_name=NAME"),
    ],
)
def test_names_and_urls_are_checked_before_anything_is_written(tmp_path, corpus, override, pattern):
    config = tiny_config_dict("runs/${run_name}", corpus, max_duration=1)
    path = write_config(tmp_path / "c.yaml", config)
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(OLMoConfigurationError, match=pattern):
            run_train(path, override)
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]
    assert not (tmp_path.parent / "escaped").exists()


def test_every_config_problem_is_reported_at_once(tmp_path):
    """Bad keys and values in the file and in the overrides come in one report, each naming its key and source."""
    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs/tiny/OLMo-tiny.yaml").read_text())
    config["seed"] = "x"
    config["optimizer"]["lr"] = 3
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    result = run_script(
        "train.py", tmp_path / "bad.yaml", "--model.n_layer=2", "--optimizer.learning_rate=abc", "--dry_run"
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    err = result.stderr
    assert "has 4 problems" in err or "have 4 problems" in err, err
    assert "Invalid value for config key 'seed' (in " in err and "Invalid config key 'optimizer.lr' (in " in err
    assert "'model.n_layer' (from the command-line override '--model.n_layer=2')" in err
    assert "'optimizer.learning_rate' (from the command-line override '--optimizer.learning_rate=abc')" in err
    assert "Did you mean: 'n_layers'? Remove" in err  # no "?." before the advice


def test_errors_point_at_what_the_user_gave(tmp_path, run, corpus):
    # eval.py on a checkpoint that is not there lists the ones beside it, and no train.py flag.
    with pytest.raises(
        OLMoCheckpointError, match=r"Checkpoints beside it: .*step2-unsharded.*point CHECKPOINT_DIR"
    ) as e:
        run_main("eval.py", run / "step9-unsharded")
    assert "--try_load_latest_save" not in str(e.value)
    # An evaluator's files are named as the evaluator's, not as data.paths.
    for paths in (["/nonexistent/val.npy"], [str(tmp_path / "empty.npy")]):
        (tmp_path / "empty.npy").write_bytes(b"")
        evaluators = [{"label": "val", "type": "lm", "data": {"paths": paths}}]
        config = write_config(
            tmp_path / "c.yaml", tiny_config_dict(tmp_path / "new", corpus, max_duration=1, evaluators=evaluators)
        )
        with pytest.raises(Exception, match=r"evaluators\[0\]\.data\.paths") as e:
            run_train(config)
        assert "an entry of data.paths" not in str(e.value) and "Remove it from data.paths" not in str(e.value)
