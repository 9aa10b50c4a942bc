"""DPO (issue 40, points 2-4): ``dpo.enabled`` trains prepared preference pairs against a frozen reference.

Checked against TRL's ``DPOTrainer`` (its own computation of log-probabilities, losses and rewards, on our models
exported to transformers), on the pairs and weights of a real first step; pairs never split by the data order or
the ranks; 2 FSDP ranks equal 1 process; a resume (also from ``--load_path`` naming the run's own checkpoint) keeps
the reference and continues bitwise; bad input refused before training.
"""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from olmo.config import TrainConfig
from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError, OLMoDataError
from olmo.testing import (
    BYTE_EOS,
    assert_same_weights,
    metric_by_step,
    run_main,
    run_train,
    tiny_config_dict,
    write_byte_corpus,
    write_byte_tokenizer,
    write_config,
)
from olmo.testing.train_each import run_torchrun_each

SEQ = 48  # the fixture's sequence length too
METRICS = ("loss", "rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin")


def _pairs(n: int, seed: int) -> list[dict]:
    """Sums asked for, answered right (chosen) and wrong (rejected)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 49), rng.randint(1, 49)
        question = [{"role": "user", "content": f"{a}+{b}?"}]
        out.append(
            {
                "chosen": question + [{"role": "assistant", "content": f"{a + b}."}],
                "rejected": question
                + [{"role": "assistant", "content": f"{a + b + rng.randint(1, 9)}, I think!"}],
            }
        )
    return out


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A byte-level tokenizer, 64 prepared pairs, and a model trained 10 steps (checkpoints at 5 and 10)."""
    root = tmp_path_factory.mktemp("dpo")
    tokenizer = write_byte_tokenizer(root / "tokenizer.json")
    source = root / "pairs.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in _pairs(64, 0)))
    args = ["-o", root / "pref", "--seq-len", SEQ, "-t", tokenizer, "--eos", BYTE_EOS, "--pad", BYTE_EOS]
    assert run_main("prepare_preference_data.py", source, *args) == 0
    # layer_norm_with_affine false: the OLMo-1 shape transformers' OlmoForCausalLM holds exactly
    cfg = tiny_config_dict(root / "sft", write_byte_corpus(root), **{"model.layer_norm_with_affine": False})
    assert run_train(write_config(root / "sft.yaml", cfg)) == 0
    return root


def _dpo_config(root: Path, name: str, **overrides) -> Path:
    cfg = tiny_config_dict(
        root / name,
        [str(root / "pref/input_ids.npy")],
        **{
            "model.layer_norm_with_affine": False,
            "data.label_mask_paths": [str(root / "pref/label_mask.npy")],
            "dpo.enabled": True,
            "dpo.beta": 0.5,
            "load_path": str(root / "sft/step10-unsharded"),
            "reset_trainer_state": True,
            "optimizer.learning_rate": 1e-3,
            "console_log_interval": 1,
            "max_duration": 6,
            "model.max_sequence_length": SEQ,
            "save_interval_unsharded": 3,
            **overrides,
        },
    )
    return write_config(root / f"{name}.yaml", cfg)


