"""Tensor parallelism (``tensor_parallel.degree``, issue 39) on gloo, with OLMo 2's QK-norm, grouped key/value heads,
biases, OLMo 3's windows and documents packed into each instance: 4 ranks as TP=2 x FSDP=2, 2 ranks as TP=2 and 4
ranks as CP=2 x TP=2 (one mesh) train as one process does (losses within 1e-5 relative over 5 steps, final weights
within 1e-5, the same ``global_indices.npy``, the same in-loop evaluation), and checkpoints hold the canonical
tensors: checkpoints saved with TP=2 x FSDP=2 and CP=2 x TP=2 resume in one process and under TP=2, and one process's
unsharded checkpoint resumes under TP=2, each continuing as the uninterrupted run. What cannot work is refused
before the launch, naming the key."""

import numpy as np
import pytest

from olmo.config import TrainConfig
from olmo.config.validation import config_problems
from olmo.distributed.tensor_parallel import _rank_major
from olmo.testing import (
    assert_same_weights,
    metric_by_step,
    run_torchrun,
    run_train,
    tiny_config_dict,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)
from olmo.testing.train_each import run_torchrun_each

SHAPE = {
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.attention_layer_norm": True,
    "model.layer_norm_type": "rms",
    "model.include_bias": True,
    "model.clip_qkv": 8.0,
    "model.sliding_window": {"pattern": [8, -1]},
    "data.generate_doc_lengths": True,
    "max_duration": 5,
    "save_interval": 3,
    "save_interval_unsharded": 3,
    "eval_interval": 5,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run in one process, and every run of this module under torchrun, in as few launches as
    work (each costs seconds of start-up): its tensor-parallel twins and the 3-D mesh on 4 ranks, and the runs with
    TP=2 on 2 ranks: a twin, the resumed runs of ``test_checkpoints_resume_across_tensor_parallel_layouts`` and the
    compiled blocks."""
    root = tmp_path_factory.mktemp("tp")
    write_byte_memmap(root / "corpus.npy", 20_000)
    write_byte_memmap(
        root / "val.npy", 32 * 13, skip_bytes=50_000
    )  # 13 instances: the two data-parallel shares differ
    corpus = [str(root / "corpus.npy")]
    evaluators = [
        {"label": "val", "data": {"datasets": {"val": [str(root / "val.npy")]}}},
        {"label": "s", "type": "generate", "prompts": ["def ", "import os", "class"], "max_new_tokens": 6},
    ]
    tokenizer = {"identifier": str(write_byte_tokenizer(root / "tokenizer.json"))}

    def config(name, **extra):
        raw = tiny_config_dict(
            root / name / "run", corpus, **{**SHAPE, "evaluators": evaluators, "tokenizer": tokenizer, **extra}
        )
        return write_config(root / name / "c.yaml", raw)

    tp2 = {"tensor_parallel.degree": 2}
    assert run_train(config("one")) == 0
    hsdp = {
        **tp2,
        "fsdp": {"sharding_strategy": "HYBRID_SHARD", "hybrid_sharding_num_model_replicas": 2},
        "activation_checkpointing": "whole_layer",
        "evaluators": [],
    }
    # TP=2 x FSDP=2 and CP=2 x TP=2 share a launch; the 3-D mesh's runs cannot share one with them (the meshes of
    # a later run meet an earlier run's process groups: olmo.testing.train_each), so it has a launch of its own.
    cp2tp2 = {**tp2, "context_parallel.degree": 2}
    result = run_torchrun_each(4, [[config("tp4", **tp2)], [config("cp2tp2", **cp2tp2)]])
    assert result.returncode == 0, result.stderr[-4000:]
    result = run_torchrun(4, config("hsdp", **hsdp), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    # Sharded, saved by CP=2 x TP=2, into TP=2 on 2 ranks; unsharded, saved by one process, into TP=2.
    resumed = [
        [config(name, **tp2), f"--load_path={root / source}"]
        for name, source in (("from_cp_tp", "cp2tp2/run/step3"), ("into_tp", "one/run/step3-unsharded"))
    ]
    compiled = config("compiled", **tp2, **{"compile": {}, "max_duration": 3, "evaluators": []})
    result = run_torchrun_each(2, [[config("tp2", **tp2)], *resumed, [compiled]])  # all TP=2 on 2 ranks
    assert result.returncode == 0, result.stderr[-4000:]
    return root, config


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp4", "tp2", "cp2tp2"])
def test_ranks_sharing_each_layer_train_as_one_process(runs, layout):
    root, _ = runs
    one, tp = metric_by_step(root / "one/run"), metric_by_step(root / layout / "run")
    assert sorted(tp) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([tp[s] for s in range(1, 6)], [one[s] for s in range(1, 6)], rtol=1e-5)
    # In-loop evaluation: a tensor-parallel group scores its share together (the same inputs on its ranks).
    key = "eval/val/CrossEntropyLoss"
    one_eval, tp_eval = metric_by_step(root / "one/run", key), metric_by_step(root / layout / "run", key)
    assert sorted(one_eval) == sorted(tp_eval) and one_eval
    np.testing.assert_allclose([tp_eval[s] for s in one_eval], list(one_eval.values()), rtol=1e-5)
    # Greedy generation with the KV cache: the same tokens (3 prompts: the ranks of a group decode the same ones).
    samples = "eval/s/samples"
    assert metric_by_step(root / layout / "run", samples) == metric_by_step(root / "one/run", samples)
    assert metric_by_step(root / "one/run", samples)
    # Unsharded checkpoints hold the canonical rows: the same files as one process's.
    for step in (3, 5):
        assert_same_weights(
            root / f"one/run/step{step}-unsharded/model.pt", root / layout / f"run/step{step}-unsharded/model.pt"
        )
    order = sorted((root / "one/run").rglob("global_indices*.npy"))
    assert order, "the run wrote no global_indices.npy"
    for path in order:
        assert (root / layout / "run" / path.relative_to(root / "one/run")).read_bytes() == path.read_bytes()


@pytest.mark.slow
def test_checkpoints_resume_across_tensor_parallel_layouts(runs):
    root, config = runs
    # Sharded, saved by TP=2 x FSDP=2, into one process; the fixture resumed a sharded checkpoint saved by
    # CP=2 x TP=2 into TP=2 on 2 ranks, and one process's unsharded one into TP=2.
    assert run_train(config("from_tp"), f"--load_path={root / 'tp4/run/step3'}") == 0
    one = metric_by_step(root / "one/run")
    for name in ("from_tp", "from_cp_tp", "into_tp"):
        resumed = metric_by_step(root / name / "run")
        assert sorted(resumed) == [4, 5]
        np.testing.assert_allclose([resumed[4], resumed[5]], [one[4], one[5]], rtol=1e-5)
        assert_same_weights(
            root / "one/run/step5-unsharded/model.pt", root / name / "run/step5-unsharded/model.pt"
        )


@pytest.mark.slow
def test_compiled_blocks_split_over_ranks_train_as_one_process(runs):
    """``torch.compile`` of each block with the parallel styles' hooks and the QK-norm's sums over the group (left to
    eager mode)."""
    root, _ = runs
    one, tp = metric_by_step(root / "one/run"), metric_by_step(root / "compiled/run")
    np.testing.assert_allclose([tp[s] for s in (1, 2, 3)], [one[s] for s in (1, 2, 3)], rtol=1e-5)


@pytest.mark.slow
def test_a_three_dimensional_mesh_trains_as_one_process(runs):
    """HYBRID_SHARD x TP: replicate 2 x shard 1 x tp 2 on 4 ranks, with activation checkpointing."""
    root, _ = runs
    one, tp = metric_by_step(root / "one/run"), metric_by_step(root / "hsdp/run")
    np.testing.assert_allclose([tp[s] for s in range(1, 6)], [one[s] for s in range(1, 6)], rtol=1e-5)
    assert_same_weights(root / "one/run/step5-unsharded/model.pt", root / "hsdp/run/step5-unsharded/model.pt")


def test_fused_rows_are_stored_rank_major():
    # q (4 rows), k and v (2 each) over 2 ranks: rank 0's q, k, v, then rank 1's.
    assert _rank_major([4, 2, 2], 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert _rank_major([3, 3], 3).tolist() == [0, 3, 1, 4, 2, 5]
    assert sorted(_rank_major([8, 4, 4], 4).tolist()) == list(range(16))


def _problems(world, **overrides):
    cfg = TrainConfig.from_dict(tiny_config_dict("/tmp/unused", ["/tmp/unused.npy"], **overrides))
    return " ".join(config_problems(cfg, world))


@pytest.mark.parametrize(
    "world, overrides, expected",
    [
        (3, {"tensor_parallel.degree": 2}, "tensor_parallel.degree=2 must divide the number of processes"),
        (4, {"tensor_parallel.degree": 4, "model.n_heads": 2}, "must divide model.n_heads = 2"),
        (2, {"tensor_parallel.degree": 2, "model.n_heads": 4, "model.n_kv_heads": 1}, "key/value heads"),
        (2, {"tensor_parallel.degree": 2, "model.mlp_hidden_size": 90}, "MLP's hidden size"),
        (2, {"tensor_parallel.degree": 0}, "tensor_parallel.degree=0 must be a whole number >= 1"),
        (2, {"tensor_parallel.degree": 2, "model.alibi": True, "model.rope": False}, "with model.alibi"),
        (
            2,
            {"tensor_parallel.degree": 2, "model.moe": {"num_experts": 4, "top_k": 2, "hidden_size": 16}},
            "with a mixture of experts",
        ),
        (1, {"tensor_parallel.degree": 2, "distributed_strategy": "single"}, "not single"),
        (4, {"tensor_parallel.degree": 2, "expert_parallel.degree": 2}, "together with expert_parallel.degree=2"),
        (
            4,
            {"tensor_parallel.degree": 2, "global_train_batch_size": 3, "device_train_microbatch_size": 1},
            "data-parallel ranks (2 of 4)",
        ),
    ],
)
def test_tensor_parallel_layouts_that_cannot_work_are_refused_naming_the_key(world, overrides, expected):
    assert expected in _problems(world, **overrides)


def test_a_tensor_parallel_layout_that_fits_has_no_problem():
    assert _problems(4, **{"tensor_parallel.degree": 2}) == ""
    assert _problems(8, **{"tensor_parallel.degree": 2, "context_parallel.degree": 2, "model.n_heads": 4}) == ""
