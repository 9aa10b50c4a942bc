"""Spike skipping and rollback (``stability``, issue 27), against real faults: a stretch of batches of random bytes
written into the token file where the data order puts steps 41-44, and a loss that turns non-finite.

The skip-step optimizers are checked against torch's AdamW and our LionW computed in the test; the detector against
the z-score computed with numpy; the runs end to end through ``scripts/train.py``."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.config import TrainConfig
from olmo.data import IterableDataset, build_memmap_dataset
from olmo.exceptions import OLMoConfigurationError, OLMoTrainingError
from olmo.optim import LionW
from olmo.optim.skip_step import SkipStepAdamW, SkipStepLionW
from olmo.testing import run_main, run_train, tiny_config_dict, write_byte_memmap, write_config

SEQ, BATCH = 32, 8
BAD_STEPS = range(41, 45)
STABLE = {
    "stability.skip_spikes.enabled": True,
    "stability.skip_spikes.warmup_steps": 10,
    "stability.skip_spikes.window": 16,
    "stability.rollback.enabled": True,
}


def _config(folder: Path, path: Path, **overrides) -> dict:
    settings = {"max_duration": 80, "save_interval_unsharded": 6, "save_num_unsharded_checkpoints_to_keep": -1}
    return tiny_config_dict(folder, [str(path)], **{**settings, "scheduler.t_warmup": 5, **overrides})


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """The same text twice; in ``bad`` the instances of steps 41-44 (by the run's data order) are random bytes."""
    root = tmp_path_factory.mktemp("corpora")
    clean, bad = root / "clean.npy", root / "bad.npy"
    for path in (clean, bad):
        write_byte_memmap(path, 200 * BATCH * SEQ)
    cfg = TrainConfig.from_dict(_config(root / "probe", bad))
    order = IterableDataset(build_memmap_dataset(cfg, cfg.data), BATCH, seed=cfg.seed).global_indices()
    tokens = np.memmap(bad, dtype=np.uint16, mode="r+")
    rng = np.random.default_rng(0)
    for position in range((BAD_STEPS[0] - 1) * BATCH, BAD_STEPS[-1] * BATCH):
        i = int(order[position])
        tokens[i * SEQ : (i + 1) * SEQ] = rng.integers(0, 256, SEQ)
    tokens.flush()
    return {"clean": clean, "bad": bad}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _tail_loss(run: Path, n: int = 10) -> float:
    losses = [r["train/CrossEntropyLoss"] for r in _rows(run) if "train/CrossEntropyLoss" in r]
    return sum(losses[-n:]) / n


# ---------------------------------------------------------------------------------------------------------------
def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
        torch.nn.Parameter(torch.randn(7, generator=gen)),
    ]


def _set_grads(params, step: int, bad: bool = False) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * (float("inf") if bad else 1.0)


