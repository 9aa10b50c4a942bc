"""``data.instance_filter``: the same instances as the original OLMo are dropped, trained on with no loss,
counted, and listed in ``data-indices/filtered``."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.config import InstanceFilterConfig, TrainConfig
from olmo.data import DataCollator, DataIndexLog, MemMapDataset, is_repetitive, read_data_indices
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures/olmo_instance_filter/decisions.npz"
T = 32  # the tiny config's max_sequence_length


def _filter(min_period: int, max_period: int, max_count: int) -> InstanceFilterConfig:
    return InstanceFilterConfig(
        repetition_max_period=max_period, repetition_min_period=min_period, repetition_max_count=max_count
    )


def test_decisions_match_the_original_olmo():
    """OLMo's own decisions (ai2-olmo 0.6.0, recorded by make_fixture.py) on 210 instances x 9 settings."""
    with np.load(FIXTURE, allow_pickle=False) as f:
        tokens, offsets, settings, keep, max_times = (
            f[k] for k in ("tokens", "offsets", "settings", "keep", "max_times")
        )
    for j, (min_period, max_period, max_count) in enumerate(settings.tolist()):
        cfg = _filter(min_period, max_period, max_count)
        for dtype in (np.uint16, np.uint32, np.int64):  # the memmap dtypes, and OLMo's int64 input_ids
            ours = [not is_repetitive(tokens[a:b].astype(dtype), cfg) for a, b in zip(offsets[:-1], offsets[1:])]
            wrong = np.flatnonzero(np.array(ours) != keep[:, j])
            assert len(wrong) == 0, f"setting {settings[j]}, {dtype.__name__}: instances {wrong} differ from OLMo"
    # The fixture tests the thresholds: cases right below and at the count, kept and dropped, for OLMo's defaults.
    default = settings.tolist().index([1, 13, 32])
    assert {31, 32} <= set(max_times[:, default].tolist())
    assert 0 < keep.sum() < keep.size


def test_dataset_marks_repetitive_instances_and_the_collator_stacks_the_mask(tmp_path):
    rng = np.random.default_rng(0)
    instances = [rng.integers(0, 1000, T), np.resize([5, 6, 7], T), rng.integers(0, 1000, T)]
    instances[2][3:27] = np.resize([9, 8], 24)  # 12 repeats of a 2-token pattern, mid-instance
    path = tmp_path / "tokens.npy"
    np.concatenate(instances).astype(np.uint16).tofile(path)
    dataset = MemMapDataset(path, chunk_size=T, instance_filter_config=_filter(1, 4, 8))
    assert [dataset[i]["instance_mask"] for i in range(3)] == [True, False, False]
    batch = DataCollator()([{**dataset[i], "index": i} for i in range(3)])
    assert batch["instance_mask"].dtype == torch.bool and batch["instance_mask"].tolist() == [True, False, False]
    assert "instance_mask" not in MemMapDataset(path, chunk_size=T)[1]  # only with the filter configured


@pytest.mark.parametrize(
    "settings, pattern",
    [
        ({"repetition_min_period": 0}, r"data\.instance_filter\.repetition_min_period=0 must be a positive"),
        ({"repetition_max_count": -1}, r"repetition_max_count=-1 must be a positive number of repeats"),
        ({"repetition_min_period": 5, "repetition_max_period": 3}, r"repetition_min_period=5 is above .*Swap"),
    ],
)
def test_bad_filter_settings_fail_validation(tmp_path, settings, pattern):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"], **{"data.instance_filter": settings}))
    with pytest.raises(OLMoConfigurationError, match=pattern):
        cfg.validate()


def test_a_count_below_three_warns_that_it_acts_as_three(tmp_path, caplog):
    cfg = TrainConfig.from_dict(
        tiny_config_dict(tmp_path, ["x.npy"], **{"data.instance_filter": {"repetition_max_count": 2}})
    )
    with caplog.at_level(logging.WARNING):
        cfg.validate()
    assert "repetition_max_count=2 acts as 3" in caplog.text
    assert "not implemented" not in caplog.text


