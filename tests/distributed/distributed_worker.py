"""Run a few training steps under several parallelism settings in ONE torchrun launch (or in one
process) and save the losses and final weights of each: ``python tests/distributed/distributed_worker.py OUT DATA``."""

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from olmo.config import TrainConfig
from olmo.data import build_train_dataloader
from olmo.distributed import (
    ParallelizeOptions,
    ParallelLayout,
    build_model,
    init_distributed,
    teardown_distributed,
)
from olmo.optim import build_optimizer, build_scheduler
from olmo.testing import tiny_config_dict
from olmo.train import Trainer
from olmo.train.build_module import build_train_module
from olmo.util.rng import seed_all

SETTINGS = {
    "full_shard": {},
    "shard_grad_op": {"fsdp.sharding_strategy": "SHARD_GRAD_OP"},
    "hybrid_2_replicas": {"fsdp.sharding_strategy": "HYBRID_SHARD", "fsdp.hybrid_sharding_num_model_replicas": 2},
    "no_shard": {"fsdp.sharding_strategy": "NO_SHARD"},
    "ddp": {"distributed_strategy": "ddp"},
    # With accumulation, replicas all-reduce once per step (after the last micro-batch).
    "ddp_accumulating": {"distributed_strategy": "ddp", "device_train_microbatch_size": 2},
    "ddp_sync_every_micro_batch": {
        "distributed_strategy": "ddp",
        "ddp.grad_sync_mode": "micro_batch",
        "device_train_microbatch_size": 2,
    },
    "hybrid_accumulating": {
        "fsdp.sharding_strategy": "HYBRID_SHARD",
        "fsdp.hybrid_sharding_num_model_replicas": 2,
        "device_train_microbatch_size": 1,
    },
    "by_block_and_size": {"fsdp.wrapping_strategy": "by_block_and_size"},
    "one_in_two": {"fsdp.wrapping_strategy": "one_in_two", "model.n_layers": 3},
    "checkpoint_one_in_two": {"activation_checkpointing": "one_in_two"},
    "checkpoint_fine_grained": {"activation_checkpointing": "fine_grained"},
    # The fused loss must give the losses and weights of the plain one (compared in the test).
    "fused_loss": {"fused_loss": True},
    "tied": {"model.weight_tying": True},
    "tied_fused_loss": {"model.weight_tying": True, "fused_loss": True},
    "by_size_fused_loss": {"fsdp.wrapping_strategy": "by_block_and_size", "fused_loss": True},
    "tied_by_size": {"model.weight_tying": True, "fsdp.wrapping_strategy": "by_block_and_size"},
    "collect_every_2": {"metrics_collect_interval": 2},
    # Muon gathers each matrix: a 2-D mesh (replicas x shards) and plain replicas (DDP) too.
    "muon_hybrid": {
        "optimizer.name": "muon",
        "fsdp.sharding_strategy": "HYBRID_SHARD",
        "fsdp.hybrid_sharding_num_model_replicas": 2,
    },
    "muon_ddp": {"optimizer.name": "muon", "distributed_strategy": "ddp"},
    # Dropout masks depend on how rows are split over ranks, so these two are compared with each other.
    "dropout": {"model.residual_dropout": 0.1, "model.attention_dropout": 0.1},
    "dropout_checkpoint_whole_layer": {
        "model.residual_dropout": 0.1,
        "model.attention_dropout": 0.1,
        "activation_checkpointing": "whole_layer",
    },
}
STEPS = 3


def main(out: Path, data: str) -> None:
    env = init_distributed()
    results = {}
    try:
        for name, overrides in SETTINGS.items():
            cfg = TrainConfig.from_dict(tiny_config_dict(out / name, [data], **overrides))
            seed_all(cfg.seed)
            loader = build_train_dataloader(cfg, world_size=env.world_size, rank=env.rank, work_dir=out / name)
            model = build_model(
                cfg.model, ParallelLayout.of_run(cfg, env), ParallelizeOptions.from_train_config(cfg)
            )
            optimizer = build_optimizer(cfg.optimizer, model)
            train_module = build_train_module(cfg, env, model, optimizer, build_scheduler(cfg.scheduler))
            trainer = Trainer(cfg, env, train_module, loader)
            records = []
            for step, batch in zip(range(1, STEPS + 1), loader):
                trainer.state.global_step = step
                records.append(trainer.train_step(batch))
            trainer.collect_metrics()
            losses = [r.values["train/CrossEntropyLoss"] for r in records]
            weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            results[name] = {"losses": losses, "weights": weights}
        if env.rank == 0:
            torch.save(results, out / f"results-{env.world_size}.pt")
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