@pytest.mark.parametrize("kind", ["adamw", "lionw"])
def test_the_skip_step_optimizers_follow_the_plain_ones_and_a_skipped_step_changes_nothing(kind):
    ours, reference = _params(), _params()
    if kind == "adamw":
        opt = SkipStepAdamW(ours, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        ref = torch.optim.AdamW(reference, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    else:
        opt = SkipStepLionW(ours, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
        ref = LionW(reference, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    for step in range(1, 7):
        skip = step in (1, 4)  # a skipped first step too: nothing may divide by a zero bias correction
        _set_grads(ours, step, bad=skip)
        before = [p.detach().clone() for p in ours], {k: v.clone() for k, v in opt.state[ours[0]].items()}
        opt.step_factor = torch.tensor(0.0 if skip else 1.0)
        opt.step()
        if skip:  # bitwise nothing changed, though the gradients were infinite
            assert all(torch.equal(a, p) for a, p in zip(before[0], ours))
            assert all(torch.equal(v, opt.state[ours[0]][k]) for k, v in before[1].items())
            assert all(not v.any() for v in opt.state[ours[0]].values()) if not before[1] else True  # fresh: zeros
            continue
        _set_grads(reference, step)
        ref.step()
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if kind == "adamw":
        assert opt.state[ours[0]]["step"].item() == 4.0  # 6 steps, 2 skipped
        # The state is torch's AdamW's: it loads there (a run can turn skipping off when it resumes).
        plain = torch.optim.AdamW(_params(), lr=0.01)
        plain.load_state_dict(opt.state_dict())


def test_the_detector_skips_outliers_of_its_window_by_the_numpy_z_score():
    from olmo.config.stability_sections import SkipSpikesConfig
    from olmo.train.stability import SpikeDetector

    cfg = SkipSpikesConfig(enabled=True, z_threshold=4.0, window=10, warmup_steps=3)
    detector = SpikeDetector(cfg, torch.device("cpu"))
    rng = np.random.default_rng(1)
    losses = list(3 + 0.05 * rng.standard_normal(30))
    norms = list(1 + 0.1 * rng.standard_normal(30))
    losses[20], norms[25] = 4.0, float("nan")
    losses[2] = 50.0  # during warm-up: applied, and it enters the window
    accepted: list[tuple[float, float]] = []
    for step, (loss, norm) in enumerate(zip(losses, norms), start=1):
        factor, z = detector.step_factor(torch.tensor(loss), torch.tensor(norm), step)
        window = np.array(accepted[-10:])
        expect_skip = not np.isfinite(norm)
        if len(window) >= 8 and step > 3 and np.isfinite(norm):
            mean, std = window.mean(axis=0), window.std(axis=0, ddof=1)
            expected = (np.array([loss, norm]) - mean) / np.maximum(std, 1e-3 * np.abs(mean) + 1e-8)
            np.testing.assert_allclose(z.numpy(), expected, rtol=1e-4, atol=1e-4)
            expect_skip = bool((expected > 4.0).any())
        assert factor.item() == (0.0 if expect_skip else 1.0), step
        if not expect_skip:
            accepted.append((loss, norm))
    assert detector.skipped.item() == 2  # step 21's loss, step 26's non-finite norm; step 3 was in the warm-up
    state = detector.state_dict()
    again = SpikeDetector(cfg, torch.device("cpu"))
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.state_dict() == state


def test_a_garbage_stretch_is_skipped_rolled_back_over_and_the_run_ends_as_the_clean_one(
    tmp_path, corpora, capsys
):
    """Steps 41-43 are skipped, which starts a rollback to step 36 (the checkpoint of step 42, written during the
    stretch, is deleted); the batches of steps 41-43 are skipped from then on, the fourth garbage batch is skipped
    by the detector alone, and the run finishes within 1 % of the clean run's loss."""
    clean = tmp_path / "clean"
    assert run_train(write_config(tmp_path / "clean.yaml", _config(clean, corpora["clean"]))) == 0
    healed = tmp_path / "healed"
    assert run_train(write_config(tmp_path / "healed.yaml", _config(healed, corpora["bad"], **STABLE))) == 0

    record = json.loads((healed / "skipped_batches.json").read_text())["ranges"]
    assert [
        (r["first_step"], r["last_step"], r["rolled_back_to"], r["first_batch"], r["last_batch"]) for r in record
    ] == [(41, 43, 36, 40, 42)]
    assert record[0]["start"] == 40 * BATCH and record[0]["end"] == 43 * BATCH
    rows = _rows(healed)
    steps = [r["step"] for r in rows if "train/CrossEntropyLoss" in r]
    assert steps == list(range(1, 44)) + list(range(37, 81))  # 37-43 trained again after the rollback
    skipped = [r["optim/skipped_steps"] for r in rows if "optim/skipped_steps" in r]
    assert skipped[40:43] == [1.0, 2.0, 3.0]  # then back to the checkpoint's count, plus the 4th garbage batch
    after = [r for r in rows if "train/CrossEntropyLoss" in r][43:]
    assert [r["optim/skipped_steps"] for r in after[:6]] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert after[0]["stability/rollbacks"] == 1
    assert abs(_tail_loss(healed) / _tail_loss(clean) - 1) < 0.01, (_tail_loss(healed), _tail_loss(clean))
    # The step-42 checkpoint of the end is the one written after the rollback (its position is past the range).
    state = torch.load(healed / "step42-unsharded" / "train.pt", weights_only=False)
    assert state["global_train_examples_seen_this_epoch"] == (42 + 3) * BATCH
    # inspect_batch maps steps past the range to the batches they trained on.
    capsys.readouterr()
    for step, batch in ((40, 39), (41, 43), (80, 82)):
        shown = run_main("inspect_batch.py", healed, "--step", str(step))
        order = np.fromfile(healed / "train_data" / "global_indices.npy", dtype=np.uint32)
        assert [r.index for r in shown] == order[batch * BATCH : (batch + 1) * BATCH].tolist()


def test_spike_skipping_and_a_rollback_resume_exactly(tmp_path, corpora):
    """Stopped at step 30 and resumed, the run with skipping and its rollback logs exactly what the uninterrupted
    one does (the detector's window is in the checkpoint)."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_train(write_config(tmp_path / "w.yaml", _config(whole, corpora["bad"], **STABLE))) == 0
    config = write_config(tmp_path / "p.yaml", _config(parts, corpora["bad"], **STABLE))
    assert run_train(config, "--stop_at=30") == 0
    assert run_train(config, "--try_load_latest_save") == 0

    def losses(run):
        return [
            (r["step"], r["train/CrossEntropyLoss"], r["optim/skipped_steps"])
            for r in _rows(run)
            if "train/CrossEntropyLoss" in r
        ]

    resumed = losses(parts)
    assert resumed[:30] == losses(whole)[:30] and resumed[-50:] == losses(whole)[-50:]
    assert (parts / "skipped_batches.json").read_text() == (whole / "skipped_batches.json").read_text()


def test_rollbacks_stop_at_max_rollbacks_with_a_summary(tmp_path, corpora):
    config = write_config(
        tmp_path / "c.yaml",
        _config(tmp_path / "run", corpora["bad"], **STABLE, **{"stability.rollback.max_rollbacks": 0}),
    )
    with pytest.raises(
        OLMoTrainingError, match=r"3 steps skipped within 20 steps \(41, 42, 43\).*max_rollbacks=0"
    ):
        run_train(config)


def test_a_non_finite_loss_rolls_back_instead_of_stopping(tmp_path, corpora, monkeypatch):
    """Without spike skipping, a non-finite loss at step 20 (the loss kernel returns NaN once) rolls back to step
    18 and skips that one batch; the run finishes."""
    from olmo.model import layers

    original, calls = layers.cross_entropy_sums, {"n": 0}

    def poisoned(logits, labels, z):
        calls["n"] += 1
        loss = original(logits, labels, z)
        return loss._replace(ce=loss.ce * float("nan")) if calls["n"] in (39, 40) else loss  # step 20

    monkeypatch.setattr(layers, "cross_entropy_sums", poisoned)
    run = tmp_path / "run"
    overrides = {"stability.rollback.enabled": True, "max_duration": 30, "metrics_collect_interval": 1}
    assert run_train(write_config(tmp_path / "c.yaml", _config(run, corpora["clean"], **overrides))) == 0
    (rng,) = json.loads((run / "skipped_batches.json").read_text())["ranges"]
    assert (rng["first_step"], rng["last_step"], rng["rolled_back_to"]) == (20, 20, 18)
    assert "non-finite" in rng["reason"]
    steps = [r["step"] for r in _rows(run) if "train/CrossEntropyLoss" in r]
    assert steps == list(range(1, 20)) + list(range(19, 31))


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"stability.skip_spikes.window": 2}, r"stability\.skip_spikes\.window=2 must be from 8"),
        ({"stability.skip_spikes.z_threshold": -1.0}, r"z_threshold=-1\.0 must be a positive number"),
        (
            {"stability.rollback.enabled": True, "stability.rollback.on_non_finite": False},
            r"nothing can start one",
        ),
        (
            {"stability.rollback.enabled": True, "save_interval_unsharded": None},
            r"needs checkpoints to roll back to",
        ),
        ({"stability.rollback.within_steps": 2}, r"within_steps=2 must be at least skipped_steps=3"),
        ({"stability.watchdog.optimizer": 0}, r"stability\.watchdog\.optimizer=0.* positive number of seconds"),
        ({"stability.stragglers.threshold": 0.5}, r"threshold=0\.5 must be a number above 1"),
    ],
)
def test_stability_settings_that_cannot_work_are_refused(tmp_path, overrides, pattern):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"], **overrides))
    with pytest.raises(OLMoConfigurationError, match=pattern):
        cfg.validate(1)


def test_two_fsdp_ranks_skip_and_roll_back_as_one_process(tmp_path, corpora):
    """Every rank decides the same from the same reduced loss and gradient norm: 2 gloo ranks (FSDP, sharded
    parameters in the fused AdamW) skip the same steps and roll back to the same checkpoint as 1 process."""
    from olmo.testing import run_torchrun

    runs = {}
    for ranks in (1, 2):
        run = tmp_path / f"ranks{ranks}"
        config = write_config(tmp_path / f"{ranks}.yaml", _config(run, corpora["bad"], max_duration=50, **STABLE))
        if ranks == 1:
            assert run_train(config) == 0
        else:
            result = run_torchrun(2, config, timeout=300)
            assert result.returncode == 0, result.stderr[-3000:]
        runs[ranks] = run
    one, two = (_rows(runs[r]) for r in (1, 2))
    key = lambda rows: [(r["step"], r["optim/skipped_steps"]) for r in rows if "train/CrossEntropyLoss" in r]  # noqa: E731
    assert key(one) == key(two)
    for a, b in zip(one, two):
        if "train/CrossEntropyLoss" in a:
            assert b["train/CrossEntropyLoss"] == pytest.approx(a["train/CrossEntropyLoss"], rel=1e-4)
    ranges = [json.loads((runs[r] / "skipped_batches.json").read_text()) for r in (1, 2)]
    assert ranges[0] == ranges[1] and len(ranges[0]["ranges"]) == 1
