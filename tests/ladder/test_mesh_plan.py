"""scripts/plan.py (issue 39, point 5): the configured mesh and the others a world size allows, each with its memory
per rank by part, whether it fits, the largest micro-batch that would, and a step time; ``--json`` for scripts; bad
flags refused naming them."""

import json
from pathlib import Path

import pytest

from olmo.config import TrainConfig
from olmo.distributed.run_shape import RunShape
from olmo.ladder.estimates import estimate_memory, model_facts, resolve_device
from olmo.testing import run_main, run_script

OFFICIAL = Path(__file__).resolve().parents[2] / "configs" / "official"


def _plan(capsys, *args):
    capsys.readouterr()
    assert run_main("plan.py", *args, "--json", "--evaluators=[]") == 0
    return json.loads(capsys.readouterr().out)


def test_one_h200_plans_olmo_1b_as_measured(capsys):
    """The measured row of RESEARCH_LOG 2026-11-26 (79,028 MiB at micro-batch 16, compiled): the configured mesh only,
    its memory by part summing to its total, and a step time from the H200's peak."""
    config = OFFICIAL / "OLMo-1B.yaml"
    args = ["--device_train_microbatch_size=16", "--global_train_batch_size=16", "--compile={}"]
    (mesh,) = _plan(capsys, config, "--world_size=1", "--device=h200", *args)
    assert mesh["configured"] and mesh["fits"] and mesh["micro_batch"] == 16
    assert mesh["degrees"] == {
        "replicate": 1,
        "shard": 1,
        "expert_parallel": 1,
        "tensor_parallel": 1,
        "context_parallel": 1,
        "pipeline_parallel": 1,
    }
    assert mesh["bubble"] == 0.0
    parts = {k: v for k, v in mesh["memory"].items() if k != "total"}
    assert sum(parts.values()) == pytest.approx(mesh["memory"]["total"])
    tensors = mesh["memory"]["total"] - mesh["memory"]["overhead"]
    assert tensors / 2**20 == pytest.approx(79028, rel=0.15)
    assert 0.3 < mesh["step_seconds"] < 1.0 and mesh["mfu"] == 0.45  # measured: 0.46 s at 56 % MFU


def test_a_cluster_lists_its_meshes_and_what_would_fit(capsys):
    meshes = _plan(capsys, OFFICIAL / "OLMoE-1B-7B.yaml", "--world_size=16", "--device=h100")
    names = [m["name"] for m in meshes]
    assert names[0] == "configured" and "HYBRID_SHARD" in names and "FULL_SHARD + EP 16" in names
    by_name = {m["name"]: m for m in meshes}
    assert (
        by_name["HYBRID_SHARD"]["degrees"]["replicate"] == 2 and by_name["HYBRID_SHARD"]["degrees"]["shard"] == 8
    )
    # Expert parallelism: each rank gathers only its experts; NO_SHARD replicates 6.9B parameters' AdamW state.
    assert (
        by_name["FULL_SHARD + EP 8"]["memory"]["gathered_params"]
        < by_name["FULL_SHARD"]["memory"]["gathered_params"]
    )
    assert not by_name["NO_SHARD"]["fits"]
    # A micro-batch too large for the device names the largest that fits.
    (big,) = [
        m
        for m in _plan(
            capsys,
            OFFICIAL / "OLMo-1B.yaml",
            "--world_size=8",
            "--device=h100",
            "--device_train_microbatch_size=64",
            "--global_train_batch_size=512",
        )
        if m["configured"]
    ]
    assert not big["fits"] and big["largest_micro_batch"] is not None and big["largest_micro_batch"] < 64
    cfg = TrainConfig.load(
        OFFICIAL / "OLMo-1B.yaml", ["device_train_microbatch_size=64", "global_train_batch_size=512"]
    )
    device = resolve_device("H100")
    run = RunShape.from_train_config(cfg)
    fits = (
        estimate_memory(run, model_facts(run), 8, device, big["largest_micro_batch"]).total <= device.memory_bytes
    )
    assert fits


def test_the_table_and_bad_flags(tmp_path):
    result = run_script(
        "plan.py", OFFICIAL / "OLMo-1B.yaml", "--world_size=4", "--device=a100", "--evaluators=[]", timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "4 x A100" in result.stdout
        and "configured" in result.stdout
        and "Step times assume 45% MFU" in result.stdout
    )
    bad = run_script("plan.py", OFFICIAL / "OLMo-1B.yaml", "--world_size=0", "--device=h100", timeout=60)
    assert bad.returncode == 2 and "--world_size=0 must be at least 1" in bad.stderr
    bad = run_script("plan.py", OFFICIAL / "OLMo-1B.yaml", "--world_size=8", "--device=tpu", timeout=60)
    assert bad.returncode == 2 and "--device" in bad.stderr


def test_wide_models_get_tensor_parallel_meshes(capsys):
    """OLMo-7B (d_model 4,096) on 64 H100s: FULL_SHARD + TP 2/4/8, each with the tensor-parallel degree in its mesh
    and a block's weights, gathered copies and inner activations falling with it (the logits do not); OLMo-1B
    (d_model 2,048) is not offered any."""
    meshes = {m["name"]: m for m in _plan(capsys, OFFICIAL / "OLMo-7B.yaml", "--world_size=64", "--device=h100")}
    fsdp = meshes["FULL_SHARD"]
    previous = fsdp
    for tp in (2, 4, 8):
        mesh = meshes[f"FULL_SHARD + TP {tp}"]
        assert mesh["degrees"]["tensor_parallel"] == tp and mesh["degrees"]["shard"] == 64 // tp
        assert mesh["degrees"]["replicate"] == 1
        for part in ("activations", "gathered_params", "total"):
            assert mesh["memory"][part] < previous["memory"][part], (tp, part)
        assert mesh["memory"]["loss"] == fsdp["memory"]["loss"]
        previous = mesh
    small = _plan(capsys, OFFICIAL / "OLMo-1B.yaml", "--world_size=64", "--device=h100")
    assert all(m["degrees"]["tensor_parallel"] == 1 for m in small)
