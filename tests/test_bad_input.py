"""Every kind of bad input stops the launch with an OLMo*Error that names the key/file and the fix,
before training starts, and leaves data and checkpoints untouched."""

import hashlib
from pathlib import Path

import numpy as np
import pytest

from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError, OLMoDataError
from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config


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
        (["--data.paths=${path.glob:/nonexistent/*.npy}"], OLMoConfigurationError, r"matched no files"),
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