TRL_FIXTURE = Path(__file__).parent.parent / "fixtures" / "trl_dpo"


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "norm"])
def test_first_step_equals_trl(tmp_path, loss):
    """TRL 1.16.0's DPOTrainer computed, in its own virtualenv (tests/fixtures/trl_dpo/make_fixture.sh), the losses,
    rewards and log-probabilities of four pairs for a policy and a reference exported to transformers; our first
    step on the same pairs (one global batch), from the same models converted back, logs the same numbers."""
    from olmo.cli.convert_from_hf import convert_from_hf

    record = json.loads((TRL_FIXTURE / "trl_values.json").read_text())
    theirs = record["losses"][loss]
    for name in ("policy", "reference"):
        convert_from_hf(str(TRL_FIXTURE / f"hf-{name}"), str(tmp_path / name))
    root = tmp_path / "data"
    root.mkdir()
    for name in ("input_ids.npy", "label_mask.npy"):
        (root / name).write_bytes((TRL_FIXTURE / "pref" / name).read_bytes())
    cfg = tiny_config_dict(
        tmp_path / "run",
        [str(root / "input_ids.npy")],
        **{
            "model.layer_norm_with_affine": False,
            "model.max_sequence_length": SEQ,
            "data.label_mask_paths": [str(root / "label_mask.npy")],
            "dpo.enabled": True,
            "dpo.beta": record["beta"],
            "dpo.loss": loss,
            "dpo.reference_path": str(tmp_path / "reference"),
            "load_path": str(tmp_path / "policy"),
            "reset_trainer_state": True,
            "max_duration": 1,
            "global_train_batch_size": 2 * record["pairs"],  # every pair in the one batch, as TRL saw them
            "device_train_microbatch_size": 4,
            "save_interval_unsharded": None,
            "scheduler.t_warmup": 1,
        },
    )
    assert run_train(write_config(tmp_path / "dpo.yaml", cfg)) == 0
    for name in METRICS:
        ours = metric_by_step(tmp_path / "run", f"train/dpo/{name}")[1]
        assert ours == pytest.approx(theirs[name], rel=1e-5, abs=1e-6), name
    # The log-probabilities themselves: our cross entropy is minus their sum over every label of the batch.
    pairs, labels = record["pairs"], record["labels"]
    their_ce = -(theirs["logps_chosen"] + theirs["logps_rejected"]) * pairs / labels
    assert metric_by_step(tmp_path / "run")[1] == pytest.approx(their_ce, rel=1e-5)
    assert abs(theirs["reward_margin"]) > 1e-3  # policy and reference differ: not the trivial first step


def test_pairs_stay_whole_and_the_reference_survives_a_resume(sft):
    assert run_train(_dpo_config(sft, "whole")) == 0
    losses = metric_by_step(sft / "whole", "train/dpo/loss")
    assert losses[1] == pytest.approx(np.log(2), abs=1e-6)  # policy = reference at the first step
    assert losses[6] < losses[1]
    assert metric_by_step(sft / "whole", "train/dpo/reward_accuracy")[6] > 0.5
    order = np.fromfile(sft / "whole/train_data/global_indices.npy", dtype=np.uint32)
    assert sorted(order.tolist()) == list(range(128))
    assert all(order[1::2] == order[0::2] + 1) and all(order[0::2] % 2 == 0)
    # inspect_batch.py names each row's pair, side and input line (the conversations file beside the tokens).
    rows = run_main("inspect_batch.py", sft / "whole", "--step", 2, "--json")
    assert [r.pair for r in rows] == [
        f"pair {i // 2} {'rejected' if i % 2 else 'chosen'}" for i in order[8:16].tolist()
    ]
    for r in rows:
        side = "rejected" if r.index % 2 else "chosen"
        assert [d["id"] for d in r.documents] == [f"pairs.jsonl:{r.index // 2 + 1} {side}"]  # none dropped
    saved = TrainConfig.load_saved(sft / "whole/step3-unsharded/config.yaml")
    assert saved.dpo.reference_path == str(sft / "sft/step10-unsharded")

    # Resuming from the run's own checkpoint with --load_path (not the SFT model) keeps the recorded reference.
    resumed = _dpo_config(sft, "whole", load_path=str(sft / "whole/step3-unsharded"), reset_trainer_state=False)
    assert run_train(resumed, f"--save_folder={sft / 'whole-resumed'}") == 0
    again = metric_by_step(sft / "whole-resumed", "train/dpo/loss")
    assert [again[s] for s in (4, 5, 6)] == [losses[s] for s in (4, 5, 6)]  # bitwise
    assert_same_weights(sft / "whole/step6-unsharded/model.pt", sft / "whole-resumed/step6-unsharded/model.pt", 0)

    # A different reference for the same run is refused before anything is written.
    with pytest.raises(OLMoConfigurationError, match="trained against the reference"):
        run_train(
            resumed, f"--save_folder={sft / 'whole-other'}", f"--dpo.reference_path={sft}/sft/step5-unsharded"
        )
    assert not (sft / "whole-other").exists()


def _assert_same_run(first: Path, second: Path, steps: int) -> None:
    """Two DPO runs logged the same metrics at steps 1..steps and ended with the same weights."""
    for m in METRICS:
        a, b = metric_by_step(first, f"train/dpo/{m}"), metric_by_step(second, f"train/dpo/{m}")
        assert a.keys() == b.keys() == set(range(1, steps + 1))
        for step in a:
            # rewards are differences of log-probabilities of ~20 nats (fp32: ~2e-6 each), hence the absolute bound
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=2e-5), (m, step)
    assert_same_weights(first / f"step{steps}-unsharded/model.pt", second / f"step{steps}-unsharded/model.pt")


