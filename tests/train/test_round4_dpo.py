"""DPO under mistaken input (issue 50): no run without label masks, no absurd beta or label smoothing, precomputed
reference log-probabilities recomputed when the data's content changed (even with as many instances), and pairs
whose two sides are the same tokens, from a preparation older than its check, refused by training and evaluation."""

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.cli.eval_preferences import parse_args
from olmo.cli.eval_preferences import read_pairs as read_eval_pairs
from olmo.config import TrainConfig
from olmo.config.validation import config_problems
from olmo.data import DataContext, build_dataset
from olmo.distributed.collectives import DistEnv
from olmo.distributed.layout import ParallelLayout
from olmo.exceptions import OLMoCliError, OLMoConfigurationError, OLMoDataError
from olmo.testing import run_train, tiny_config_dict, write_config
from olmo.train.dpo import check_pairs_differ
from olmo.train.dpo_reference import REFERENCE_FILE, ReferenceInputs, precomputed_reference

TRL_FIXTURE = Path(__file__).parent.parent / "fixtures" / "trl_dpo"
SEQ = 48  # the fixture's sequence length


def _data(folder: Path, swap_pair: int | None = None, same_pair: int | None = None) -> Path:
    """A copy of the fixture's 4 prepared pairs in ``folder``; ``swap_pair``: that pair's sides swapped (the same count
    and size, another content); ``same_pair``: its rejected side made a copy of its chosen one."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.fromfile(TRL_FIXTURE / "pref/input_ids.npy", dtype=np.uint16).reshape(-1, SEQ)
    mask = np.fromfile(TRL_FIXTURE / "pref/label_mask.npy", dtype=np.bool_).reshape(-1, SEQ)
    for array in (ids, mask):
        if swap_pair is not None:
            array[[2 * swap_pair, 2 * swap_pair + 1]] = array[[2 * swap_pair + 1, 2 * swap_pair]]
        if same_pair is not None:
            array[2 * same_pair + 1] = array[2 * same_pair]
    ids.tofile(folder / "input_ids.npy")
    mask.tofile(folder / "label_mask.npy")
    return folder


def _reference_inputs(cfg: TrainConfig) -> ReferenceInputs:
    """What DPOTrainModule hands the precomputation (from its StepSettings) for a run of ``cfg``."""
    return ReferenceInputs(
        cfg.data,
        cfg.model,
        DataContext.from_train_config(cfg),
        cfg.dpo.reference_path,
        cfg.save_folder,
        cfg.device_train_microbatch_size,
    )


def _config(tmp_path: Path, data: Path, **overrides) -> TrainConfig:
    cfg = tiny_config_dict(
        tmp_path / "run",
        [str(data / "input_ids.npy")],
        **{
            "model.layer_norm_with_affine": False,
            "model.max_sequence_length": SEQ,
            "data.label_mask_paths": [str(data / "label_mask.npy")],
            "dpo.enabled": True,
            "dpo.reference_path": str(tmp_path / "reference"),
            "load_path": str(tmp_path / "policy"),
            "reset_trainer_state": True,
            "max_duration": 1,
            "global_train_batch_size": 8,
            "device_train_microbatch_size": 4,
            "save_interval_unsharded": None,
            **overrides,
        },
    )
    return TrainConfig.load(write_config(tmp_path / "dpo.yaml", cfg))


def _dpo_problems(cfg: TrainConfig) -> list[str]:
    return [p for p in config_problems(cfg, 1) if "dpo" in p or "label_mask" in p]


# --- Silent wrong results: configs that train the wrong objective ----------------------------------------------------


def test_dpo_without_label_masks_is_refused_before_anything_is_written(tmp_path):
    """Without masks every prompt, header and padding token would count in each answer's log-probability."""
    cfg = _config(tmp_path, _data(tmp_path / "data"), **{"data.label_mask_paths": None})
    (problem,) = _dpo_problems(cfg)
    assert "dpo.enabled=true needs data.label_mask_paths" in problem
    assert "prepare_preference_data.py writes the mask" in problem
    with pytest.raises(OLMoConfigurationError, match="needs data.label_mask_paths"):
        run_train(tmp_path / "dpo.yaml")
    assert not (tmp_path / "run").exists()
    assert _dpo_problems(_config(tmp_path, _data(tmp_path / "data"))) == []  # with the masks: no problem


