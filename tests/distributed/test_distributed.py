"""Multi-process training under torchrun: 2 gloo ranks on CPU with FSDP2, as users launch it.

Tolerance: sharding changes the order of floating-point reductions (gradients are reduce-scattered,
norms summed per shard), so FSDP runs match a single process to rtol 1e-5 on losses and atol 1e-5 on
weights after a few steps, not bitwise.
"""

import json

import numpy as np
import pytest
import torch

from olmo.data import read_data_indices
from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config
from olmo.testing.train_each import run_torchrun_each


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_byte_memmap(root / "a.npy", 30_000)
    return [str(root / "a.npy")]


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train/CrossEntropyLoss"] for line in lines]


def _weights(checkpoint):
    return torch.load(checkpoint / "model.pt", weights_only=True)


def _indices_by_step(run_dir):
    """{step: [instance indices of every rank]}, as the data-index log records them."""
    return {
        step: [i for rank in sorted(ranks) for i in ranks[rank]]
        for step, ranks in read_data_indices(run_dir).items()
    }


def _check(result):
    assert result.returncode == 0, result.stderr[-4000:]


ACCUMULATION = {"1x8": (1, 8), "8x1": (1, 1), "2x4": (2, 4), "2x2x2": (2, 2)}
"""name: (processes, micro-batch size) of the 5-step runs compared with each other."""

SAVES = {
    "sharded": {"save_interval": 3, "save_interval_unsharded": None},
    "sharded_async": {"save_interval": 3, "save_interval_unsharded": None, "save_async": True},
    "unsharded": {"save_interval_unsharded": 3},
}
"""The checkpoints that carry a 9-step run from 2 ranks to one process and back."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Every run of this module's 2-rank tests, in two torchrun launches: the runs of :data:`ACCUMULATION` (5 steps)
    and the first 3 steps of each :data:`SAVES` run, then, after steps 4-6 of those in one process, their last 3
    steps on 2 ranks again. Also the one-process runs compared with them, and ``uninterrupted``: 9 steps in one
    process without a stop, the reference of the resumed runs (saves change no number, and 2 ranks match one process
    to rtol 1e-5)."""
    root = tmp_path_factory.mktemp("runs")

    def config(name, **overrides):
        return write_config(root / name / "c.yaml", tiny_config_dict(root / name / "run", corpus, **overrides))

    first = []
    for name, (nproc, micro) in ACCUMULATION.items():
        path = config(name, device_train_microbatch_size=micro, max_duration=5, save_interval_unsharded=5)
        if nproc == 1:
            assert run_train(path) == 0
        else:
            first.append([path])
    parts = {save: config(save, max_duration=9, **overrides) for save, overrides in SAVES.items()}
    _check(run_torchrun_each(2, [*first, *([part, "--stop_at=3"] for part in parts.values())]))
    for part in parts.values():
        assert run_train(part, "--try_load_latest_save", "--stop_at=6") == 0
    _check(run_torchrun_each(2, [[part, "--try_load_latest_save"] for part in parts.values()]))
    assert run_train(config("uninterrupted", max_duration=9)) == 0
    return root


def test_fsdp_two_ranks_match_one_process_with_and_without_accumulation(runs):
    results = {
        name: (_losses(runs / name / "run"), _weights(runs / name / "run/step5-unsharded"))
        for name in ACCUMULATION
    }
    reference_losses, reference_weights = results["1x8"]
    for name, (losses, weights) in results.items():
        np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, err_msg=name)
        assert weights.keys() == reference_weights.keys()
        for key, value in weights.items():
            torch.testing.assert_close(value, reference_weights[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.parametrize("save", list(SAVES))
def test_checkpoint_from_two_ranks_resumes_on_one_and_back(runs, save):
    # The run of `uninterrupted` in three launches: 2 ranks -> 1 process -> 2 ranks.
    part, uninterrupted = runs / save / "run", runs / "uninterrupted/run"
    np.testing.assert_allclose(_losses(part), _losses(uninterrupted), rtol=1e-5)
    # Audit the data: every step trained on the same global batch, no instance skipped or repeated.
    used, reference = _indices_by_step(part), _indices_by_step(uninterrupted)
    assert sorted(used) == list(range(1, 10))
    for step in used:
        assert sorted(used[step]) == sorted(reference[step]), step
    flat = [i for step in sorted(used) for i in used[step]]
    assert len(flat) == len(set(flat)) == 9 * 8
    order = np.fromfile(part / "train_data/global_indices.npy", dtype=np.uint32)
    assert sorted(flat) == sorted(order[: 9 * 8].tolist())


def test_every_parallelism_setting_matches_one_process(tmp_path, corpus):
    """FSDP2 sharding/wrapping strategies, DDP and activation checkpointing, in one 2-rank launch."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    from olmo.testing import free_port

    worker = Path(__file__).resolve().parent / "distributed_worker.py"
    # One process: the worker's main in this process (it starts and ends its own process group of one).
    spec = importlib.util.spec_from_file_location("distributed_worker", worker)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path, corpus[0])
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(worker),
        str(tmp_path),
        corpus[0],
    ]
    sharded = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert sharded.returncode == 0, sharded.stderr[-4000:]
    one = torch.load(tmp_path / "results-1.pt", weights_only=True)
    two = torch.load(tmp_path / "results-2.pt", weights_only=True)
    for name, reference in one.items():
        if name.startswith("dropout"):
            continue
        np.testing.assert_allclose(two[name]["losses"], reference["losses"], rtol=1e-5, err_msg=name)
        for key, value in reference["weights"].items():
            torch.testing.assert_close(two[name]["weights"][key], value, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
    # The fused loss and collecting metrics every 2 steps change no number beyond rounding.
    for results in (one, two):
        for name, reference_name in (
            ("fused_loss", "full_shard"),
            ("tied_fused_loss", "tied"),
            ("by_size_fused_loss", "full_shard"),
            ("tied_by_size", "tied"),
            ("collect_every_2", "full_shard"),
        ):
            np.testing.assert_allclose(
                results[name]["losses"], results[reference_name]["losses"], rtol=1e-5, err_msg=name
            )
            for key, value in results[reference_name]["weights"].items():
                torch.testing.assert_close(results[name]["weights"][key], value, rtol=1e-4, atol=1e-5)
    # Activation checkpointing recomputes exactly what it discarded, dropout masks included.
    for results in (one, two):
        assert results["dropout_checkpoint_whole_layer"]["losses"] == results["dropout"]["losses"]
        assert results["dropout"]["losses"] != results["full_shard"]["losses"]


def test_compiled_blocks_train_like_eager_ones(tmp_path, corpus):
    losses = {}
    for name, compile_cfg in (("eager", None), ("compiled", {"fullgraph": True})):
        record = []
        cfg = tiny_config_dict(
            tmp_path / name / "run", corpus, max_duration=3, save_interval_unsharded=None, compile=compile_cfg
        )
        assert run_train(write_config(tmp_path / name / "c.yaml", cfg), record=record) == 0
        losses[name] = [r["train/CrossEntropyLoss"] for r in record]
    np.testing.assert_allclose(losses["compiled"], losses["eager"], rtol=1e-4)
