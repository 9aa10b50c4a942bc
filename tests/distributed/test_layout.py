"""The one parallel layout (:class:`olmo.distributed.layout.ParallelLayout`): its arithmetic against the definitions
the docs state, its groups in a real gloo launch, and that nothing else reads a parallel degree from the config."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from olmo.config import ContextParallelConfig, ExpertParallelConfig, FSDPConfig, TensorParallelConfig, TrainConfig
from olmo.distributed.layout import ParallelLayout
from olmo.distributed.run_shape import RunShape
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import free_port, tiny_config_dict

REPO = Path(__file__).resolve().parents[2]


def layout(world: int, rank: int = 0, *, cp: int = 1, tp: int = 1, ep: int = 1, strategy: str = "fsdp", **fsdp):
    return ParallelLayout.from_sections(
        world,
        rank,
        distributed_strategy=strategy,
        fsdp=FSDPConfig(**fsdp),
        context_parallel=ContextParallelConfig(degree=cp),
        tensor_parallel=TensorParallelConfig(degree=tp),
        expert_parallel=ExpertParallelConfig(degree=ep),
    )


@pytest.mark.parametrize("world, cp, tp", [(1, 1, 1), (4, 2, 1), (4, 1, 2), (8, 2, 2), (16, 4, 2), (12, 3, 2)])
def test_every_rank_has_one_place_in_data_x_context_x_tensor(world, cp, tp):
    places = set()
    for rank in range(world):
        lay = layout(world, rank, cp=cp, tp=tp)
        place = (lay.data_parallel_rank, lay.context_rank, lay.tensor_rank)
        assert place == (rank // (cp * tp), (rank // tp) % cp, rank % tp)  # outermost first, as the docs say
        places.add(place)
    assert len(places) == world and layout(world, cp=cp, tp=tp).data_parallel_size == world // (cp * tp)


@pytest.mark.parametrize(
    "kwargs, replicate, shard",
    [
        ({}, 1, 8),
        ({"tp": 2}, 1, 4),
        ({"cp": 2}, 1, 8),  # a context-parallel group's ranks shard the model like any others
        ({"sharding_strategy": "NO_SHARD"}, 8, 1),
        ({"strategy": "ddp", "tp": 2}, 4, 1),
        ({"sharding_strategy": "HYBRID_SHARD", "hybrid_sharding_num_model_replicas": 2}, 2, 4),
        ({"sharding_strategy": "HYBRID_SHARD"}, 1, 8),  # one node: one replica
        ({"sharding_strategy": "SHARD_GRAD_OP", "tp": 4}, 1, 2),
    ],
)
def test_fsdp_shards_over_every_rank_but_the_tensor_parallel_ones(kwargs, replicate, shard):
    degrees = layout(8, **kwargs).degrees()
    assert (degrees["replicate"], degrees["shard"]) == (replicate, shard)
    assert degrees["replicate"] * degrees["shard"] * degrees["tensor_parallel"] == 8


def test_hybrid_sharding_replicates_over_nodes():
    sections = {
        "fsdp": FSDPConfig(sharding_strategy="HYBRID_SHARD"),
        "tensor_parallel": TensorParallelConfig(degree=2),
    }
    lay = ParallelLayout.from_sections(32, local_world_size=8, **sections)
    assert (lay.replicate, lay.shard, lay.tensor) == (4, 4, 2)


def test_one_process_shares_nothing_whatever_the_degrees():
    """A checkpoint evaluated or converted alone: no split, but the expert degree is kept for its warning."""
    lay = layout(1, cp=2, tp=2, ep=2)
    assert (lay.context, lay.tensor, lay.expert, lay.shard, lay.data_parallel_size) == (1, 1, 2, 1, 1)
    assert not lay.expert_sharded and lay.model_mesh is None and lay.context_parallel is None


def test_a_degree_that_does_not_divide_the_ranks_is_refused_by_name():
    with pytest.raises(
        OLMoConfigurationError, match=r"tensor_parallel.degree=3 must divide the number of processes \(4\)"
    ):
        layout(4, tp=3)
    with pytest.raises(OLMoConfigurationError, match="fsdp.hybrid_sharding_num_model_replicas=3 must divide"):
        layout(4, sharding_strategy="HYBRID_SHARD", hybrid_sharding_num_model_replicas=3)


def test_a_planned_layout_never_fails(tmp_path):
    """Estimates size configs validation may still refuse: a bad degree is planned as plain sharding."""
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, [str(tmp_path / "a.npy")]))
    cfg.tensor_parallel.degree = 3
    assert RunShape.from_train_config(cfg).layout(4).degrees() == ParallelLayout(world_size=4).degrees()
    cfg.tensor_parallel.degree = 2
    assert RunShape.from_train_config(cfg).layout(4).tensor == 2


def test_a_layout_sized_for_a_cluster_has_no_meshes():
    with pytest.raises(RuntimeError, match="needs their process group"):
        _ = layout(4, cp=2).context_parallel
    with pytest.raises(RuntimeError, match="has no process group"):
        _ = layout(4).launch


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Every rank's groups in each layout of tests/distributed/layout_worker.py, from one 4-process launch."""
    out = tmp_path_factory.mktemp("layout") / "groups.json"
    worker = Path(__file__).resolve().parent / "layout_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", f"--master_port={free_port()}"]
    result = subprocess.run(
        [*cmd, str(worker), str(out)], capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def _env():
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _where(rank: int, fn) -> list[int]:
    return [r for r in range(4) if fn(r) == fn(rank)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, cp, tp", [("cp2_tp2", 2, 2), ("cp2", 2, 1), ("cp2_ddp", 2, 1), ("hybrid_cp2", 2, 1)]
)
def test_a_context_parallel_group_is_the_cp_dimension_of_the_data_mesh(groups, name, cp, tp):
    """The ranks that share an instance: the same data-parallel rank and tensor-parallel place, in rank order (what
    the hand-made groups of earlier versions held, so the numbers do not change)."""
    for rank, mine in enumerate(groups):
        got = mine[name]
        assert got["context_parallel"]["ranks"] == _where(rank, lambda r: (r // (cp * tp), r % tp))
        assert got["context_parallel"]["rank"] == (rank // tp) % cp
        assert got["data_parallel_rank"] == rank // (cp * tp)


@pytest.mark.slow
def test_the_model_mesh_is_fsdp_then_tensor_parallel(groups):
    for rank, mine in enumerate(groups):
        cp_tp, hybrid = mine["cp2_tp2"], mine["tp2_hybrid"]
        assert cp_tp["model_mesh"]["tp"] == _where(rank, lambda r: r // 2)  # consecutive ranks
        assert cp_tp["fsdp_mesh"] == {"shard": _where(rank, lambda r: r % 2)}  # every rank of its tensor place
        assert hybrid["fsdp_mesh"]["replicate"] == _where(rank, lambda r: r % 2)
        assert hybrid["model_mesh_shape"] == [2, 1, 2]
        # Hybrid sharding with context parallelism: the replicas are the outer half, as before.
        assert mine["hybrid_cp2"]["fsdp_mesh"]["shard"] == _where(rank, lambda r: r // 2)
        assert mine["cp2_ddp"]["fsdp_mesh_shape"] == [4, 1]


@pytest.mark.slow
def test_the_expert_mesh_holds_every_expert_once_per_ep_group(groups):
    for rank, mine in enumerate(groups):
        ep = mine["ep2"]["expert_mesh"]
        assert ep["ep"] == _where(rank, lambda r: r % 2) and ep["ep_dp"] == _where(rank, lambda r: r // 2)
        assert "expert_mesh" not in mine["cp2"]


PARALLEL_SECTIONS = {"context_parallel", "tensor_parallel", "expert_parallel"}
READS_ALLOWED = {
    # What a dry run in one process will need under torchrun: the config's own degrees, not this launch's layout.
    "olmo/ladder/run_planner.py": "the single-process dry run names the degrees the config asks of a later launch",
}


def test_only_the_layout_reads_a_parallel_degree_from_the_config():
    """Outside olmo/config (which validates the degrees) and the layout, no module reads ``X.<section>.degree`` or
    the config's own rank arithmetic: each asks the layout."""
    offenders = []
    for path in sorted((REPO / "olmo").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("olmo/config/") or rel == "olmo/distributed/layout.py" or rel in READS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or isinstance(node.ctx, ast.Store):
                continue
            base = node.value
            degree = node.attr == "degree" and isinstance(base, ast.Attribute) and base.attr in PARALLEL_SECTIONS
            config_arithmetic = node.attr == "tensor_parallel_size" or (
                node.attr == "data_parallel_rank" and "layout" not in ast.unparse(base)
            )
            if degree or config_arithmetic:
                offenders.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "ask the ParallelLayout instead:\n" + "\n".join(offenders)


def test_build_model_still_takes_a_one_process_env_and_refuses_a_bare_env_of_several(tmp_path):
    import torch

    from olmo.distributed import DistEnv, ParallelizeOptions, build_model

    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, [str(tmp_path / "a.npy")]))
    options = ParallelizeOptions.from_train_config(cfg)
    one = DistEnv(torch.device("cpu"), 0, 0, 1)
    assert build_model(cfg.model, one, options).num_params() > 0  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ParallelLayout.of_run\(train_config, env\)"):
        build_model(cfg.model, DistEnv(torch.device("cpu"), 0, 0, 2), options)  # type: ignore[arg-type]
