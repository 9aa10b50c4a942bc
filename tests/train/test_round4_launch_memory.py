"""Issue 50 (robustness round 4): a model far too large for the machine is refused by a real launch in one paragraph
before the run folder is written (it was an allocator traceback after it), while ``--dry_run`` shows the plan that
says it does not fit; the check is a lower bound, so it refuses only what certainly cannot fit."""

from pathlib import Path

import pytest

from olmo.config import TrainConfig
from olmo.distributed.launch_memory import launch_memory_problem, meta_model
from olmo.distributed.run_shape import RunShape
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import run_main, tiny_config_dict, write_byte_corpus, write_config

MOE = {
    "model.moe": {"num_experts": 4, "top_k": 2, "hidden_size": 16},
    "model.layer_norm_type": "rms",
    "model.attention_layer_norm": True,
    "device_train_microbatch_size": 2,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _config(tmp_path: Path, corpus, **overrides) -> Path:
    return write_config(tmp_path / "config.yaml", tiny_config_dict(tmp_path / "run", corpus, **overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["--model.moe.hidden_size=1000000000"], id="moe_hidden_size"),  # the example
        pytest.param(["--model.moe=null", "--model.mlp_hidden_size=20000000000"], id="dense_mlp"),
        pytest.param(["--model.moe.num_experts=4096", "--model.moe.hidden_size=100000000"], id="many_experts"),
    ],
)
def test_a_launch_refuses_a_model_that_cannot_fit_before_writing(tmp_path, corpus, overrides):
    config = _config(tmp_path, corpus, **MOE)
    with pytest.raises(OLMoConfigurationError) as e:
        run_main("train.py", config, *overrides)
    message = str(e.value)
    assert "The model does not fit" in message and "Nothing was written" in message, message
    assert "model.moe.hidden_size" in message and "--dry_run" in message and "\n" not in message
    assert not (tmp_path / "run").exists()


def test_the_dry_run_of_that_model_shows_it_does_not_fit(tmp_path, corpus, capsys):
    config = _config(tmp_path, corpus, **MOE)
    assert run_main("train.py", config, "--dry_run", "--model.moe.hidden_size=1000000000") == 0
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_the_bound_counts_only_what_every_step_keeps(tmp_path, corpus):
    def shape(*overrides: str) -> RunShape:
        return RunShape.from_train_config(TrainConfig.load(_config(tmp_path, corpus), list(overrides)))

    cfg = shape()
    params = meta_model(cfg.model).num_params()
    need = 16 * params  # AdamW: fp32 weights, gradients, two moments
    assert launch_memory_problem(cfg, params, 1, need, "of the test") is None
    refused = launch_memory_problem(cfg, params, 1, need - 1, "of the test")
    assert refused is not None and f"{params:,} parameters" in refused and "none of it sharded" in refused
    # FSDP over 4 processes shares the state; NO_SHARD and DDP do not.
    assert launch_memory_problem(cfg, params, 4, need / 4, "of the test") is None
    no_shard = shape("fsdp.sharding_strategy=NO_SHARD")
    assert launch_memory_problem(no_shard, params, 4, need / 4, "of the test") is not None
    lion = shape("optimizer.name=lionw")
    assert launch_memory_problem(lion, params, 1, 12 * params, "of the test") is None
    # Tensor parallelism splits the weights without FSDP too: DDP with TP 2 over 2 processes needs half.
    ddp_tp = shape("distributed_strategy=ddp", "tensor_parallel.degree=2")
    assert launch_memory_problem(ddp_tp, params, 2, need / 2, "of the test") is None
    assert launch_memory_problem(ddp_tp, params, 2, need / 2 - 1, "of the test") is not None