PRECOMPUTED = {"dpo.precompute_reference": True, "max_duration": 2}


@pytest.fixture(scope="module")
def two_ranks(sft):
    """The 2-rank runs of this module, in one torchrun launch (each launch costs seconds of start-up): "two" (4
    steps) and "pre2" (the reference precomputed, 2 steps)."""
    runs = [[_dpo_config(sft, "two", max_duration=4)], [_dpo_config(sft, "pre2", **PRECOMPUTED)]]
    result = run_torchrun_each(2, runs, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return sft


@pytest.mark.slow
def test_two_fsdp_ranks_train_whole_pairs_as_one_process(sft, two_ranks):
    assert run_train(_dpo_config(sft, "one", max_duration=4)) == 0
    _assert_same_run(sft / "one", sft / "two", steps=4)
    # Each rank trained whole pairs: both halves of every pair in one rank's line.
    from olmo.data import read_data_indices

    for step, ranks in read_data_indices(sft / "two").items():
        for indices in ranks.values():
            assert indices[1::2] == [i + 1 for i in indices[0::2]], (step, indices)


def test_bad_dpo_input_is_refused_before_training(sft, tmp_path):
    with pytest.raises(OLMoConfigurationError, match="must all be even"):
        run_train(_dpo_config(sft, "odd", global_train_batch_size=6, device_train_microbatch_size=3))
    with pytest.raises(OLMoConfigurationError, match="needs a reference model"):
        run_train(_dpo_config(sft, "noref", load_path=None, reset_trainer_state=False))
    with pytest.raises(OLMoConfigurationError, match="cannot be combined with model.moe"):
        run_train(_dpo_config(sft, "moe", **{"model.moe": {"num_experts": 2, "top_k": 1}}))
    # A reference of another shape names the key.
    other = tiny_config_dict(tmp_path / "wide", write_byte_corpus(tmp_path), **{"model.d_model": 64})
    assert (
        run_train(write_config(tmp_path / "wide.yaml", {**other, "max_duration": 1, "save_interval_unsharded": 1}))
        == 0
    )
    with pytest.raises(OLMoCheckpointError, match="dpo.reference_path"):
        run_train(_dpo_config(sft, "shape", **{"dpo.reference_path": str(tmp_path / "wide/step1-unsharded")}))
    # Data that are not pairs: an odd number of instances.
    ids = np.fromfile(sft / "pref/input_ids.npy", dtype=np.uint16)[: 9 * SEQ]
    ids.tofile(tmp_path / "odd.npy")
    np.fromfile(sft / "pref/label_mask.npy", dtype=np.bool_)[: 9 * SEQ].tofile(tmp_path / "odd_mask.npy")
    overrides = {
        "data.paths": [str(tmp_path / "odd.npy")],
        "data.label_mask_paths": [str(tmp_path / "odd_mask.npy")],
    }
    with pytest.raises(OLMoDataError, match="trains pairs"):
        run_train(_dpo_config(sft, "oddpairs", **overrides))
    for name in ("odd", "noref", "moe", "shape", "oddpairs"):
        assert not (sft / name).exists(), name


def test_dry_run_counts_pairs_and_the_reference(sft, capsys):
    from olmo.distributed.run_shape import RunShape
    from olmo.ladder.estimates import estimate_memory, model_facts, resolve_device
    from olmo.ladder.run_planner import plan_run

    assert run_train(_dpo_config(sft, "dry"), "--dry_run") == 0
    out = capsys.readouterr().out
    assert "4 pairs per step, 64 pairs in the data (128 instances), 24 pairs trained" in out, out
    assert not (sft / "dry").exists()
    cfg = TrainConfig.load(_dpo_config(sft, "dry"))
    plain = TrainConfig.load(_dpo_config(sft, "dry", **{"dpo.enabled": False}))
    dpo, sft_plan = plan_run(cfg, 1, 128), plan_run(plain, 1, 128)
    # The reference's fp32 weights beside the policy's, and its forward pass (2N FLOPs per token beside the training step's 6N).
    cpu = resolve_device("cpu")
    runs = [RunShape.from_train_config(c) for c in (cfg, plain)]
    with_reference, without = (estimate_memory(run, model_facts(run), 1, cpu, 4) for run in runs)
    assert with_reference.reference == with_reference.params > 0 and without.reference == 0
    assert with_reference.total > without.total
    assert dpo.train_flops == pytest.approx(sft_plan.train_flops * 4 / 3)  # 6N per token, plus 2N


def test_precomputed_reference_trains_as_the_reference_on_the_fly(sft):
    overrides = {"dpo.precompute_reference": True, "max_duration": 4}
    assert run_train(_dpo_config(sft, "fly", max_duration=4)) == 0  # max_duration 4: save_interval_unsharded 3
    assert run_train(_dpo_config(sft, "pre", **overrides)) == 0
    _assert_same_run(sft / "fly", sft / "pre", steps=4)
    stored = sft / "pre/train_data/dpo_reference_logps.npy"
    values = np.fromfile(stored, dtype=np.float32)
    assert values.shape == (128,) and (values < 0).all()
    record = json.loads(stored.with_name(stored.name + ".json").read_text())
    assert record["reference"] == str(sft / "sft/step10-unsharded") and record["instances"] == 128

    # A resume reuses the file (its record matches); another reference in the same folder recomputes it.
    stamp = stored.stat().st_mtime_ns
    assert run_train(_dpo_config(sft, "pre", **{**overrides, "max_duration": 5}), "--try_load_latest_save") == 0
    assert stored.stat().st_mtime_ns == stamp
    damaged = bytearray(stored.read_bytes())
    damaged[5] ^= 0x40  # a flipped bit: the checksum no longer matches, so the values are computed again
    stored.write_bytes(bytes(damaged))
    assert run_train(_dpo_config(sft, "pre", **{**overrides, "max_duration": 6}), "--try_load_latest_save") == 0
    assert np.array_equal(np.fromfile(stored, dtype=np.float32), values)
    other = {**overrides, "dpo.reference_path": str(sft / "sft/step5-unsharded")}
    assert run_train(_dpo_config(sft, "pre", **other), "--save_overwrite") == 0
    assert not np.array_equal(np.fromfile(stored, dtype=np.float32), values)


@pytest.mark.slow
def test_precomputed_reference_on_two_ranks_equals_one_process(sft, two_ranks):
    assert run_train(_dpo_config(sft, "pre1", **PRECOMPUTED)) == 0
    one = np.fromfile(sft / "pre1/train_data/dpo_reference_logps.npy", dtype=np.float32)
    two = np.fromfile(sft / "pre2/train_data/dpo_reference_logps.npy", dtype=np.float32)
    np.testing.assert_allclose(two, one, rtol=1e-5)
    losses = metric_by_step(sft / "pre2", "train/dpo/loss")
    assert losses == pytest.approx(metric_by_step(sft / "pre1", "train/dpo/loss"), rel=1e-5)


def test_eval_preferences_scores_pairs_as_trl_does(tmp_path, capsys):
    """scripts/eval_preferences.py on the TRL fixture's pairs and models gives TRL's rewards, accuracy and margin."""
    from olmo.cli.convert_from_hf import convert_from_hf
    from olmo.exceptions import OLMoCliError

    record = json.loads((TRL_FIXTURE / "trl_values.json").read_text())
    theirs = record["losses"]["sigmoid"]
    for name in ("policy", "reference"):
        convert_from_hf(str(TRL_FIXTURE / f"hf-{name}"), str(tmp_path / name))
    args = [tmp_path / "policy", tmp_path / "reference", TRL_FIXTURE / "pref", "--beta", record["beta"], "--json"]
    assert run_main("eval_preferences.py", *args, "--batch-size", 2) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pairs"] == record["pairs"]
    for name in ("reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected"):
        assert report[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-6), name
    # A folder that is not pairs of the models' length is refused, naming the flag to fix.
    (tmp_path / "bad").mkdir()
    with pytest.raises(OLMoCliError, match="lacks"):
        run_main("eval_preferences.py", tmp_path / "policy", tmp_path / "reference", tmp_path / "bad")
    np.zeros(3 * SEQ, dtype=np.uint16).tofile(tmp_path / "bad/input_ids.npy")
    np.zeros(3 * SEQ, dtype=np.bool_).tofile(tmp_path / "bad/label_mask.npy")
    with pytest.raises(OLMoCliError, match="not whole pairs"):
        run_main("eval_preferences.py", tmp_path / "policy", tmp_path / "reference", tmp_path / "bad")
