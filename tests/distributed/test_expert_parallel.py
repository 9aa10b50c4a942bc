"""Expert parallelism (``expert_parallel.degree``, issue 38) on gloo: 2 ranks with the experts split in two, and 4
ranks with them split in two and each half sharded over 2 (the experts' weights gathered over ``ep_dp``; activation
checkpointing on), train as
one process does (losses within 1e-5 relative over 5 steps, final weights within 1e-5); a checkpoint saved with
EP=2 resumes in one process and on 2 FSDP ranks without EP, continuing as the uninterrupted run; what cannot work
is refused before the launch, naming the key."""

import numpy as np
import pytest
import torch

from olmo.config import TrainConfig
from olmo.config.validation import config_problems
from olmo.testing import (
    assert_same_weights,
    metric_by_step,
    run_torchrun,
    run_train,
    tiny_config_dict,
    write_byte_corpus,
    write_config,
)
from olmo.testing.train_each import run_torchrun_each

MOE = {
    "model.moe": {"num_experts": 4, "top_k": 2, "hidden_size": 16},
    "model.layer_norm_type": "rms",
    "model.attention_layer_norm": True,
    "max_duration": 5,
    "device_train_microbatch_size": 2,
    "save_interval_unsharded": 5,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run in one process, its expert-parallel twins on 2 and 4 ranks, and the 2 FSDP ranks that
    resume the 2-rank twin's checkpoint."""
    root = tmp_path_factory.mktemp("ep")
    corpus = write_byte_corpus(root / "corpus")

    def config(name, **extra):
        return write_config(
            root / name / "c.yaml", tiny_config_dict(root / name / "run", corpus, **{**MOE, **extra})
        )

    ep = {"expert_parallel.degree": 2, "save_interval": 3}
    assert run_train(config("one")) == 0
    # 2 ranks with EP=2, then, in the same launch (each costs seconds of start-up), 2 FSDP ranks without EP resuming
    # its step-3 checkpoint for test_a_checkpoint_saved_with_experts_in_parallel_resumes_on_other_layouts.
    resumed = [config("resumed2"), f"--load_path={root / 'ep2x2/run/step3'}"]
    result = run_torchrun_each(2, [[config("ep2x2", **ep)], resumed], timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    # With 4 ranks the blocks recomputed in the backward pass exchange their tokens again.
    result = run_torchrun(4, config("ep4x2", **ep, activation_checkpointing="whole_layer"), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return root, config


def _assert_same_weights(a, b):
    assert torch.load(a, weights_only=True)["transformer.blocks.0.moe.w1"].shape == (4, 32, 16)
    assert_same_weights(a, b)


@pytest.mark.parametrize("layout", ["ep2x2", "ep4x2"])
def test_expert_parallel_ranks_train_as_one_process(runs, layout):
    root, _ = runs
    one, ep = metric_by_step(root / "one/run"), metric_by_step(root / layout / "run")
    assert sorted(ep) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([ep[s] for s in range(1, 6)], [one[s] for s in range(1, 6)], rtol=1e-5)
    _assert_same_weights(root / "one/run/step5-unsharded/model.pt", root / layout / "run/step5-unsharded/model.pt")


def test_a_checkpoint_saved_with_experts_in_parallel_resumes_on_other_layouts(runs):
    root, config = runs
    checkpoint = root / "ep2x2/run/step3"
    assert run_train(config("resumed1"), f"--load_path={checkpoint}") == 0  # the fixture resumed it on 2 ranks
    one = metric_by_step(root / "one/run")
    for name in ("resumed1", "resumed2"):
        resumed = metric_by_step(root / name / "run")
        assert sorted(resumed) == [4, 5]
        np.testing.assert_allclose([resumed[s] for s in (4, 5)], [one[s] for s in (4, 5)], rtol=1e-5)
        _assert_same_weights(
            root / "one/run/step5-unsharded/model.pt", root / name / "run/step5-unsharded/model.pt"
        )


@pytest.mark.parametrize(
    "extra, world, fragment",
    [
        ({"expert_parallel.degree": 3}, 3, "expert_parallel.degree=3 must divide model.moe.num_experts=4"),
        ({"expert_parallel.degree": 2}, 3, "must divide the number of processes launched (3)"),
        ({"expert_parallel.degree": 2, "model.moe": None}, 2, "expert_parallel.degree=2 needs model.moe"),
        ({"expert_parallel.degree": 2, "distributed_strategy": "ddp"}, 2, "works with distributed_strategy=fsdp"),
        ({"expert_parallel.degree": 0}, 1, "expert_parallel.degree=0 must be a whole number >= 1"),
    ],
)
def test_what_cannot_work_is_refused_naming_the_key(tmp_path, extra, world, fragment):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, [str(tmp_path / "a.npy")], **{**MOE, **extra}))
    problems = config_problems(cfg, world)
    assert any(fragment in p for p in problems), problems


def test_a_model_built_in_fewer_processes_than_its_degree_holds_every_expert(tmp_path, caplog):
    """Benchmarks and conversions build a trained config's model in one process: every expert on the rank, a warning."""
    from olmo.distributed import ParallelizeOptions, ParallelLayout, build_model
    from olmo.distributed.collectives import DistEnv

    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, [str(tmp_path / "a.npy")], **MOE))
    cfg.expert_parallel.degree = 2
    env = DistEnv(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)
    model = build_model(cfg.model, ParallelLayout.of_run(cfg, env), ParallelizeOptions.from_train_config(cfg))
    layer = model.transformer.typed_blocks()[0].moe
    assert layer is not None and layer.expert_group is None and tuple(layer.w1.shape) == (4, 32, 16)
    assert "expert_parallel.degree=2 is not used here (1 process(es))" in caplog.text