@pytest.mark.parametrize("beta", [1e300, 1e-300, 1000.0, 0.0, -0.1, math.inf, math.nan])
def test_absurd_betas_are_refused_with_their_range(tmp_path, beta):
    """The issue's 1e300 passed validation and failed at step 1 advising a lower learning rate."""
    (problem,) = _dpo_problems(_config(tmp_path, _data(tmp_path / "data"), **{"dpo.beta": beta}))
    assert problem.startswith(f"dpo.beta={beta} must be a number in [0.0001, 100]")


@pytest.mark.parametrize("beta", [1e-4, 0.01, 0.1, 5.0, 100.0])
def test_published_betas_pass(tmp_path, beta):
    assert _dpo_problems(_config(tmp_path, _data(tmp_path / "data"), **{"dpo.beta": beta})) == []


@pytest.mark.parametrize("smoothing", [0.5, 1.0, -0.01, 1e300, math.nan, -math.inf])
def test_label_smoothing_outside_its_range_is_refused(tmp_path, smoothing):
    (problem,) = _dpo_problems(_config(tmp_path, _data(tmp_path / "data"), **{"dpo.label_smoothing": smoothing}))
    assert problem.startswith(f"dpo.label_smoothing={smoothing} must be in [0, 0.5)")


@pytest.mark.parametrize("beta", ["1e300", "inf", "nan", "0", "-1", "1e-9"])
def test_eval_preferences_bounds_beta_as_training_does(beta, capsys):
    with pytest.raises(SystemExit):
        parse_args(["policy", "reference", "data", "--beta", beta])
    err = capsys.readouterr().err
    assert f"--beta={float(beta)} must be a number in [0.0001, 100]" in err


# --- Silent wrong results: stale reference log-probabilities ------------------------------------------------------


def test_precomputed_reference_follows_the_data_content_not_its_count(tmp_path):
    """Files prepared again with as many pairs (the same size, another content) are scored anew; unchanged files
    are reused. The reference here scores a row by its token ids, so that the values show which data they came from."""
    data = _data(tmp_path / "data")
    cfg = _config(tmp_path, data, **{"dpo.precompute_reference": True})
    layout = ParallelLayout.single(DistEnv(torch.device("cpu"), 0, 0, 1))
    forwards: list[int] = []

    def forward(_: torch.nn.Module, batch: dict) -> torch.Tensor:
        forwards.append(len(batch["input_ids"]))
        return (batch["input_ids"] * batch["label_mask"]).float().sum(1)

    def scores() -> np.ndarray:
        return precomputed_reference(_reference_inputs(cfg), layout, torch.nn.Identity, forward)

    first = scores()
    assert len(forwards) == 2 and first.shape == (8,)  # 8 instances in micro-batches of 4
    assert np.array_equal(scores(), first) and len(forwards) == 2  # unchanged files: reused
    _data(tmp_path / "data", swap_pair=0)  # prepared again: pair 0's sides swapped, same size
    second = scores()
    assert len(forwards) == 4 and np.array_equal(second, first[[1, 0, 2, 3, 4, 5, 6, 7]])
    mask = np.fromfile(data / "label_mask.npy", dtype=np.bool_)
    mask[5] = not mask[5]  # the masks alone changed
    mask.tofile(data / "label_mask.npy")
    scores()
    assert len(forwards) == 6
    record = json.loads((tmp_path / "run/train_data" / (REFERENCE_FILE + ".json")).read_text())
    assert set(record["files"]) == {str(data / "input_ids.npy"), str(data / "label_mask.npy")}
    assert all(len(entry["sha256"]) == 64 for entry in record["files"].values())


