"""configs/official/OLMoE-1B-7B.yaml (issue 38): its --dry_run plan gives OLMoE's published sizes (6.9B parameters,
1.3B active) before any of its remote data is reached, and a shrunk copy of it trains through scripts/train.py."""

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf as om

from olmo.config import TrainConfig
from olmo.exceptions import OLMoDataError
from olmo.testing import run_main, run_train, write_byte_memmap

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "official" / "OLMoE-1B-7B.yaml"


def test_the_plan_gives_olmoe_s_sizes_before_its_data_is_reached(tmp_path, capsys, offline):
    run = tmp_path / "run"
    with pytest.raises(OLMoDataError, match=r"olmo-data\.org"):
        run_main("train.py", CONFIG, "--dry_run", f"--save_folder={run}")
    plan = capsys.readouterr().out
    assert not run.exists(), "--dry_run wrote something"
    for expected in (
        "6,919,161,856 total",  # OLMoE-1B-7B: "6.9B"
        "1,282,017,280 active per token",  # "1.3B active"
        "1,024 instances x 4096 = 4,194,304 tokens per step",
        "0.0004 peak, cosine_with_warmup, 2,500 warmup steps",
        "Experts: 6,442,450,944 parameters (93% of the model)",
    ):
        assert expected in plan, f"{expected!r} is not in the plan:\n{plan}"
    cfg = TrainConfig.load(CONFIG)
    assert cfg.model.moe is not None and (cfg.model.moe.num_experts, cfg.model.moe.top_k) == (64, 8)
    assert len(cfg.data.paths or []) == 1122 and all(
        p.startswith("https://olmo-data.org/") for p in cfg.data.paths
    )


def test_a_shrunk_copy_trains_through_the_train_command(tmp_path):
    corpus = tmp_path / "corpus.npy"
    write_byte_memmap(corpus, 30_000)
    cfg = om.load(CONFIG)
    shrunk = {
        "model.d_model": 32,
        "model.n_heads": 4,
        "model.n_layers": 2,
        "model.moe.num_experts": 4,
        "model.moe.top_k": 2,
        "model.moe.hidden_size": 16,
        "model.max_sequence_length": 32,
        "model.vocab_size": 257,
        "model.embedding_size": 320,
        "model.eos_token_id": 256,
        "model.pad_token_id": 256,
        "data.paths": [str(corpus)],
        "data.num_workers": 0,
        "data.persistent_workers": False,
        "data.prefetch_factor": None,
        "evaluators": [],
        "wandb": None,
        "global_train_batch_size": 4,
        "device_train_microbatch_size": 2,
        "max_duration": 6,
        "scheduler.units": "steps",
        "scheduler.t_warmup": 1,
        "scheduler.t_max": None,
        "optimizer.learning_rate": 1e-2,
        "save_interval": 6,
        "save_folder": str(tmp_path / "run"),
        "no_pre_train_checkpoint": True,
    }
    for key, value in shrunk.items():
        om.update(cfg, key, value, merge=False)
    om.save(cfg, tmp_path / "OLMoE-1B-7B.yaml")
    record: list = []
    assert run_train(tmp_path / "OLMoE-1B-7B.yaml", record=record) == 0
    losses = [r["train/CrossEntropyLoss"] for r in record]
    assert [r["step"] for r in record] == list(range(1, 7)) and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5
    assert all(r["train/load_balancing_loss"] >= 1.0 - 1e-5 for r in record)
    assert (tmp_path / "run/step6").is_dir()
