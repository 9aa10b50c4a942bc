"""The RL step in the trainer (issue 53): a run over prepared prompts samples, scores and trains, logs the RL
metrics, resumes bitwise mid-run, and is refused before any work when its prompts or settings cannot work."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from olmo.exceptions import OLMoConfigurationError
from olmo.rl import Completion, register_reward, registered_rewards
from olmo.testing import BYTE_EOS, run_main, run_train, tiny_config_dict, write_byte_tokenizer, write_config

SEQ = 32
STEPS = 4


def vowel_share(completion: Completion) -> float:
    """A reward with signal even for an untrained model: the share of vowels in the completion."""
    text = completion.text
    return sum(c in "aeiou" for c in text) / max(len(text), 1)


@pytest.fixture(autouse=True)
def vowels():
    register_reward("vowels", vowel_share)
    yield
    registered_rewards().pop("vowels", None)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rl")
    tokenizer = write_byte_tokenizer(root / "tokenizer.json")
    lines = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = ["-t", tokenizer, "--eos", BYTE_EOS, "--pad", BYTE_EOS, "--max-prompt-tokens", 8]
    assert (
        run_main("prepare_rl_prompts.py", root / "prompts.jsonl", "-o", root / "prompts", "--seq-len", SEQ, *flags)
        == 0
    )
    return root / "prompts", tokenizer


def _config(tmp_path: Path, prompts: tuple[Path, Path], name: str = "run", **overrides) -> Path:
    folder, tokenizer = prompts
    cfg = tiny_config_dict(
        tmp_path / name,
        ["unused.npy"],
        **{
            "model.max_sequence_length": SEQ,
            "tokenizer.identifier": str(tokenizer),
            "rl.enabled": True,
            "rl.prompts": str(folder),
            "rl.group_size": 4,
            "rl.prompts_per_step": 4,
            "rl.max_new_tokens": 8,
            "rl.rewards": [{"name": "vowels", "weight": 1.0}, {"name": "exact_answer", "weight": 1.0}],
            "max_duration": STEPS,
            "save_interval_unsharded": 2 if overrides.get("max_duration", STEPS) != 3 else 3,
            "console_log_interval": 1,
            "device_train_microbatch_size": 4,
            "optimizer.learning_rate": 1e-3,
            **overrides,
        },
    )
    return write_config(tmp_path / f"{name}.yaml", cfg)


RL_METRICS = (
    "train/rl/loss",
    "train/rl/reward_mean",
    "train/rl/reward_std",
    "train/rl/rewards/vowels",
    "train/rl/rewards/exact_answer",
    "train/rl/entropy",
    "train/rl/clip_fraction",
    "train/rl/completion_length",
    "train/rl/truncated_fraction",
    "train/rl/logprob_drift",
    "throughput/rollout_seconds",
    "throughput/train_seconds",
)


def test_an_rl_run_trains_logs_its_metrics_and_resumes_bitwise(tmp_path, prompts, capsys, caplog):
    caplog.set_level("INFO")
    record: list[dict] = []
    assert run_train(_config(tmp_path, prompts), record=record) == 0
    steps = [r for r in record if "train/rl/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for metrics in steps:
        assert all(name in metrics and math.isfinite(metrics[name]) for name in RL_METRICS), sorted(metrics)
        assert metrics["train/rl/logprob_drift"] < 1e-5  # the same model code samples and trains
        assert 1 <= metrics["train/rl/completion_length"] <= 8
        assert metrics["train/rl/reward_std"] > 0  # the vowels reward varies: there is a signal
    # Stopped after step 2 and resumed: the same completions (sampling depends on the step only) and weights.
    assert run_train(_config(tmp_path, prompts, "resumed", max_duration=2)) == 0
    args = ["--max_duration=4", "--try_load_latest_save"]
    assert run_train(_config(tmp_path, prompts, "resumed"), *args) == 0
    whole = torch.load(tmp_path / f"run/step{STEPS}-unsharded/model.pt", weights_only=True)
    resumed = torch.load(tmp_path / f"resumed/step{STEPS}-unsharded/model.pt", weights_only=True)
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    # inspect_batch shows a step's prompts (the data order is over them) with their completions and rewards.
    rows = json.loads(_inspect(tmp_path / "run", 3, capsys))
    assert len(rows) == 4 and all(len(r["completions"]) == 4 for r in rows)
    logged = [r for r in steps if r["step"] == 3][0]
    rewards = [c["reward"] for r in rows for c in r["completions"]]
    assert sum(rewards) / len(rewards) == pytest.approx(logged["train/rl/reward_mean"], abs=1e-6)
    for r in rows:
        for c in r["completions"]:
            assert c["reward"] == pytest.approx(c["rewards"]["vowels"] + c["rewards"]["exact_answer"])
            assert 1 <= c["tokens"] <= 8 and isinstance(c["text"], str)
    assert "reward=" in caplog.text  # the console line shows the step's mean reward
    run_main("inspect_batch.py", tmp_path / "run", "--step", 3)
    table = capsys.readouterr().out
    assert "Completions and rewards" in table and rows[0]["completions"][0]["text"][:5] in table


def _inspect(run: Path, step: int, capsys) -> str:
    capsys.readouterr()
    run_main("inspect_batch.py", run, "--step", step, "--json")
    return capsys.readouterr().out


def test_prompts_that_do_not_fit_are_refused_before_any_work(tmp_path, prompts):
    with pytest.raises(
        OLMoConfigurationError, match=r"rl.max_new_tokens=30 do not fit model.max_sequence_length=32"
    ):
        run_train(_config(tmp_path, prompts, **{"rl.max_new_tokens": 30}))
    with pytest.raises(
        OLMoConfigurationError, match="holds instances of 32 tokens .* model.max_sequence_length=64"
    ):
        run_train(_config(tmp_path, prompts, **{"model.max_sequence_length": 64}))
    with pytest.raises(OLMoConfigurationError, match=r"rl.rewards\[0\].name='nobody' is not a built-in reward"):
        run_train(_config(tmp_path, prompts, **{"rl.rewards": [{"name": "nobody"}]}))
    assert not (tmp_path / "run").exists()


def test_a_kl_penalty_to_a_reference_checkpoint_is_logged(tmp_path, prompts):
    assert run_train(_config(tmp_path, prompts, "base", max_duration=2)) == 0
    record: list[dict] = []
    overrides = {"rl.beta": 0.5, "rl.reference_path": str(tmp_path / "base/step2-unsharded"), "max_duration": 2}
    assert run_train(_config(tmp_path, prompts, **overrides), record=record) == 0
    kls = [r["train/rl/kl"] for r in record if "train/rl/kl" in r]
    assert len(kls) == 2 and all(k > 0 for k in kls)  # a model trained apart from the reference differs from it
    with pytest.raises(OLMoConfigurationError, match=r"rl.beta=0.5 pulls the policy toward a reference model"):
        run_train(_config(tmp_path, prompts, "other", **{"rl.beta": 0.5}))
    # Without rl.reference_path, the model the run starts from is the reference, recorded in config.yaml.
    start = {"rl.beta": 0.5, "max_duration": 1, "load_path": str(tmp_path / "base/step2-unsharded")}
    assert run_train(_config(tmp_path, prompts, "from_base", **start), "--reset_trainer_state") == 0
    written = (tmp_path / "from_base/config.yaml").read_text()
    assert f"reference_path: {tmp_path / 'base/step2-unsharded'}" in written


def test_several_optimizer_steps_on_each_rollout_clip_the_moved_ratio(tmp_path, prompts):
    """rl.num_iterations=2 (GRPO's mu) and rl.num_mini_batches=2 (open-instruct's): each step samples once and
    takes two optimizer steps on its completions, two passes over all of them or one over each half. The first
    optimizer step is on-policy (nothing clipped at a tight epsilon, no drift); the second sees the moved policy."""
    tight = {"rl.epsilon_low": 1e-4, "max_duration": 2}
    runs = {"one": {}, "mu2": {"rl.num_iterations": 2}, "halves": {"rl.num_mini_batches": 2}}
    rows = {}
    for name, settings in runs.items():
        record: list[dict] = []
        assert run_train(_config(tmp_path, prompts, name, **tight, **settings), record=record) == 0
        rows[name] = [r for r in record if "train/rl/loss" in r]
    assert rows["one"][0]["train/rl/reward_mean"] == rows["mu2"][0]["train/rl/reward_mean"]  # the same rollout
    assert rows["one"][0]["train/rl/reward_mean"] == rows["halves"][0]["train/rl/reward_mean"]
    assert all(r["train/rl/clip_fraction"] == 0 for r in rows["one"])
    # A second pass over the same completions finds them pushed the way their advantages asked: clipped each step.
    # The other half's prompts moved only through shared weights, the way their own advantages want or not.
    assert all(r["train/rl/clip_fraction"] > 0.02 for r in rows["mu2"])
    assert max(r["train/rl/clip_fraction"] for r in rows["halves"]) > 0.02
    assert all(r["train/rl/logprob_drift"] < 1e-5 for name in runs for r in rows[name])
    weights = {}
    for name, steps in (("one", 2), ("mu2", 4), ("halves", 4)):  # the optimizer's own count of its steps
        optim = torch.load(tmp_path / f"{name}/step2-unsharded/optim.pt", weights_only=True)
        assert {float(s["step"]) for s in optim["state"].values()} == {float(steps)}, name
        weights[name] = torch.load(tmp_path / f"{name}/step2-unsharded/model.pt", weights_only=True)
    for a, b in (("one", "mu2"), ("one", "halves"), ("mu2", "halves")):
        assert any(not torch.equal(weights[a][k], weights[b][k]) for k in weights[a]), (a, b)


def test_two_fsdp_ranks_train_as_one_process(tmp_path, prompts):
    """Each prompt's completions depend on the seed, the step and its index only, groups stay on one rank, and the
    loss is normalised over the whole step (over each half: two mini-batches): two ranks sharing the model (FSDP)
    train as one process does, with four optimizer steps on each rollout."""
    from olmo.testing import run_torchrun

    digits = {
        "rl.rewards": [{"name": "format", "weight": 1.0, "pattern": ".*[a-z0-9].*"}],
        "max_duration": 3,
        "rl.num_iterations": 2,  # inner optimizer steps on FSDP's sharded gradients too,
        "rl.num_mini_batches": 2,  # each on the same half of the step's prompts on any number of ranks
    }
    one, two = _config(tmp_path, prompts, "one", **digits), _config(tmp_path, prompts, "two", **digits)
    assert run_train(one) == 0
    result = run_torchrun(2, two)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    for name in ("one", "two"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = [json.loads(line) for line in lines if '"train/rl/loss"' in line]
    assert len(rows["one"]) == len(rows["two"]) == 3
    for a, b in zip(rows["one"], rows["two"]):
        assert b["train/rl/reward_std"] > 0 and a["train/rl/reward_mean"] == b["train/rl/reward_mean"]
        for key in ("train/CrossEntropyLoss", "train/rl/loss", "optim/total_grad_norm", "train/rl/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    whole = torch.load(tmp_path / "one/step3-unsharded/model.pt", weights_only=True)
    shared = torch.load(tmp_path / "two/step3-unsharded/model.pt", weights_only=True)
    for key in whole:
        torch.testing.assert_close(shared[key], whole[key], rtol=1e-5, atol=1e-6)


def test_eval_rl_scores_greedy_answers_as_each_prompt_alone_would(tmp_path, prompts, capsys):
    """scripts/eval_rl.py batches left-padded prompts; its exact-answer count equals scoring each prompt alone."""
    from olmo.checkpoint import load_model
    from olmo.data.rl_prompts import RLPrompts
    from olmo.rl.rewards import exact_answer
    from olmo.tokenizer import Tokenizer

    assert run_train(_config(tmp_path, prompts, "base", max_duration=2)) == 0
    checkpoint = tmp_path / "base/step2-unsharded"
    capsys.readouterr()
    run_main("eval_rl.py", checkpoint, prompts[0], "--max-new-tokens", 6, "--batch-size", 5, "--json")
    result = json.loads(capsys.readouterr().out)
    model, cfg, _ = load_model(str(checkpoint))
    tokenizer = Tokenizer.from_file(str(prompts[1]), BYTE_EOS, BYTE_EOS)
    folder = RLPrompts(prompts[0])
    correct, lengths = 0, []
    for i in range(len(folder)):
        out = model.generate(torch.from_numpy(folder.prompt(i)).unsqueeze(0), max_steps=6).token_ids[0, 0].tolist()
        kept = out[: out.index(BYTE_EOS)] if BYTE_EOS in out else out
        lengths.append(len(kept) + (len(kept) < len(out)))
        completion = Completion(
            "", tokenizer.decode(kept), folder.ground_truths[i], len(kept), len(kept) == len(out)
        )
        correct += int(exact_answer(completion) == 1.0)
    assert (result["prompts"], result["correct"]) == (16, correct)
    assert result["accuracy"] == correct / 16 and result["mean_completion_tokens"] == pytest.approx(
        sum(lengths) / 16
    )


def test_the_dry_run_plans_an_rl_step(tmp_path, prompts, capsys):
    capsys.readouterr()
    assert run_train(_config(tmp_path, prompts), "--dry_run") == 0
    plan = capsys.readouterr().out
    assert "RL (dapo): 4 prompts per step x 4 completions of up to 8 new tokens (16), one optimizer step" in plan
    assert "batch: 4 instances" in plan and not (tmp_path / "run").exists()


def test_save_overwrite_never_deletes_the_prompts_inside_the_save_folder(tmp_path, prompts):
    """The prompts are an input of the run (olmo.config.input_paths): a launch replacing the run refuses to delete
    a folder that holds them."""
    import shutil

    inside = tmp_path / "run" / "train_data" / "my_prompts"  # in a folder --save_overwrite replaces
    shutil.copytree(prompts[0], inside)
    config = _config(tmp_path, (inside, prompts[1]), max_duration=1)
    assert run_train(config) == 0
    with pytest.raises(Exception, match="rl.prompts") as e:
        run_train(config, "--save_overwrite")
    assert "--save_overwrite" in str(e.value) and (inside / "prompt_ids.npy").exists()
