"""End-to-end training behaviour on real text (byte-level stdlib source), through scripts/train.py."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.checkpoint import MARKER, find_latest_checkpoint
from olmo.config import TrainConfig
from olmo.data import build_memmap_dataset
from olmo.exceptions import OLMoTrainingError
from olmo.testing import run_train, tiny_config_dict, write_byte_corpus, write_config
from olmo.train import EXIT_CODE_STOPPED


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _setup(tmp_path, corpus, **overrides):
    cfg = tiny_config_dict(tmp_path / "run", corpus, **overrides)
    return write_config(tmp_path / "config.yaml", cfg)


def _losses(record):
    return [r["train/CrossEntropyLoss"] for r in record]


def _model_state(checkpoint: Path):
    return torch.load(checkpoint / "model.pt", weights_only=True)


def test_training_reduces_loss_and_leaves_a_complete_run_folder(tmp_path, corpus):
    record = []
    assert run_train(_setup(tmp_path, corpus, max_duration=40, save_interval_unsharded=20), record=record) == 0
    losses = _losses(record)
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses  # from ~5.6 to well under 3.5
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file()
    assert (run / "train_data/global_indices.npy").stat().st_size == 4 * (50_000 // 32)
    assert sorted(p.name for p in run.glob("step*")) == ["step20-unsharded", "step40-unsharded"]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 41))
    for key in (
        "train/Perplexity",
        "optim/total_grad_norm",
        "optim/learning_rate_group0",
        "throughput/device/tokens_per_second",
        "throughput/mfu",
        "System/Peak Memory (MB)",
    ):
        assert key in lines[-1], key
    assert lines[0]["train/Perplexity"] == pytest.approx(np.exp(lines[0]["train/CrossEntropyLoss"]))


def test_resumed_run_matches_uninterrupted_run_exactly(tmp_path, corpus):
    # Dropout on, so the test also proves the RNG state is restored.
    dropout = {"model.residual_dropout": 0.1, "model.attention_dropout": 0.1, "max_duration": 12}
    full, resumed = [], []
    assert run_train(_setup(tmp_path / "full", corpus, **dropout), record=full) == 0
    first = _setup(tmp_path / "part", corpus, stop_at=6, **dropout)
    assert run_train(first, record=resumed) == 0
    assert run_train(first, "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    assert [r["step"] for r in resumed] == list(range(1, 13))
    assert _losses(resumed) == _losses(full)  # bitwise on CPU
    a = _model_state(tmp_path / "full/run/step12-unsharded")
    b = _model_state(tmp_path / "part/run/step12-unsharded")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gradient_accumulation_does_not_change_training(tmp_path, corpus):
    runs = {}
    for micro in (8, 1):
        record = []
        assert (
            run_train(
                _setup(
                    tmp_path / f"m{micro}",
                    corpus,
                    device_train_microbatch_size=micro,
                    max_duration=4,
                    save_interval_unsharded=4,
                ),
                record=record,
            )
            == 0
        )
        runs[micro] = (_losses(record), _model_state(tmp_path / f"m{micro}/run/step4-unsharded"))
    np.testing.assert_allclose(runs[8][0], runs[1][0], rtol=1e-5)
    for key, value in runs[8][1].items():
        torch.testing.assert_close(value, runs[1][1][key], rtol=1e-4, atol=1e-5)


def test_inspection_snippet_returns_the_tokens_the_trainer_trained_on(tmp_path, corpus, monkeypatch):
    from olmo.train.train_module import TransformerTrainModule

    seen = []
    original = TransformerTrainModule.train_batch

    def spy(self, batch, dry_run=False):
        seen.append(batch["input_ids"].clone())
        return original(self, batch, dry_run)

    monkeypatch.setattr(TransformerTrainModule, "train_batch", spy)
    config_path = _setup(tmp_path, corpus, max_duration=5, **{"data.seed": 7})
    assert run_train(config_path) == 0
    # The inspection snippet of docs/mixtures.md, verbatim apart from the two paths.
    train_config_path = tmp_path / "run/config.yaml"
    data_order_file_path = tmp_path / "run/train_data/global_indices.npy"
    cfg = TrainConfig.load(train_config_path)
    dataset = build_memmap_dataset(cfg, cfg.data)
    batch_size = cfg.global_train_batch_size
    global_indices = np.memmap(data_order_file_path, mode="r+", dtype=np.uint32)
    assert len(seen) == 5
    for step, trained in enumerate(seen, start=1):
        s = step - 1
        snippet = []
        for index in global_indices[s * batch_size : (s + 1) * batch_size]:
            token_ids = dataset[index]["input_ids"].tolist()
            snippet.append(token_ids)
        assert snippet == trained.tolist(), f"batch of step {step} differs"


def test_label_masked_tokens_do_not_contribute_to_the_loss(tmp_path, corpus, monkeypatch):
    tokens = np.memmap(corpus[0], dtype=np.uint16, mode="r")[: 32 * 64]
    data = tmp_path / "sft"
    data.mkdir()
    np.asarray(tokens).tofile(data / "input_ids.npy")
    mask = np.zeros(len(tokens), dtype=bool)
    mask[: 32 * 32] = True  # instances 0-31 train, instances 32-63 are fully masked
    mask.tofile(data / "label_mask.npy")
    scrambled = np.asarray(tokens).copy()
    scrambled[32 * 32 :] = np.random.default_rng(0).integers(0, 256, size=32 * 32)
    scrambled.tofile(data / "input_ids_scrambled.npy")

    def run(ids_name):
        record = []
        path = _setup(
            tmp_path / ids_name,
            [str(data / ids_name)],
            max_duration=6,
            **{"data.label_mask_paths": [str(data / "label_mask.npy")], "data.seed": 3},
        )
        assert run_train(path, record=record) == 0
        return _losses(record), _model_state(tmp_path / ids_name / "run/step5-unsharded")

    clean, garbled = run("input_ids.npy"), run("input_ids_scrambled.npy")
    # Changing only fully-masked instances changes neither the loss nor the weights.
    assert clean[0] == garbled[0]
    assert all(torch.equal(clean[1][k], garbled[1][k]) for k in clean[1])


@pytest.mark.parametrize(
    "collect, message, kept",
    [
        (1, r"step 4 on rank 0.*optimizer step was skipped", [1, 2, 3]),
        (5, r"step 4 on rank 0.*1 step\(s\) later", [3]),
    ],
    ids=["collect_every_step", "collect_every_5"],
)
def test_non_finite_loss_stops_before_any_checkpoint(tmp_path, corpus, monkeypatch, collect, message, kept):
    from olmo.model import layers

    original = layers.cross_entropy_sums
    calls = {"n": 0}

    def poisoned(logits, labels, z):
        calls["n"] += 1
        loss = original(logits, labels, z)
        return loss._replace(ce=loss.ce * float("nan")) if calls["n"] > 6 else loss  # step 4 (2 micro-batches)

    monkeypatch.setattr(layers, "cross_entropy_sums", poisoned)
    interval = 1 if collect == 1 else 3
    config = _setup(
        tmp_path, corpus, max_duration=10, save_interval_unsharded=interval, metrics_collect_interval=collect
    )
    with pytest.raises(OLMoTrainingError, match=message):
        run_train(config)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("step*")) == [f"step{i}-unsharded" for i in kept]
    # Every step before the bad one is logged, and nothing after it.
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3]


def test_collecting_metrics_every_few_steps_logs_every_step_unchanged(tmp_path, corpus):
    losses = {}
    for collect in (1, 3):
        config = _setup(tmp_path / str(collect), corpus, max_duration=7, metrics_collect_interval=collect)
        assert run_train(config) == 0
        lines = [
            json.loads(line) for line in (tmp_path / str(collect) / "run/metrics.jsonl").read_text().splitlines()
        ]
        assert [m["step"] for m in lines] == list(range(1, 8))
        losses[collect] = [(m["train/CrossEntropyLoss"], m["optim/total_grad_norm"]) for m in lines]
    assert losses[3] == losses[1]


def test_time_limit_saves_and_exits_with_the_resumable_code(tmp_path, corpus):
    config = _setup(tmp_path, corpus, max_duration=50, time_limit=1e-9, save_interval_unsharded=None)
    assert run_train(config) == EXIT_CODE_STOPPED
    latest = find_latest_checkpoint(tmp_path / "run")
    assert latest is not None and latest.name == "step1-unsharded" and (latest / MARKER).is_file()


def _sft_data(folder: Path, corpus_file: str, n_instances: int = 32, seq: int = 32):
    """Instances whose second half carries the loss, like a prompt/response pair."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.asarray(np.memmap(corpus_file, dtype=np.uint16, mode="r")[-n_instances * seq :])
    tokens.tofile(folder / "input_ids.npy")
    mask = np.zeros((n_instances, seq), dtype=bool)
    mask[:, seq // 2 :] = True
    mask.reshape(-1).tofile(folder / "label_mask.npy")
    return folder / "input_ids.npy", folder / "label_mask.npy"


def test_finetune_command_from_the_olmo_readme(tmp_path, corpus):
    assert run_train(_setup(tmp_path / "base", corpus, max_duration=20, save_interval_unsharded=20)) == 0
    ckpt = tmp_path / "base/run/step20-unsharded"
    ids, mask = _sft_data(tmp_path / "sft", corpus[1])
    base_weights = _model_state(ckpt)
    finetuned, fresh = [], []
    args = [f"--data.paths=[{ids}]", f"--data.label_mask_paths=[{mask}]"]
    config = _setup(tmp_path / "ft", corpus, max_duration=4, save_interval_unsharded=4)
    assert run_train(config, *args, f"--load_path={ckpt}", "--reset_trainer_state", record=finetuned) == 0
    assert run_train(_setup(tmp_path / "fresh", corpus, max_duration=4), *args, record=fresh) == 0
    assert [r["step"] for r in finetuned] == [1, 2, 3, 4]  # the step count and data position restart
    assert finetuned[0]["train/CrossEntropyLoss"] < fresh[0]["train/CrossEntropyLoss"] - 1.0  # weights loaded
    # The optimizer state was loaded too: its moments are non-zero from the first update on.
    optim = torch.load(tmp_path / "ft/run/step4-unsharded/optim.pt", weights_only=True)
    assert int(next(iter(optim["state"].values()))["step"]) == 24  # 20 from the base run + 4
    assert all(torch.equal(base_weights[k], v) for k, v in _model_state(ckpt).items())  # untouched


def test_reset_optimizer_state_loads_weights_only_and_warms_up_again(tmp_path, corpus):
    assert run_train(_setup(tmp_path / "base", corpus, max_duration=10, save_interval_unsharded=10)) == 0
    record = []
    config = _setup(tmp_path / "re", corpus, max_duration=16, save_interval_unsharded=16)
    assert (
        run_train(
            config, f"--load_path={tmp_path}/base/run/step10-unsharded", "--reset_optimizer_state", record=record
        )
        == 0
    )
    assert [r["step"] for r in record] == list(range(11, 17))  # trainer state (position) kept
    lrs = [r["optim/learning_rate_group0"] for r in record]
    assert lrs[0] < lrs[1] < lrs[2], "a fresh optimizer mid-run gets a bolt-on warmup"
    optim = torch.load(tmp_path / "re/run/step16-unsharded/optim.pt", weights_only=True)
    assert int(next(iter(optim["state"].values()))["step"]) == 6


def test_sigterm_saves_a_checkpoint_and_the_relaunch_continues(tmp_path, corpus):
    import os
    import signal
    import subprocess
    import sys
    import time

    config = _setup(tmp_path, corpus, max_duration=100_000, save_interval_unsharded=None)
    script = Path(__file__).resolve().parents[2] / "scripts/train.py"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, str(script), str(config)], env=env, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run/metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_CODE_STOPPED, stderr[-2000:]
    latest = find_latest_checkpoint(tmp_path / "run")
    assert latest is not None
    stopped_at = int(latest.name[len("step") :].split("-")[0])
    assert stopped_at >= 3
    record = []
    assert run_train(config, "--try_load_latest_save", "--stop_after=2", record=record) == 0
    assert [r["step"] for r in record] == [stopped_at + 1, stopped_at + 2]


