"""The run planner (olmo.ladder.run_planner): the trainer's own numbers, a memory estimate checked against what the model saves
for backward and against a training process's measured peak, and ``scripts/train.py CONFIG --dry_run``."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed

from olmo.config import TrainConfig
from olmo.distributed.run_shape import RunShape
from olmo.exceptions import OLMoDataError
from olmo.ladder.run_planner import DeviceSpec, estimate_memory, format_plan, model_facts, plan_run
from olmo.model import OLMo
from olmo.testing import BYTE_VOCAB, run_main, tiny_config_dict, write_byte_memmap, write_config

REPO = Path(__file__).resolve().parents[2]
CPU = DeviceSpec("cpu", False, 64e9, 1e11, "a test's figure")
H100 = DeviceSpec("H100 80GB", True, 80 * 2**30, 989e12, "a test's figure")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan-data") / "train.npy"
    write_byte_memmap(path, 40_000)
    return str(path)


def _cfg(corpus: str, **overrides) -> TrainConfig:
    return TrainConfig.from_dict(tiny_config_dict("unused", [corpus], **overrides))


def test_plan_uses_the_models_counts_and_the_trainers_batch_and_length_rules(corpus):
    cfg = _cfg(corpus, max_duration="20480T", global_train_batch_size=16, device_train_microbatch_size=2)
    cfg.validate(4)
    plan = plan_run(cfg, 4, device_type="cpu")
    with torch.device("meta"):
        model = OLMo(cfg.model)
    assert (plan.num_params, plan.num_non_embedding_params) == (model.num_params(), model.num_params(False))
    assert (plan.device_batch_instances, plan.rank_microbatch_instances, plan.grad_accum_steps) == (4, 2, 2)
    assert plan.grad_accum_steps == cfg.grad_accum_steps(4) and plan.num_devices == plan.dp_world_size == 4
    assert plan.max_steps == cfg.max_steps(0) == 40 and plan.total_tokens == 40 * 16 * 32
    assert plan.train_flops == model.num_flops_per_token(32) * plan.total_tokens
    assert plan.learning_rate == cfg.optimizer.learning_rate and plan.warmup_steps == 3
    assert plan.fits and plan.est_wall_time_s is not None
    assert json.loads(json.dumps(plan.as_dict()))["est_peak_memory_gb"] == plan.est_peak_memory_gb
    text = format_plan(plan)
    assert (
        "40 steps" in text and "micro-batches of 2 (2 accumulation step(s))" in text and "FSDP FULL_SHARD" in text
    )

    epochs = _cfg(corpus, max_duration="2ep", global_train_batch_size=16)
    assert plan_run(epochs, 1, device_type="cpu").max_steps is None  # the dataset's size is needed
    assert plan_run(epochs, 1, instances_per_epoch=100, device_type="cpu").max_steps == 2 * (100 // 16)


def _memory(corpus: str, world_size: int = 8, device: DeviceSpec = H100, **overrides):
    values = {"precision": "amp_bf16", "model.d_model": 256, "model.n_heads": 4, "model.n_layers": 4}
    values["model.max_sequence_length"] = 512
    cfg = _cfg(corpus, **{**values, **overrides})
    return _estimate(cfg, world_size, device)


def _estimate(cfg: TrainConfig, world_size: int, device: DeviceSpec, micro_batch=None):
    run = RunShape.from_train_config(cfg)
    return estimate_memory(run, model_facts(run), world_size, device, micro_batch)


def test_memory_estimate_follows_sharding_checkpointing_and_the_fused_loss(corpus):
    full = _memory(corpus)
    single, no_shard = _memory(corpus, world_size=1), _memory(corpus, **{"fsdp.sharding_strategy": "NO_SHARD"})
    assert full.params * 8 == pytest.approx(no_shard.params) and no_shard.params == single.params
    assert full.optimizer == 2 * full.params  # AdamW: two fp32 moments
    # The peak is the first backward's start: gradients exist then only if earlier micro-batches made them.
    accumulating = _memory(corpus, global_train_batch_size=16, device_train_microbatch_size=1)
    assert full.grads == 0 and accumulating.grads == full.params
    assert _memory(corpus, **{"optimizer.name": "lionw"}).optimizer == full.params
    assert _memory(corpus, **{"distributed_strategy": "ddp"}).params == no_shard.params
    grad_op = _memory(corpus, **{"fsdp.sharding_strategy": "SHARD_GRAD_OP"})
    assert grad_op.gathered_params > full.gathered_params and grad_op.params == full.params
    whole = _memory(corpus, activation_checkpointing="whole_layer")
    half = _memory(corpus, activation_checkpointing="one_in_two")
    assert whole.activations < half.activations < full.activations
    # The fused loss holds one 2048-token chunk of fp32 logits (and its gradients) instead of all of them.
    big = {"model.embedding_size": 50304, "device_train_microbatch_size": 8, "global_train_batch_size": 64}
    assert _memory(corpus, **big, fused_loss=True).loss < 0.7 * _memory(corpus, **big).loss
    assert _memory(corpus, device=CPU).activations > full.activations  # fp32 on a CPU, bf16 under autocast


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"model.n_kv_heads": 1, "model.d_model": 64, "model.n_heads": 4},
        {"model.rope": False, "model.activation_type": "gelu", "model.n_layers": 3},
    ],
    ids=["rope-swiglu", "gqa", "gelu-no-rope"],
)
def test_activation_estimate_matches_what_the_model_saves_for_backward(corpus, shape):
    """Every tensor autograd keeps for the backward pass of a forward on CPU (fp32), counted once per storage."""
    cfg = _cfg(corpus, **{"model.max_sequence_length": 64, **shape})
    torch.manual_seed(0)
    model = OLMo(cfg.model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.is_floating_point():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, BYTE_VOCAB, (4, 64)))  # logits only: the loss's memory is estimated apart
    estimate = _estimate(cfg, 1, CPU, micro_batch=4)
    rope_tables = 2 * 4 * 64 * (cfg.model.d_model // cfg.model.n_heads) if cfg.model.rope else 0
    assert estimate.activations == pytest.approx(sum(saved.values()) - rope_tables, rel=0.02)


def _peak_rss_mb(config: Path) -> float:
    """Train 2 steps in a fresh process (glibc returning freed blocks, so the resident set follows the live
    tensors) and return the peak resident set it logged."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, str(REPO / "scripts/train.py"), str(config)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = Path(TrainConfig.load(config).save_folder) / "metrics.jsonl"
    return max(json.loads(line)["System/Peak Memory (MB)"] for line in metrics.read_text().splitlines())


