"""Samples during training (``type: generate``): logged to metrics.jsonl at every evaluation, equal to what
scripts/generate.py writes from the checkpoint of that step, the same under 2 gloo ranks (FSDP) as the checkpoint
says, and without any effect on the training run (bitwise, with dropout drawing from the same RNG)."""

import json
from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from olmo.exceptions import OLMoConfigurationError
from olmo.testing import (
    run_main,
    run_torchrun,
    run_train,
    tiny_config_dict,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)
from olmo.util.json_lines import read_metrics_jsonl

PROMPTS = ["def main(", "import os"]


def _config(root: Path, name: str, evaluators: list, **overrides) -> Path:
    cfg = tiny_config_dict(
        root / name,
        [str(root / "train.npy")],
        **{
            "tokenizer.identifier": str(root / "tokenizer.json"),
            "model.residual_dropout": 0.1,  # the training run draws from the RNG: samples must not move it
            "max_duration": 4,
            "eval_interval": 2,
            "save_interval_unsharded": 2,
            "evaluators": evaluators,
            **overrides,
        },
    )
    return write_config(root / f"{name}.yaml", cfg)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("samples")
    write_byte_memmap(root / "train.npy", 20_000)
    write_byte_tokenizer(root / "tokenizer.json")
    return root


def _samples(folder: Path) -> dict[int, list]:
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/samples/samples"] for r in lines if "eval/samples/samples" in r}


def _generate_py(checkpoint: Path, prompt: str, capsys, *flags: str) -> str:
    capsys.readouterr()
    assert run_main("generate.py", checkpoint, f"--prompt={prompt}", "--max_new_tokens=8", "--json", *flags) == 0
    return json.loads(capsys.readouterr().out)["text"]


def test_samples_are_logged_at_each_evaluation_and_leave_the_training_run_unchanged(root, capsys):
    greedy = [{"label": "samples", "type": "generate", "prompts": PROMPTS, "max_new_tokens": 8}]
    sampled = [{**greedy[0], "prompts": PROMPTS[:1], "temperature": 0.9, "top_k": 20}]
    assert run_train(_config(root, "plain", [])) == 0
    assert run_train(_config(root, "greedy", greedy)) == 0
    assert run_train(_config(root, "sampled", sampled)) == 0
    losses = {
        name: [
            m["train/CrossEntropyLoss"]
            for _, m in sorted(read_metrics_jsonl(root / name / "metrics.jsonl").items())
            if "train/CrossEntropyLoss" in m
        ]
        for name in ("plain", "greedy", "sampled")
    }
    assert losses["plain"] == losses["greedy"] == losses["sampled"] and len(losses["plain"]) == 4  # bitwise

    samples = _samples(root / "greedy")
    assert sorted(samples) == [2, 4]
    metrics = read_metrics_jsonl(root / "greedy" / "metrics.jsonl")
    assert metrics[4]["eval/samples/new_tokens"] > 0 and metrics[4]["eval/samples/tokens_per_second"] > 0
    for step in (2, 4):
        assert [s["prompt"] for s in samples[step]] == PROMPTS
        for sample in samples[step]:  # what generate.py writes from the checkpoint of that step
            checkpoint = root / "greedy" / f"step{step}-unsharded"
            assert sample["completion"] == _generate_py(checkpoint, sample["prompt"], capsys)

    drawn = _samples(root / "sampled")
    checkpoint = root / "sampled" / "step4-unsharded"
    # The evaluator seeds the draw with the run's seed, every time: generate.py with that seed draws the same.
    flags = ("--temperature=0.9", "--top_k=20", "--seed=1234")
    assert drawn[4][0]["completion"] == _generate_py(checkpoint, PROMPTS[0], capsys, *flags)


def test_two_fsdp_ranks_generate_together_what_the_checkpoint_generates(root, capsys):
    evaluators = [{"label": "samples", "type": "generate", "prompts": PROMPTS, "max_new_tokens": 8}]
    config = _config(root, "fsdp", evaluators, max_duration=2, eval_interval=2)
    result = run_torchrun(2, config, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    samples = _samples(root / "fsdp")
    assert list(samples) == [2]  # rank 0 alone writes metrics.jsonl
    for sample in samples[2]:
        assert sample["completion"] == _generate_py(root / "fsdp" / "step2-unsharded", sample["prompt"], capsys)
    assert "samples/samples: 'def main(' ->" in result.stderr  # and the console shows them


def test_compiled_blocks_generate_eagerly_what_the_checkpoint_generates(root, capsys):
    """With compiled blocks the samples are generated eagerly (no recompilation per new token): the same tokens
    as generate.py from the checkpoint of that step."""
    evaluators = [{"label": "samples", "type": "generate", "prompts": PROMPTS, "max_new_tokens": 8}]
    config = _config(root, "compiled", evaluators, max_duration=2, eval_interval=2, compile={"fullgraph": True})
    graphs = counters["stats"]["unique_graphs"]
    assert run_train(config) == 0
    assert counters["stats"]["unique_graphs"] - graphs <= 1  # the training step's block graph, nothing for samples
    for sample in _samples(root / "compiled")[2]:
        assert sample["completion"] == _generate_py(
            root / "compiled" / "step2-unsharded", sample["prompt"], capsys
        )


@pytest.mark.parametrize(
    "evaluator, message",
    [
        ({"type": "generate"}, r"evaluators\[0\] \(label 's'\) is a generate evaluator without prompts"),
        (
            {"type": "generate", "prompts": ["x"], "max_new_tokens": 0},
            r"evaluators\[0\]\.max_new_tokens=0 must be",
        ),
        ({"type": "generate", "prompts": ["x"], "top_p": 0.9}, r"top_k and top_p sample; set evaluators\[0\]\."),
        ({"type": "generate", "prompts": ["x"], "temperature": -1}, r"evaluators\[0\]\.temperature=-1.0 must be"),
    ],
)
def test_bad_generate_evaluators_are_refused_before_training(root, evaluator, message):
    config = _config(root, "bad", [{"label": "s", **evaluator}])
    with pytest.raises(OLMoConfigurationError, match=message):
        run_train(config)
    assert not (root / "bad" / "metrics.jsonl").exists()
