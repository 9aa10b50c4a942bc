"""Context parallelism (``context_parallel.degree``, issue 39) on gloo, at sequence 8,192 with documents packed
into each instance (``data.generate_doc_lengths``: boundaries inside the chunks) and OLMo 3's windows: 4 ranks as CP=2 x
FSDP=2 and 4 ranks as CP=4 train as one process does (losses within 1e-5 relative over 3 steps, final weights within
1e-5) and read the same instances (``global_indices.npy``), and a checkpoint saved with CP=2 x FSDP=2 resumes in one
process and on 2 ranks with CP=2, continuing as the uninterrupted run. What cannot work is
refused before the launch, naming the key."""

import json

import numpy as np
import pytest
import torch

from olmo.config import TrainConfig
from olmo.config.validation import config_problems
from olmo.distributed.context_parallel import load_balanced_positions
from olmo.testing import (
    assert_same_weights,
    metric_by_step,
    run_train,
    tiny_config_dict,
    write_byte_memmap,
    write_config,
)
from olmo.testing.train_each import run_torchrun_each

LONG = {
    "model.max_sequence_length": 8192,
    "model.sliding_window": {"pattern": [1024, -1]},
    "data.generate_doc_lengths": True,
    "global_train_batch_size": 2,
    "device_train_microbatch_size": 1,
    "max_duration": 3,
    "save_interval_unsharded": 3,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run in one process, its context-parallel twins on 4 ranks (CP=2 x FSDP=2, CP=4) in one
    launch, and the runs with CP=2 on 2 ranks of ``test_a_context_parallel_checkpoint_resumes_on_other_layouts`` and
    ``test_a_kl_stage_shares_its_instances_as_one_process`` in another (each launch costs seconds of start-up)."""
    root = tmp_path_factory.mktemp("cp")
    write_byte_memmap(root / "corpus.npy", 8 * 8192)  # 8 instances of 8,192 tokens: 3 steps of 2
    corpus = [str(root / "corpus.npy")]

    def config(name, **extra):
        return write_config(
            root / name / "c.yaml", tiny_config_dict(root / name / "run", corpus, **{**LONG, **extra})
        )

    assert run_train(config("one")) == 0
    twins = [[config(f"cp4x{d}", **{"context_parallel.degree": d, "save_interval": 2})] for d in (2, 4)]
    result = run_torchrun_each(4, twins)
    assert result.returncode == 0, result.stderr[-4000:]
    (root / "kl").mkdir()
    write_byte_memmap(root / "kl/corpus.npy", 20_000)
    resumed2 = [config("resumed2", **{"context_parallel.degree": 2}), f"--load_path={root / 'cp4x2/run/step2'}"]
    result = run_torchrun_each(2, [resumed2, [_kl_config(root / "kl", "cp", **{"context_parallel.degree": 2})]])
    assert result.returncode == 0, result.stderr[-4000:]
    return root, config


def _kl_config(root, name, **extra):
    """Two stages, the second with a KL term, on ``root/corpus.npy``."""
    stages = [
        {"name": "pretrain", "max_duration": 2},
        {"name": "anneal-kl", "max_duration": 2, "kl_beta": 0.1, "kl_estimator": "full"},
    ]
    raw = tiny_config_dict(root / name, [str(root / "corpus.npy")], stages=stages, **extra)
    return write_config(root / f"{name}.yaml", {**raw, "max_duration": None, "save_interval_unsharded": 100})


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp4x2", "cp4x4"])
def test_ranks_sharing_each_instance_train_as_one_process(runs, layout):
    root, _ = runs
    one, cp = metric_by_step(root / "one/run"), metric_by_step(root / layout / "run")
    assert sorted(cp) == [1, 2, 3]
    np.testing.assert_allclose([cp[s] for s in range(1, 4)], [one[s] for s in range(1, 4)], rtol=1e-5)
    assert_same_weights(root / "one/run/step3-unsharded/model.pt", root / layout / "run/step3-unsharded/model.pt")
    # The same instances in the same order: a CP group reads what one data-parallel rank reads.
    order = sorted((root / "one/run").rglob("global_indices*.npy"))
    assert order, "the run wrote no global_indices.npy"
    for path in order:
        twin = root / layout / "run" / path.relative_to(root / "one/run")
        assert twin.read_bytes() == path.read_bytes(), path.name


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_on_other_layouts(runs):
    root, config = runs
    checkpoint = root / "cp4x2/run/step2"
    assert run_train(config("resumed1"), f"--load_path={checkpoint}") == 0  # the fixture resumed it with CP=2
    one = metric_by_step(root / "one/run")
    for name in ("resumed1", "resumed2"):
        resumed = metric_by_step(root / name / "run")
        assert sorted(resumed) == [3]
        np.testing.assert_allclose([resumed[3]], [one[3]], rtol=1e-5)


def test_each_rank_holds_one_early_and_one_late_chunk():
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([load_balanced_positions(48, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(48))


def _problems(world, **overrides):
    cfg = TrainConfig.from_dict(tiny_config_dict("/tmp/unused", ["/tmp/unused.npy"], **overrides))
    return " ".join(config_problems(cfg, world))


@pytest.mark.parametrize(
    "world, overrides, expected",
    [
        (3, {"context_parallel.degree": 2}, "context_parallel.degree=2 must divide the number of processes"),
        (2, {"context_parallel.degree": 2, "model.max_sequence_length": 30}, "2 x 2 = 4 equal chunks"),
        (2, {"context_parallel.degree": 0}, "context_parallel.degree=0 must be a whole number >= 1"),
        (2, {"context_parallel.degree": 2, "model.alibi": True, "model.rope": False}, "with model.alibi"),
        (
            2,
            {"context_parallel.degree": 2, "model.moe": {"num_experts": 4, "top_k": 2, "hidden_size": 16}},
            "with a mixture of experts",
        ),
        (1, {"context_parallel.degree": 2, "distributed_strategy": "single"}, "not single"),
        (
            4,
            {"context_parallel.degree": 2, "global_train_batch_size": 3, "device_train_microbatch_size": 1},
            "data-parallel ranks (2 of 4)",
        ),
        (
            6,
            {"tensor_parallel.degree": 2, "context_parallel.degree": 2, "model.n_heads": 4},
            "tensor_parallel.degree=2 x context_parallel.degree=2 = 4 must divide the number of processes launched (6)",
        ),
    ],
)
def test_layouts_that_cannot_work_are_refused_naming_the_key(world, overrides, expected):
    assert expected in _problems(world, **overrides)


def test_a_context_parallel_layout_that_fits_has_no_problem():
    assert _problems(4, **{"context_parallel.degree": 2, "global_train_batch_size": 8}) == ""


@pytest.mark.slow
def test_a_kl_stage_shares_its_instances_as_one_process(runs):
    """Two-stage KL (the frozen reference's forward gets the same share of each instance as the policy's)."""
    kl = runs[0] / "kl"
    assert run_train(_kl_config(kl, "one")) == 0  # the fixture trained "cp" on 2 ranks
    rows = {
        name: [json.loads(line) for line in (kl / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("one", "cp")
    }
    for key in ("train/CrossEntropyLoss", "train/KL"):
        one = [r[key] for r in rows["one"] if key in r]
        assert one and [r[key] for r in rows["cp"] if key in r] == pytest.approx(one, rel=1e-5), key
