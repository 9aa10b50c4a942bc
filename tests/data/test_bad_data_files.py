"""Data files that used to train on garbage or end in a traceback (issue 16): token files and label masks
written by ``np.save``, label masks without a True, and directories or unreadable files listed as data."""

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from olmo.data import MemMapDataset
from olmo.exceptions import OLMoDataError
from olmo.testing import BYTE_EOS, run_script, run_train, tiny_config_dict, write_byte_memmap, write_config

N_TOKENS = 3_000
SEQ_LEN = 32  # model.max_sequence_length of tiny_config_dict
VALIDATE_ARGS = ("--vocab-size", "257", "--eos", str(BYTE_EOS), "--seq-len", str(SEQ_LEN))
NOBODY = 65534


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same tokens and label mask, headerless and written by np.save, plus an all-False mask."""
    root = tmp_path_factory.mktemp("corpus")
    tokens = write_byte_memmap(root / "raw.npy", N_TOKENS)
    np.save(root / "saved.npy", tokens)
    mask = np.random.default_rng(0).random(N_TOKENS) < 0.3
    mask.tofile(root / "raw_mask.npy")
    np.save(root / "saved_mask.npy", mask)
    np.zeros(N_TOKENS, dtype=bool).tofile(root / "false_mask.npy")
    return root


def _config(tmp_path, paths, masks=None, **overrides):
    if masks is not None:
        overrides["data.label_mask_paths"] = [str(m) for m in masks]
    cfg = tiny_config_dict(tmp_path / "run", [str(p) for p in paths], max_duration=2, **overrides)
    return write_config(tmp_path / "config.yaml", cfg)


def _refused(result, *names):
    """validate_data.py or train.py stopped with our error naming ``names``, and no traceback."""
    assert result.returncode != 0
    assert "OLMoDataError" in result.stderr and "Traceback" not in result.stderr
    for name in names:
        assert str(name) in result.stderr


def test_np_save_files_give_the_same_instances_as_headerless_ones(tmp_path, corpus, caplog):
    rows_2d = np.fromfile(corpus / "raw.npy", np.uint16).reshape(-1, 10)
    np.save(tmp_path / "rows.npy", rows_2d)  # a C-ordered 2-D array is read flat
    raw = MemMapDataset(corpus / "raw.npy", chunk_size=SEQ_LEN, label_mask_paths=[corpus / "raw_mask.npy"])
    with caplog.at_level(logging.INFO):
        saved = MemMapDataset(
            corpus / "saved.npy", chunk_size=SEQ_LEN, label_mask_paths=[corpus / "saved_mask.npy"]
        )
        saved.validate(vocab_size=257)
        rows = MemMapDataset(tmp_path / "rows.npy", chunk_size=SEQ_LEN)
        rows.validate(vocab_size=257)
        MemMapDataset(tmp_path / "rows.npy", chunk_size=SEQ_LEN).validate(vocab_size=257)
    assert len(raw) == len(saved) == len(rows) == N_TOKENS // SEQ_LEN
    for i in range(len(raw)):
        assert raw[i]["input_ids"].tolist() == saved[i]["input_ids"].tolist() == rows[i]["input_ids"].tolist()
        assert raw[i]["label_mask"].tolist() == saved[i]["label_mask"].tolist()
        assert raw.instance_location(i)[1] == saved.instance_location(i)[1]
    header_found = "rows.npy' (an entry of data.paths (or data.datasets)) starts with a 128-byte npy header"
    assert caplog.text.count(header_found) == 1  # once per file, however many datasets read it


@pytest.mark.parametrize(
    "array, as_mask, pattern",
    [
        (np.arange(64, dtype=np.uint32), False, r"bad\.npy.*has dtype uint32.*--data\.memmap_dtype=uint32"),
        (np.arange(64), False, r"bad\.npy.*has dtype int64, but --data\.memmap_dtype is uint16"),
        (np.array([1, "two"], dtype=object), False, r"bad\.npy.*dtype object.*never loaded"),
        (np.asfortranarray(np.ones((8, 8), np.uint16)), False, r"bad\.npy.*Fortran-ordered"),
        (np.ones(64, np.uint8), True, r"bad\.npy.*data\.label_mask_paths.*must be bool"),
    ],
)
def test_np_save_header_that_does_not_fit_is_refused(tmp_path, array, as_mask, pattern):
    np.save(tmp_path / "bad.npy", array)
    np.ones(64, np.uint16).tofile(tmp_path / "tokens.npy")
    if as_mask:
        dataset = MemMapDataset(tmp_path / "tokens.npy", chunk_size=8, label_mask_paths=[tmp_path / "bad.npy"])
    else:
        dataset = MemMapDataset(tmp_path / "bad.npy", chunk_size=8)
    with pytest.raises(OLMoDataError, match=pattern):
        dataset.validate(vocab_size=257)


def test_truncated_np_save_file_is_refused(tmp_path):
    np.save(tmp_path / "cut.npy", np.arange(64, dtype=np.uint16))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:-10])
    with pytest.raises(OLMoDataError, match=r"cut\.npy.*64 items of 2 bytes, but 118 bytes.*truncated"):
        len(MemMapDataset(tmp_path / "cut.npy", chunk_size=8))


def test_training_on_an_np_save_file_matches_the_headerless_file(tmp_path, corpus):
    losses = []
    for name in ("raw", "saved"):
        record: list[dict] = []
        config = _config(tmp_path / name, [corpus / f"{name}.npy"], [corpus / f"{name}_mask.npy"])
        assert run_train(config, record=record) == 0
        losses.append([r["train/CrossEntropyLoss"] for r in record if "train/CrossEntropyLoss" in r])
    assert len(losses[0]) == 2 and losses[0] == losses[1]


def test_label_masks_without_a_true_stop_the_launch(tmp_path, corpus):
    config = _config(tmp_path, [corpus / "raw.npy"], [corpus / "false_mask.npy"])
    with pytest.raises(
        OLMoDataError, match=r"No label mask in data\.label_mask_paths holds a True.*loss would be 0"
    ):
        run_train(config)
    assert not (tmp_path / "run").exists()
    _refused(run_script("validate_data.py", config), "data.label_mask_paths")


def test_one_unlabeled_file_of_two_warns_and_trains(tmp_path, corpus, caplog):
    paths = [corpus / "raw.npy", corpus / "saved.npy"]
    masks = [corpus / "false_mask.npy", corpus / "saved_mask.npy"]
    with caplog.at_level(logging.WARNING):
        assert run_train(_config(tmp_path, paths, masks)) == 0
    assert f"Label mask '{masks[0]}' holds no True" in caplog.text and "contributes no labels" in caplog.text

    args = [*map(str, paths), "--label-masks", *map(str, masks), *VALIDATE_ARGS]
    result = run_script("validate_data.py", *args)
    assert result.returncode == 0, result.stderr
    assert "false_mask.npy' holds no True" in result.stderr
    assert "saved.npy' (an entry of data.paths (or data.datasets)) starts with a 128-byte npy" in result.stderr
    # Both files hold N_TOKENS tokens: the header's 64 uint16 slots are not counted as tokens.
    assert result.stdout.count(f"{N_TOKENS:,}") >= 2 and f"{N_TOKENS + 64:,}" not in result.stdout


def test_a_directory_listed_as_data_is_a_data_error(tmp_path, corpus):
    (tmp_path / "tokens_dir").mkdir()
    (tmp_path / "masks_dir").mkdir()
    paths = [corpus / "raw.npy", tmp_path / "tokens_dir"]
    masks = [tmp_path / "masks_dir", corpus / "raw_mask.npy"]
    config = _config(tmp_path, paths, masks)
    with pytest.raises(OLMoDataError, match="2 problems") as error:
        run_train(config)
    for expected in (
        "masks_dir' (an entry of data.label_mask_paths) is a directory",
        "tokens_dir' (an entry of data.paths",
    ):
        assert expected in str(error.value)
    assert not (tmp_path / "run").exists()
    _refused(run_script("validate_data.py", config), "masks_dir", "tokens_dir", "is a directory")


def _run_unprivileged(script: str, *args) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/SCRIPT`` as a user that file permissions apply to (root reads every file)."""
    if os.geteuid() != 0:
        return run_script(script, *args)
    # The script's imports run before privileges are dropped: the interpreter may live where nobody reads.
    child = (
        "import os, runpy, sys\n"
        "runpy.run_path(sys.argv[1], run_name='preload')\n"
        "import olmo.cli.train_launch\n"  # train.py imports the launch (and torch) only once the config is valid
        "import torch._dynamo\n"  # torch loads its compiler on first use (the launch's meta model), not at import
        "try:\n"
        f"    os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "except OSError as e:\n"
        "    sys.exit(f'SKIP cannot drop privileges: {e}')\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    script_path = Path(__file__).resolve().parents[2] / "scripts" / script
    env = {**os.environ, "WANDB_MODE": "disabled", "HOME": tempfile.gettempdir()}
    cmd = [sys.executable, "-c", child, str(script_path), *map(str, args)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "SKIP cannot drop privileges" in result.stderr:
        pytest.skip(result.stderr.strip())
    return result


def test_an_unreadable_file_listed_as_data_is_a_data_error(corpus):
    # Not tmp_path: pytest's temporary folders are private to root, and the files must be reachable by
    # the unprivileged user for the permission denial to be about the file itself.
    root = Path(tempfile.mkdtemp(prefix="olmo-unreadable-"))
    try:
        root.chmod(0o777)  # the unprivileged user may write the save folder there: only the data is at fault
        for name in ("raw.npy", "raw_mask.npy"):
            shutil.copy(corpus / name, root / f"open_{name}")
            shutil.copy(corpus / name, root / f"locked_{name}")
        config = _config(
            root,
            [root / "open_raw.npy", root / "locked_raw.npy"],
            [root / "locked_raw_mask.npy", root / "open_raw_mask.npy"],
        )
        for path in root.iterdir():
            path.chmod(0 if path.name.startswith("locked_") else 0o644)
        for script in ("train.py", "validate_data.py"):
            result = _run_unprivileged(script, config)
            _refused(result, "locked_raw.npy", "locked_raw_mask.npy", "permission denied")
            assert "data.label_mask_paths" in result.stderr and "data.paths" in result.stderr
        assert not (root / "run").exists()
    finally:
        shutil.rmtree(root)
