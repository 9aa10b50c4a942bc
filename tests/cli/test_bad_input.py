"""Every kind of bad input stops the launch with an OLMo*Error that names the key/file and the fix,
before training starts, and leaves data and checkpoints untouched."""

import hashlib
from pathlib import Path

import numpy as np
import pytest

from olmo.checkpoint import list_checkpoints
from olmo.exceptions import OLMoCheckpointError, OLMoCliError, OLMoConfigurationError, OLMoDataError
from olmo.testing import run_main, run_train, tiny_config_dict, write_byte_memmap, write_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_byte_memmap(root / "a.npy", 10_000)
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("ckpt")
    path = write_config(
        root / "c.yaml",
        tiny_config_dict(root / "run", [str(corpus / "a.npy")], max_duration=2, save_interval_unsharded=2),
    )
    assert run_train(path) == 0
    return root / "run" / "step2-unsharded"


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def _launch(tmp_path, data_paths, *args, **overrides):
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", data_paths, **overrides))
    try:
        return run_train(config, *args)
    finally:
        assert not (tmp_path / "run").exists(), "a failed launch must not create its save folder"


def _write(path, array):
    array.tofile(path)
    return str(path)


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (["--model.d_modle=64"], OLMoConfigurationError, r"model\.d_modle.*Did you mean.*d_model"),
        (["--model.n_layers=two"], OLMoConfigurationError, r"model\.n_layers"),
        (
            ["--global_train_batch_size=6"],
            OLMoConfigurationError,
            r"global_train_batch_size=6.*--global_train_batch_size=4",
        ),
        (
            ["--data.paths=${path.glob:/nonexistent/*.npy}"],
            OLMoDataError,
            r"'/nonexistent/\*\.npy' matches no file",
        ),
    ],
)
def test_config_errors(tmp_path, corpus, args, error, pattern):
    with pytest.raises(error, match=pattern):
        _launch(tmp_path, [str(corpus / "a.npy")], *args)


def test_missing_data_file(tmp_path):
    with pytest.raises(OLMoDataError, match=r"missing\.npy"):
        _launch(tmp_path, [str(tmp_path / "missing.npy")])


def test_token_file_of_the_wrong_size_for_its_dtype(tmp_path):
    path = tmp_path / "odd.npy"
    path.write_bytes(b"\x01" * 1001)  # not a whole number of uint16 tokens
    with pytest.raises(OLMoDataError, match=r"odd\.npy.*memmap_dtype"):
        _launch(tmp_path, [str(path)])


def test_empty_token_file(tmp_path, corpus):
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(OLMoDataError, match=r"empty\.npy"):
        _launch(tmp_path, [str(corpus / "a.npy"), str(tmp_path / "empty.npy")])


def test_token_id_beyond_the_vocabulary(tmp_path):
    ids = np.full(2048, 7, dtype=np.uint16)
    ids[1500] = 300  # vocab_size is 257
    path = _write(tmp_path / "ids.npy", ids)
    with pytest.raises(OLMoDataError, match=r"ids\.npy.*300"):
        _launch(tmp_path, [path])


def test_uint32_data_read_as_uint16_is_caught(tmp_path):
    path = _write(tmp_path / "ids32.npy", np.arange(1025, dtype=np.uint32) % 200 + 60_000)
    with pytest.raises(OLMoDataError, match=r"ids32\.npy"):
        _launch(tmp_path, [path])


def test_label_mask_of_another_length(tmp_path, corpus):
    mask = _write(tmp_path / "mask.npy", np.ones(999, dtype=bool))
    with pytest.raises(OLMoDataError, match=r"mask\.npy"):
        _launch(tmp_path, [str(corpus / "a.npy")], **{"data.label_mask_paths": [mask]})


def test_load_path_that_does_not_exist(tmp_path, corpus):
    with pytest.raises(OLMoCheckpointError, match=r"does not exist.*--load_path"):
        _launch(tmp_path, [str(corpus / "a.npy")], f"--load_path={tmp_path}/step9-unsharded")