def test_memory_estimate_matches_the_measured_peak_on_cpu(corpus, tmp_path):
    """Peak resident set of a training process minus that of a process training a minute model (Python, torch,
    data loader), against the estimate of the tensors: within 15%, for plain training with the full logits and
    for whole-layer activation checkpointing with the fused loss."""
    common = {
        "max_duration": 2,
        "save_interval_unsharded": None,
        "speed_monitor.gpu_flops_available": 1e11,
        "model.max_sequence_length": 256,
    }
    shape = {"model.d_model": 256, "model.n_heads": 4, "model.n_layers": 4, "model.embedding_size": 16384}
    batch = {"global_train_batch_size": 16, "device_train_microbatch_size": 16}
    variants = {
        "baseline": {
            "model.d_model": 16,
            "model.n_layers": 1,
            "global_train_batch_size": 1,
            "device_train_microbatch_size": 1,
        },
        "plain": {**shape, **batch},
        "checkpointed": {**shape, **batch, "activation_checkpointing": "whole_layer", "fused_loss": True},
    }
    configs = {
        name: write_config(tmp_path / f"{name}.yaml", tiny_config_dict(tmp_path / name, [corpus], **common, **v))
        for name, v in variants.items()
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        peaks = dict(zip(configs, pool.map(_peak_rss_mb, configs.values())))
    for name in ("plain", "checkpointed"):
        cfg = TrainConfig.load(configs[name])
        estimate = _estimate(cfg, 1, CPU).tensors / 2**20
        measured = peaks[name] - peaks["baseline"]
        assert 0.85 < measured / estimate < 1.15, (name, measured, estimate, peaks)


def test_train_dry_run_prints_the_plan_and_trains_nothing(corpus, tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [corpus], max_duration=20))
    assert run_main("train.py", config, "--dry_run") == 0
    out = capsys.readouterr().out
    for expected in (
        "parameters:",
        "micro-batches of 4 (2 accumulation step(s))",
        "20 steps",
        "memory / device:",
        "time:",
    ):
        assert expected in out, out
    assert not (tmp_path / "run").exists(), "a dry run wrote into save_folder"
    assert not torch.distributed.is_initialized()


def test_train_dry_run_checks_the_data_and_shows_the_plan_before_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.npy"
    np.full(4096, BYTE_VOCAB + 5, dtype=np.uint16).tofile(bad)
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(bad)]))
    with pytest.raises(OLMoDataError, match="bad.npy"):
        run_main("train.py", config, "--dry_run")
    assert "duration:" in capsys.readouterr().out  # the plan needs no data; the data's problem comes after it
    assert not (tmp_path / "run").exists()
