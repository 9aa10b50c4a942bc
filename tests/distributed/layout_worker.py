"""Build several :class:`~olmo.distributed.layout.ParallelLayout` s in ONE torchrun launch and record, for every rank,
the ranks of each of its groups: ``python -m torch.distributed.run --nproc_per_node=4 layout_worker.py OUT.json``."""

import json
import sys

import torch.distributed as dist

from olmo.config import ContextParallelConfig, ExpertParallelConfig, FSDPConfig, TensorParallelConfig
from olmo.distributed import init_distributed, teardown_distributed
from olmo.distributed.layout import ParallelLayout

LAYOUTS = {
    "cp2_tp2": {"context_parallel": 2, "tensor_parallel": 2},
    "cp2": {"context_parallel": 2},
    "cp2_ddp": {"context_parallel": 2, "distributed_strategy": "ddp"},
    "tp2_hybrid": {"tensor_parallel": 2, "sharding": "HYBRID_SHARD", "replicas": 2},
    "hybrid_cp2": {"context_parallel": 2, "sharding": "HYBRID_SHARD", "replicas": 2},
    "ep2": {"expert_parallel": 2},
}


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def describe(layout: ParallelLayout) -> dict:
    """This rank's groups in every mesh of ``layout``."""
    out: dict = {"data_parallel_rank": layout.data_parallel_rank, "data_parallel_size": layout.data_parallel_size}
    for name in ("model_mesh", "fsdp_mesh", "expert_mesh"):
        mesh = getattr(layout, name)
        if mesh is not None:
            names = mesh.mesh_dim_names or ()
            out[name] = {dim: _ranks(mesh.get_group(dim)) for dim in names}
            out[name + "_shape"] = list(mesh.shape)
    cp = layout.context_parallel
    if cp is not None:
        out["context_parallel"] = {"rank": cp.rank, "degree": cp.degree, "ranks": _ranks(cp.group)}
    return out


def main(out_path: str) -> None:
    env = init_distributed()
    results = {}
    for name, spec in LAYOUTS.items():
        layout = ParallelLayout.from_sections(
            env.world_size,
            env=env,
            distributed_strategy=spec.get("distributed_strategy", "fsdp"),
            fsdp=FSDPConfig(
                sharding_strategy=spec.get("sharding", "FULL_SHARD"),
                hybrid_sharding_num_model_replicas=spec.get("replicas"),
            ),
            context_parallel=ContextParallelConfig(degree=spec.get("context_parallel", 1)),
            tensor_parallel=TensorParallelConfig(degree=spec.get("tensor_parallel", 1)),
            expert_parallel=ExpertParallelConfig(degree=spec.get("expert_parallel", 1)),
        )
        results[name] = describe(layout)
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, results)
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    teardown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