def test_uncommitted_checkpoints_are_refused(tmp_path, corpus, checkpoint):
    partial = tmp_path / "step7-unsharded"
    partial.mkdir()
    (partial / "model.pt").write_bytes((checkpoint / "model.pt").read_bytes())  # no config.yaml, no marker
    with pytest.raises(OLMoCheckpointError, match="not a committed checkpoint"):
        _launch(tmp_path, [str(corpus / "a.npy")], f"--load_path={partial}")
    tmp_dir = tmp_path / ".step8-unsharded.tmp-1234"
    tmp_dir.mkdir()
    with pytest.raises(OLMoCheckpointError, match="temporary directory"):
        _launch(tmp_path, [str(corpus / "a.npy")], f"--load_path={tmp_dir}")


def test_truncated_checkpoint_copy_is_refused(tmp_path, corpus, checkpoint):
    import shutil

    copy = tmp_path / "copy" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    with open(copy / "optim.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(OLMoCheckpointError, match=r"damaged.*optim\.pt"):
        _launch(tmp_path, [str(corpus / "a.npy")], f"--load_path={copy}")


def test_checkpoint_from_a_different_model_shape(tmp_path, corpus, checkpoint):
    before = _digest(checkpoint)
    with pytest.raises(OLMoCheckpointError, match=r"different model shape.*att_proj"):
        _launch(tmp_path, [str(corpus / "a.npy")], f"--load_path={checkpoint}", "--model.d_model=64")
    assert _digest(checkpoint) == before


def test_a_new_run_does_not_overwrite_another_run(tmp_path, corpus, checkpoint):
    run = checkpoint.parent
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(run, [str(corpus / "a.npy")]))
    before = _digest(run)
    with pytest.raises(OLMoCheckpointError, match=r"already holds a run.*--try_load_latest_save"):
        run_train(config)
    assert _digest(run) == before


# --- Issue 16: everyday mistakes get one paragraph, checked before anything is written ---------------------


def _write_text(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("model:\n  d_model: 32\n   n_heads: 2\n", r"not valid YAML.*line 3"),
        ("model:\n\td_model: 32\n", r"not valid YAML.*line 2.*tabs for indentation"),
        ("data:\n  paths: [a.npy, b.npy\n", r"not valid YAML.*expected ',' or ']'"),
        ("- model\n- data\n", r"holds a YAML list, not a mapping"),
        ("run_name: !!python/object/apply:os.system ['true']\n", r"not valid YAML.*safe YAML loader"),
    ],
)
def test_malformed_config_files(tmp_path, text, pattern):
    with pytest.raises(OLMoConfigurationError, match=pattern):
        run_train(_write_text(tmp_path / "bad.yaml", text))


def test_unreadable_config_files(tmp_path):
    with pytest.raises(OLMoConfigurationError, match=r"is not a file"):
        run_train(tmp_path)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(OLMoConfigurationError, match=r"cannot be read.*UTF-8"):
        run_train(tmp_path / "binary.yaml")


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (["--data.paths=[a.npy"], OLMoCliError, r"--data\.paths=\[a\.npy.*Close every bracket"),
        (["--save_folder"], OLMoCliError, r"--save_folder needs a value"),
        (["--save_overwrite", "--run_name"], OLMoCliError, r"--run_name needs a value"),
        (["stray.yaml"], OLMoCliError, r"Unexpected argument 'stray\.yaml'"),
        (["--max_duration=0"], OLMoConfigurationError, r"max_duration=0 must be a positive"),
        (["--max_duration=-5"], OLMoConfigurationError, r"max_duration=-5 must be a positive"),
        (["--max_duration=0T"], OLMoConfigurationError, r"must be a positive"),
        (["--model.n_layers=x"], OLMoConfigurationError, r"^(?!.*the command line or the command line)"),
    ],
)
def test_command_line_mistakes(tmp_path, corpus, args, error, pattern):
    with pytest.raises(error, match=pattern):
        _launch(tmp_path, [str(corpus / "a.npy")], *args)
    assert not (tmp_path / "True").exists()


def test_help_exits_zero_wherever_it_stands(capsys):
    with_config = ["configs/tiny/OLMo-tiny.yaml", "--model.n_layers=2", "--data.paths=[a.npy]", "--evaluators=[]"]
    for args in (["--help"], [*with_config, "--help"]):
        assert run_main("train.py", *args) == 0
        assert "--try_load_latest_save" in capsys.readouterr().out
    assert run_main("eval.py", "-h") == 0
    assert "CHECKPOINT_DIR" in capsys.readouterr().out