def test_a_record_replaced_by_a_fifo_is_recomputed_not_waited_on(tmp_path):
    """A record replaced by a FIFO is not waited on: the values are computed anew and the record written again."""
    cfg = _config(tmp_path, _data(tmp_path / "data"), **{"dpo.precompute_reference": True})
    layout = ParallelLayout.single(DistEnv(torch.device("cpu"), 0, 0, 1))
    forwards: list[int] = []

    def forward(_: torch.nn.Module, batch: dict) -> torch.Tensor:
        forwards.append(1)
        return batch["input_ids"].float().sum(1)

    first = precomputed_reference(_reference_inputs(cfg), layout, torch.nn.Identity, forward)
    record = tmp_path / "run/train_data" / (REFERENCE_FILE + ".json")
    record.unlink()
    os.mkfifo(record)
    assert np.array_equal(precomputed_reference(_reference_inputs(cfg), layout, torch.nn.Identity, forward), first)
    assert len(forwards) == 4 and record.is_file()


# --- Pairs that are no preference, from an older preparation ------------------------------------------------------


def test_identical_pairs_from_an_older_preparation_are_refused(tmp_path):
    """Data written before prepare_preference_data.py refused such pairs: training stops naming the instances and
    the fix before that pair's step trains; eval_preferences.py refuses the folder."""
    from olmo.cli.convert_from_hf import convert_from_hf

    data = _data(tmp_path / "data", same_pair=2)
    with pytest.raises(
        OLMoCliError, match=r"1 pair\(s\) whose two sides are the same tokens .* pair 2, instances 4"
    ):
        read_eval_pairs(data, SEQ, "uint16")
    read_eval_pairs(_data(tmp_path / "good"), SEQ, "uint16")  # the fixture's own pairs pass
    for name in ("policy", "reference"):
        convert_from_hf(str(TRL_FIXTURE / f"hf-{name}"), str(tmp_path / name))
    cfg = _config(tmp_path, data)
    with pytest.raises(
        OLMoDataError, match=r"Instances 4 and 5 of data.paths \(a pair, in '.*input_ids.npy'\) are the same"
    ):
        run_train(tmp_path / "dpo.yaml")
    assert not (tmp_path / "run").exists()  # refused at launch, before anything is written
    # The launch reads a bounded share of the data (the train step checks every batch past it): here pairs 0 and 1.
    dataset = build_dataset(cfg.data, cfg.model, DataContext.from_train_config(cfg))
    check_pairs_differ(dataset, max_tokens=4 * SEQ, rows_per_read=2)
    with pytest.raises(OLMoDataError, match="Instances 4 and 5"):
        check_pairs_differ(dataset, max_tokens=6 * SEQ, rows_per_read=2)


def test_a_launch_skips_hashing_data_files_unchanged_since_the_last(tmp_path):
    """The SHA-256 of each data file is remembered with its size, mtime and inode: a relaunch does not read unchanged
    files again. Shown by rewriting a file in place with the same size and putting its mtime back, which the
    remembered hash cannot see (as make and rsync cannot); a file written within the last 2 s is always read."""
    data = _data(tmp_path / "data")
    old = time.time_ns() - 10_000_000_000
    for f in data.iterdir():
        os.utime(f, ns=(old, old))
    cfg = _config(tmp_path, data, **{"dpo.precompute_reference": True})
    layout = ParallelLayout.single(DistEnv(torch.device("cpu"), 0, 0, 1))
    forwards: list[int] = []

    def forward(_: torch.nn.Module, batch: dict) -> torch.Tensor:
        forwards.append(1)
        return batch["input_ids"].float().sum(1)

    first = precomputed_reference(_reference_inputs(cfg), layout, torch.nn.Identity, forward)
    ids = data / "input_ids.npy"
    tokens = np.fromfile(ids, dtype=np.uint16)
    with open(ids, "r+b") as f:  # in place: same inode, same size
        f.write((tokens[::-1]).tobytes())
    os.utime(ids, ns=(old, old))
    assert np.array_equal(precomputed_reference(_reference_inputs(cfg), layout, torch.nn.Identity, forward), first)
    assert len(forwards) == 2  # not read again, so not scored again
    os.utime(ids)  # touched now: read, found changed, scored anew
    precomputed_reference(_reference_inputs(cfg), layout, torch.nn.Identity, forward)
    assert len(forwards) == 4