def test_epochs_reshuffle_and_resume_across_the_boundary(tmp_path, corpus):
    small = tmp_path / "small.npy"
    np.asarray(np.memmap(corpus[0], dtype=np.uint16, mode="r")[: 32 * 20]).tofile(small)  # 20 instances
    # 20 instances, batch 8 -> 2 batches per epoch (4 instances dropped); 3 epochs = 6 steps.
    full, resumed = [], []
    assert run_train(_setup(tmp_path / "full", [str(small)], max_duration="3ep"), record=full) == 0
    assert len(full) == 6
    order = tmp_path / "full/run/train_data"
    epoch0 = np.fromfile(order / "global_indices.npy", dtype=np.uint32)
    epoch1 = np.fromfile(order / "global_indices_epoch1.npy", dtype=np.uint32)
    assert sorted(epoch0) == sorted(epoch1) == list(range(20)) and not np.array_equal(epoch0, epoch1)
    part = _setup(tmp_path / "part", [str(small)], max_duration="3ep", stop_at=2)  # stops at the epoch end
    assert run_train(part, record=resumed) == 0
    assert run_train(part, "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    assert _losses(resumed) == _losses(full)


def test_sharded_checkpoints_resume_exactly_and_convert_to_unsharded(tmp_path, corpus):
    sharded = {"save_interval": 3, "save_interval_unsharded": None, "max_duration": 6}
    full, resumed = [], []
    assert run_train(_setup(tmp_path / "full", corpus, **sharded), record=full) == 0
    part = _setup(tmp_path / "part", corpus, stop_at=3, **sharded)
    assert run_train(part, record=resumed) == 0
    step3 = tmp_path / "part/run/step3"
    assert (step3 / "model_and_optim/.metadata").is_file() and (step3 / MARKER).is_file()
    assert run_train(part, "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    assert _losses(resumed) == _losses(full)
    # OLMo's conversion recipe: load a sharded checkpoint, save it unsharded, don't train.
    assert run_train(part, f"--load_path={step3}", "--force_save_unsharded", "--dry_run", "--save_overwrite") == 0
    converted = _model_state(tmp_path / "part/run/step3-unsharded")
    assert "transformer.blocks.0.att_proj.weight" in converted


def test_z_loss_is_trained_and_logged(tmp_path, corpus):
    record = []
    config = _setup(tmp_path, corpus, max_duration=3, softmax_auxiliary_loss=True, auxiliary_loss_multiplier=0.01)
    assert run_train(config, record=record) == 0
    assert all(r["train/ZLoss"] > 0 for r in record)


def test_wandb_runs_offline_by_default(tmp_path, corpus, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = _setup(tmp_path, corpus, max_duration=2, wandb={"project": "olmo-test", "entity": None})
    assert run_train(config) == 0
    runs = list((tmp_path / "run/wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_a_fresh_run_started_at_a_later_epoch_continues_from_it(tmp_path, corpus):
    small = tmp_path / "small.npy"
    np.asarray(np.memmap(corpus[0], dtype=np.uint16, mode="r")[: 32 * 16]).tofile(small)  # 2 batches an epoch
    assert run_train(_setup(tmp_path, [str(small)], max_duration=4, epoch=3)) == 0
    order = tmp_path / "run/train_data"
    assert sorted(p.name for p in order.glob("*.npy")) == [
        "global_indices_epoch3.npy",
        "global_indices_epoch4.npy",
    ]
    state = torch.load(tmp_path / "run/step4-unsharded/train.pt", weights_only=True)
    assert state["epoch"] == 4


def test_in_loop_evaluation_runs_on_schedule_and_does_not_disturb_training(tmp_path, corpus):
    lm_eval = [{"label": "held-out", "type": "lm", "data": {"paths": [corpus[1]]}, "subset_num_batches": 2}]
    with_eval, without_eval = [], []
    cfg = _setup(
        tmp_path / "eval", corpus, max_duration=7, eval_interval=3, evaluators=lm_eval, device_eval_batch_size=4
    )
    assert run_train(cfg, record=with_eval) == 0
    assert run_train(_setup(tmp_path / "plain", corpus, max_duration=7), record=without_eval) == 0
    evals = [r for r in with_eval if "eval/seconds" in r]
    assert [r["step"] for r in evals] == [3, 6, 7]
    for r in evals:
        assert r["eval/held-out/Perplexity"] == pytest.approx(np.exp(r["eval/held-out/CrossEntropyLoss"]))
    assert evals[-1]["eval/held-out/CrossEntropyLoss"] < evals[0]["eval/held-out/CrossEntropyLoss"]
    assert _losses([r for r in with_eval if "eval/seconds" not in r]) == _losses(without_eval)
    resumed = []
    assert (
        run_train(
            cfg,
            f"--load_path={tmp_path}/eval/run/step5-unsharded",
            "--eval_on_load",
            "--stop_at=6",
            "--save_overwrite",
            record=resumed,
        )
        == 0
    )
    assert [r["step"] for r in resumed if "eval/seconds" in r] == [5, 6]
