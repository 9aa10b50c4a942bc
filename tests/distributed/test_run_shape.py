"""A run's shape (:class:`olmo.distributed.run_shape.RunShape`): what the launch's memory check, the estimates and
the plans read instead of the whole config gives the config's own numbers, valid layouts and refused ones alike."""

import pytest

from olmo.config import TrainConfig
from olmo.distributed.layout import ParallelLayout
from olmo.distributed.run_shape import RunShape
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import tiny_config_dict

# (data-parallel sharing degrees, sharding) a launch accepts on some world sizes and validation refuses on others.
LAYOUTS = [
    {},
    {"context_parallel.degree": 2},
    {"tensor_parallel.degree": 2, "context_parallel.degree": 2},
    {"tensor_parallel.degree": 3},
    {"expert_parallel.degree": 2, "fsdp.sharding_strategy": "SHARD_GRAD_OP"},
    {"fsdp.sharding_strategy": "HYBRID_SHARD"},
    {"fsdp.sharding_strategy": "HYBRID_SHARD", "fsdp.hybrid_sharding_num_model_replicas": 3},
    {"fsdp.sharding_strategy": "NO_SHARD"},
    {"distributed_strategy": "ddp", "tensor_parallel.degree": 2},
]


def _config(tmp_path, values: dict) -> TrainConfig:
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, [str(tmp_path / "a.npy")]))
    cfg.global_train_batch_size, cfg.device_train_microbatch_size = 48, 2
    for key, value in values.items():
        owner, _, name = key.rpartition(".")
        setattr(getattr(cfg, owner) if owner else cfg, name, value)
    return cfg


@pytest.mark.parametrize("values", LAYOUTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "plain")
def test_the_shape_sizes_a_run_as_its_config_does(tmp_path, values):
    cfg = _config(tmp_path, values)
    shape = RunShape.from_train_config(cfg)
    for world in (1, 2, 3, 4, 6, 8, 12, 16, 24):
        for local in (None, 8):
            try:
                planned = ParallelLayout.of_run(cfg, world_size=world, local_world_size=local)
            except OLMoConfigurationError:  # a layout validation refuses: sized as plain sharding
                planned = ParallelLayout(world_size=world)
            assert shape.layout(world, local) == planned, (world, local)
            assert shape.layout(world, local).degrees() == planned.degrees(), (world, local)
        assert shape.grad_accum_steps(world) == cfg.grad_accum_steps(world), world


def test_the_shape_holds_the_sections_not_copies(tmp_path):
    cfg = _config(tmp_path, {"precision": "amp_bf16", "fused_loss": True, "compile": {}})
    shape = RunShape.from_train_config(cfg)
    assert shape.model is cfg.model and shape.fsdp is cfg.fsdp and shape.data is cfg.data
    assert (shape.precision, shape.autocast_precision, shape.fused_loss) == ("amp_bf16", "bfloat16", True)
    assert shape.compile is cfg.compile and shape.compile is not None and not shape.dpo