def test_filtered_indices_of_a_crashed_launch_are_dropped_like_its_steps(tmp_path):
    def launch(start, steps):
        log = DataIndexLog(str(tmp_path), rank=0, start_step=start)
        for step, mask in steps:
            log.write(step, torch.tensor([10 * step, 10 * step + 1]), torch.tensor(mask))
        log.close()

    launch(0, [(1, [True, False]), (2, [True, True]), (3, [False, False])])  # crashed after step 3 ...
    launch(2, [(3, [True, True]), (4, [False, True])])  # ... resumed from the checkpoint of step 2
    assert read_data_indices(tmp_path, filtered=True) == {1: {0: [11]}, 4: {0: [40]}}
    assert read_data_indices(tmp_path) == {s: {0: [10 * s, 10 * s + 1]} for s in (1, 2, 3, 4)}


def _corpus(path: Path, pattern: list[int]) -> list[int]:
    """48 instances of real text (one epoch of 6 steps of 8); the returned ones repeat ``pattern``."""
    tokens = write_byte_memmap(path, 48 * T).copy()
    repetitive = [2, 9, 20, 33, 41]
    for i in repetitive:
        tokens[i * T : (i + 1) * T] = np.resize(pattern, T)
    tokens.tofile(path)
    return repetitive


def _train(tmp_path: Path, data: Path, record: list, caplog) -> Path:
    overrides = {"data.instance_filter": {"repetition_max_count": 6}, "max_duration": 6, "data.seed": 5}
    cfg = tiny_config_dict(tmp_path / "run", [str(data)], **overrides)
    with caplog.at_level(logging.INFO):
        assert run_train(write_config(tmp_path / "config.yaml", cfg), record=record) == 0
    return tmp_path / "run"


def test_training_drops_counts_and_lists_the_repetitive_instances(tmp_path, caplog):
    injected = _corpus(tmp_path / "a.npy", [7, 8, 9])
    record: list = []
    run = _train(tmp_path / "a", tmp_path / "a.npy", record, caplog)
    cfg = TrainConfig.load(run / "config.yaml")
    dataset = MemMapDataset(tmp_path / "a.npy", chunk_size=T)
    # Real text can repeat too (e.g. runs of spaces); the filter decides those the same way as OLMo (see above).
    expected = {i for i in range(48) if is_repetitive(dataset[i]["input_ids"].numpy(), cfg.data.instance_filter)}
    assert set(injected) <= expected

    filtered = read_data_indices(run, filtered=True)
    trained = read_data_indices(run)
    assert {i for step in filtered.values() for i in step[0]} == expected
    for step, ranks in filtered.items():
        assert set(ranks[0]) <= set(trained[step][0])
    steps = [r for r in record if "train/CrossEntropyLoss" in r]
    assert [r["train/FilteredInstances"] for r in steps] == [
        len(filtered.get(r["step"], {0: []})[0]) for r in steps
    ]
    assert f"instances filtered this run: {len(expected)}" in caplog.text
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["train/FilteredInstances"] for m in metrics) == len(expected)

    # A dropped instance adds nothing: other repetitive content in its place trains the very same weights.
    _corpus(tmp_path / "b.npy", [1, 2, 3, 4])
    other: list = []
    rerun = _train(tmp_path / "b", tmp_path / "b.npy", other, caplog)
    assert [r["train/CrossEntropyLoss"] for r in steps] == [
        r["train/CrossEntropyLoss"] for r in other if "train/CrossEntropyLoss" in r
    ]
    weights = torch.load(run / "step6-unsharded/model.pt", weights_only=True)
    other_weights = torch.load(rerun / "step6-unsharded/model.pt", weights_only=True)
    assert all(torch.equal(weights[k], other_weights[k]) for k in weights)
