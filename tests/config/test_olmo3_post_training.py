"""OLMo 3 Instruct's post-training as configs (issue 53, point 6): configs/official/OLMo-3-7B-Instruct-{SFT,DPO,RL}.yaml
keep Ai2's published numbers, ``--help`` and ``--dry_run`` work on each before its data exists, and a shrunk copy
of the three stages runs on CPU, each from the checkpoint of the one before, on data that the prepare tools read
from parquet files shaped as the published datasets are."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from olmo.config import TrainConfig
from olmo.exceptions import OLMoDataError
from olmo.testing import BYTE_EOS, SHRUNK_OLMO3_7B, run_main, run_train, shrunk_copy, write_byte_tokenizer

OFFICIAL = Path(__file__).resolve().parents[2] / "configs" / "official"
STAGES = ("SFT", "DPO", "RL")
P7 = "7,298,617,344 total"
PLANS = {  # what --dry_run prints of each: the published batch, length, learning rate and objective
    "SFT": (P7, "32 instances x 32768 = 1,048,576 tokens", "max_duration=2ep", "8e-05 peak, linear_with_warmup"),
    "DPO": (
        P7,
        "256 instances x 16384",
        "max_duration=1ep",
        "1e-06 peak",
        "DPO (norm, beta 5): 128 pairs per step",
    ),
    "RL": (
        P7,
        "2,000 steps",
        "1e-06 peak, constant",
        "64 prompts per step x 8 completions of up to 8192 new tokens (512), 4 optimizer steps",
    ),
}


def _load(stage: str) -> TrainConfig:
    return TrainConfig.load(OFFICIAL / f"OLMo-3-7B-Instruct-{stage}.yaml")


def test_the_published_numbers():
    sft, dpo, rl = (_load(stage) for stage in STAGES)
    for cfg in (sft, dpo, rl):  # the same model as the long-context stage left it, started from a checkpoint
        assert cfg.model.layer_windows()[:4] == [4096, 4096, 4096, None] and cfg.model.rope_scaling.factor == 8
        assert cfg.reset_trainer_state and cfg.reset_optimizer_state and cfg.optimizer.weight_decay == 0.0
    assert (sft.optimizer.learning_rate, sft.optimizer.betas, sft.global_train_batch_size) == (
        8e-5,
        (0.9, 0.95),
        32,
    )
    assert (
        sft.model.max_sequence_length == 32768
        and sft.data.generate_doc_lengths
        and sft.stability.skip_spikes.enabled
    )
    assert (dpo.dpo.loss, dpo.dpo.beta, dpo.optimizer.learning_rate, dpo.global_train_batch_size) == (
        "norm",
        5.0,
        1e-6,
        256,
    )
    r = rl.rl
    assert (r.group_size, r.prompts_per_step, r.num_mini_batches, r.num_iterations) == (8, 64, 4, 1)
    assert (r.max_new_tokens, r.beta, r.epsilon_low, r.epsilon_high, r.scale_rewards) == (
        8192,
        0,
        0.2,
        0.272,
        "none",
    )
    assert [(w.name, w.weight) for w in r.rewards] == [("exact_answer", 10.0)]
    assert rl.model.max_sequence_length == 2048 + 8192 and rl.optimizer.learning_rate == 1e-6


@pytest.mark.parametrize("stage", STAGES)
def test_help_and_dry_run_before_the_data_exists(stage, tmp_path, capsys):
    config = OFFICIAL / f"OLMo-3-7B-Instruct-{stage}.yaml"
    assert run_main("train.py", config, "--help") == 0
    assert "rl.num_mini_batches" in capsys.readouterr().out
    run = tmp_path / "run"
    start = [] if stage == "SFT" else [f"--load_path={tmp_path / 'previous-stage'}"]
    with pytest.raises(OLMoDataError, match=r"matches no file|not a prompt folder"):
        run_main("train.py", config, "--dry_run", f"--save_folder={run}", *start)
    plan = capsys.readouterr().out
    assert not run.exists(), "--dry_run wrote something"
    for expected in PLANS[stage]:
        assert expected in plan, f"{expected!r} is not in the plan:\n{plan}"


SHRUNK = {
    **SHRUNK_OLMO3_7B,
    "data.memmap_dtype": "uint16",
    "context_parallel.degree": 1,
    "optimizer.learning_rate": 1e-2,
    "scheduler.t_warmup": 1,
    "no_pre_train_checkpoint": True,
}
"""A few thousand parameters on a byte tokenizer; everything not named here (objectives, their settings, the
schedules' shape, loading from the stage before) is the file's."""


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _sums(n: int) -> list[tuple[str, str]]:
    return [(f"What is {a} + {b}?", str(a + b)) for a in range(1, 10) for b in range(1, 10)][:n]


def test_shrunk_stages_run_one_after_another_on_published_shapes(tmp_path):
    tokenizer = write_byte_tokenizer(tmp_path / "tokenizer.json")
    common = ["-t", tokenizer, "--eos", BYTE_EOS, "--pad", BYTE_EOS, "--chat-template", "olmo3"]
    user = lambda q: {"role": "user", "content": q}  # noqa: E731
    said = lambda a: {"role": "assistant", "content": a}  # noqa: E731
    chats = [{"id": str(i), "messages": [user(q), said(a)], "source": "x"} for i, (q, a) in enumerate(_sums(40))]
    pairs = [
        {"chosen": [user(q), said(a)], "rejected": [user(q), said("I cannot say.")], "prompt_id": str(i)}
        for i, (q, a) in enumerate(_sums(24))
    ]
    verifier = ["math", "ifeval"]
    prompts = [
        {"prompt": q, "messages": [user(q)], "ground_truth": [a], "dataset": [verifier[i % 2]]}
        for i, (q, a) in enumerate(_sums(16))
    ]
    sft_data, dpo_data, rl_data = tmp_path / "sft", tmp_path / "dpo", tmp_path / "rl"
    assert run_main("prepare_sft_data.py", _parquet(tmp_path / "chats.parquet", chats), "-o", sft_data,
                    "--seq-len", 128, "--pack", *common) == 0  # fmt: skip
    assert run_main("prepare_preference_data.py", _parquet(tmp_path / "pairs.parquet", pairs), "-o", dpo_data,
                    "--seq-len", 128, *common) == 0  # fmt: skip
    assert run_main("prepare_rl_prompts.py", _parquet(tmp_path / "prompts.parquet", prompts), "-o", rl_data,
                    "--seq-len", 96, "--max-prompt-tokens", 88, "--prompt-field", "messages",
                    "--keep", "dataset=math", *common) == 0  # fmt: skip
    byte_tokenizer = {"tokenizer.identifier": str(tokenizer)}

    sft = shrunk_copy(OFFICIAL / "OLMo-3-7B-Instruct-SFT.yaml", tmp_path / "s", sft_data / "input_ids.npy", 128, 4, 4,
                      SHRUNK, **{"data.label_mask_paths": [str(sft_data / "label_mask.npy")]})  # fmt: skip
    dpo = shrunk_copy(OFFICIAL / "OLMo-3-7B-Instruct-DPO.yaml", tmp_path / "d", dpo_data / "input_ids.npy", 128, 4, 3,
                      SHRUNK, **{"data.label_mask_paths": [str(dpo_data / "label_mask.npy")],
                                 "optimizer.learning_rate": 1e-3})  # fmt: skip
    rl = shrunk_copy(OFFICIAL / "OLMo-3-7B-Instruct-RL.yaml", tmp_path / "r", rl_data / "input_ids.npy", 96, 4, 2,
                     SHRUNK, **{"rl.prompts": str(rl_data), "rl.prompts_per_step": 4, "rl.group_size": 2,
                                "rl.max_new_tokens": 8, "optimizer.learning_rate": 1e-3, "save_interval_unsharded": 2,
                                **byte_tokenizer})  # fmt: skip
    records: dict[str, list] = {stage: [] for stage in STAGES}
    assert run_train(sft, record=records["SFT"]) == 0
    assert run_train(dpo, f"--load_path={tmp_path}/s/run/step4", record=records["DPO"]) == 0
    assert run_train(rl, f"--load_path={tmp_path}/d/run/step3", record=records["RL"]) == 0

    sft_losses = [r["train/CrossEntropyLoss"] for r in records["SFT"] if "train/CrossEntropyLoss" in r]
    assert len(sft_losses) == 4 and sft_losses[-1] < sft_losses[0]  # the answers' tokens are learned
    dpo_rows = [r for r in records["DPO"] if "train/dpo/loss" in r]
    assert [r["step"] for r in dpo_rows] == [1, 2, 3], "each stage starts its own step count"
    assert all(math.isfinite(r["train/dpo/loss"]) for r in dpo_rows)
    assert abs(dpo_rows[0]["train/dpo/reward_margin"]) < 1e-4  # the policy starts as its reference: the SFT model
    assert (
        tmp_path / "d/run/train_data/dpo_reference_logps.npy"
    ).is_file()  # computed once, as open-instruct does
    rl_rows = [r for r in records["RL"] if "train/rl/loss" in r]
    assert [r["step"] for r in rl_rows] == [1, 2]
    assert all(math.isfinite(r["train/rl/rewards/exact_answer"]) for r in rl_rows)
    optim = torch.load(tmp_path / "r/run/step2-unsharded/optim.pt", weights_only=True)
    assert {float(s["step"]) for s in optim["state"].values()} == {8.0}  # four mini-batches: four steps a step
    kept = json.loads((rl_data / "prompts.json").read_text())
    assert (kept["prompts"], kept["dropped_by_keep"]) == (8, 8)  # the math rows alone