def test_evaluator_data_and_tokenizer_are_checked_before_training(tmp_path, corpus):
    missing = [{"label": "held", "type": "lm", "data": {"paths": [str(tmp_path / "nope.npy")]}}]
    with pytest.raises(OLMoDataError, match=r"nope\.npy"):
        _launch(tmp_path, [str(corpus / "a.npy")], evaluators=missing)
    not_a_tokenizer = _write_text(tmp_path / "tok.json", '{"this is": "no tokenizer"}')
    with pytest.raises(OLMoConfigurationError, match=r"tok\.json' is not a tokenizer file"):
        _launch(
            tmp_path,
            [str(corpus / "a.npy")],
            evaluators=[{"label": "piqa", "type": "downstream"}],
            **{"tokenizer.identifier": str(not_a_tokenizer)},
        )


def test_save_folder_that_is_a_file(tmp_path, corpus):
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "c.yaml", [str(corpus / "a.npy")]))
    with pytest.raises(OLMoCheckpointError, match=r"save_folder .* is a file"):
        run_train(config)
    config = write_config(
        tmp_path / "d.yaml", tiny_config_dict(tmp_path / "c.yaml" / "run", [str(corpus / "a.npy")])
    )
    with pytest.raises(OLMoCheckpointError, match=r"c\.yaml' is a file"):
        run_train(config)


def test_save_overwrite_makes_the_folder_the_new_runs(tmp_path, corpus):
    folder = tmp_path / "run"
    old = tiny_config_dict(
        folder, [str(corpus / "a.npy")], max_duration=4, save_interval=2, save_interval_unsharded=2
    )
    assert run_train(write_config(tmp_path / "old.yaml", old)) == 0
    (folder / "notes.txt").write_text("mine")
    new = tiny_config_dict(
        folder, [str(corpus / "a.npy")], max_duration=2, save_interval=2, save_interval_unsharded=None, seed=99
    )
    new_config = write_config(tmp_path / "new.yaml", new)
    assert run_train(new_config, "--save_overwrite") == 0
    assert [(c.step, c.sharded) for c in list_checkpoints(folder)] == [(2, True)], "the old run's steps are gone"
    assert (folder / "notes.txt").read_text() == "mine", "files the trainer did not write are kept"
    assert "seed: 99" in (folder / "config.yaml").read_text()
    # A restart resumes the new run (finished at step 2), not the old run's step 4.
    record: list = []
    assert run_train(new_config, "--try_load_latest_save", record=record) == 0
    assert record == []


def _mount(kind: str, target: Path, options: str) -> bool:
    import subprocess

    target.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)] if kind == "tmpfs" else kind.split()
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _umount(target: Path) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(target)], capture_output=True)  # -l: memmaps may still be open


def test_read_only_save_folder(tmp_path, corpus):
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _mount(f"mount --bind -o ro {ro} {ro}", ro, ""):
        pytest.skip("cannot make a read-only bind mount here (needs root / CAP_SYS_ADMIN)")
    try:
        config = write_config(tmp_path / "c.yaml", tiny_config_dict(ro / "run", [str(corpus / "a.npy")]))
        with pytest.raises(OLMoCheckpointError, match=r"cannot be written.*read-only"):
            run_train(config)
    finally:
        _umount(ro)


def test_full_disk_keeps_committed_checkpoints_and_leaves_no_temporary_folder(tmp_path, corpus):
    disk = tmp_path / "disk"
    if not _mount("tmpfs", disk, "size=1m"):
        pytest.skip("cannot mount a small tmpfs here (needs root / CAP_SYS_ADMIN)")
    try:
        folder = disk / "run"
        cfg = tiny_config_dict(folder, [str(corpus / "a.npy")], max_duration=6, save_interval_unsharded=2)
        config = write_config(tmp_path / "c.yaml", cfg)
        with pytest.raises(OLMoCheckpointError, match=r"no space left on the device.*--try_load_latest_save"):
            run_train(config)
        committed = list_checkpoints(folder)
        assert committed and not [p for p in folder.iterdir() if ".tmp-" in p.name]
        _mount(f"mount -o remount,size=8m {disk}", disk, "")
        record: list = []
        assert run_train(config, "--try_load_latest_save", record=record) == 0
        assert min(r["step"] for r in record) == committed[-1].step + 1
    finally:
        _umount(disk)
