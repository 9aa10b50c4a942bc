"""A run's numbers depend on its config, data and seed only: never on when it checkpoints (step 0 included),
evaluates, samples or logs. Dropout is on in every run here, so anything between steps that drew from the RNG would
show; so would an optimizer state touched by a save (torch's state-dict functions initialise an optimizer without
state by stepping it once).

Each comparison is bitwise on the CPU: losses, the final weights and the final optimizer state."""

from pathlib import Path

import pytest
import torch

from olmo.testing import (
    run_train,
    tiny_config_dict,
    write_byte_corpus,
    write_byte_memmap,
    write_byte_tokenizer,
    write_config,
)
from olmo.testing.train_each import run_torchrun_each
from olmo.util.json_lines import read_metrics_jsonl

STEPS = 6


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("invariance")
    write_byte_corpus(root / "corpus")
    write_byte_memmap(root / "val.npy", 32 * 6)
    write_byte_tokenizer(root / "tokenizer.json")
    return root


def _evaluators(root: Path) -> list:
    return [
        {"label": "ppl", "data": {"datasets": {"val": [str(root / "val.npy")]}}},
        {
            "label": "s",
            "type": "generate",
            "prompts": ["def "],
            "max_new_tokens": 4,
            "temperature": 1.0,
            "top_k": 8,
        },
    ]


# Every kind of work between steps: checkpoints of each kind (the step-0 one first), evaluations with a sampling
# generate evaluator, metrics read back and printed at other intervals.
BUSY = {
    "no_pre_train_checkpoint": False,
    "save_interval_unsharded": 1,
    "save_interval": 2,
    "save_interval_ephemeral": 3,
    "eval_interval": 2,
    "metrics_collect_interval": 3,
    "console_log_interval": 1,
}
QUIET = {"save_interval_unsharded": None}


def _config(root: Path, name: str, optimizer: str, schedule: dict, **extra) -> Path:
    overrides = {
        "tokenizer.identifier": str(root / "tokenizer.json"),
        "model.residual_dropout": 0.1,
        "model.attention_dropout": 0.1,
        "optimizer.name": optimizer,
        "max_duration": STEPS,
        **schedule,
        **extra,
    }
    if "eval_interval" in schedule:
        overrides["evaluators"] = _evaluators(root)
    corpus = [str(root / "corpus/a.npy"), str(root / "corpus/b.npy")]
    return write_config(root / f"{name}.yaml", tiny_config_dict(root / name, corpus, **overrides))


def _losses(folder: Path) -> list[float]:
    metrics = read_metrics_jsonl(folder / "metrics.jsonl")
    return [metrics[step]["train/CrossEntropyLoss"] for step in range(1, STEPS + 1)]


def _final(folder: Path, name: str) -> dict:
    return torch.load(folder / f"step{STEPS}-unsharded" / name, weights_only=True)


def _assert_equal_state(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("optimizer", ["adamw", "lionw", "muon"])
def test_checkpoints_evaluations_and_logging_do_not_change_a_run(root, optimizer):
    quiet, busy = root / f"{optimizer}-quiet", root / f"{optimizer}-busy"
    assert run_train(_config(root, quiet.name, optimizer, QUIET)) == 0
    assert run_train(_config(root, busy.name, optimizer, BUSY)) == 0
    assert (busy / "step0-unsharded").is_dir() and (busy / "step2").is_dir()  # the schedule did run
    assert _losses(busy) == _losses(quiet)
    _assert_equal_state(_final(busy, "model.pt"), _final(quiet, "model.pt"), "model")
    _assert_equal_state(_final(busy, "optim.pt"), _final(quiet, "optim.pt"), "optim")

    # The step-0 checkpoint holds the optimizer as a first step finds it: a run started from it is the same run.
    branch = root / f"{optimizer}-from-step0"
    config = _config(root, branch.name, optimizer, QUIET)
    assert run_train(config, f"--load_path={busy / 'step0-unsharded'}") == 0
    assert _losses(branch) == _losses(quiet)
    _assert_equal_state(_final(branch, "model.pt"), _final(quiet, "model.pt"), "model")


@pytest.mark.slow
def test_checkpoint_schedule_does_not_change_an_fsdp_run(root):
    """Two gloo ranks with FSDP: a sharded step-0 checkpoint, sharded and unsharded checkpoints every step and
    evaluations leave the losses and the final weights bitwise as a run without them."""
    runs = {}
    # The quiet run saves only its final (unsharded) checkpoint, to compare the weights.
    quiet = {"save_interval_unsharded": STEPS}
    configs = []
    for name, schedule in (("fsdp-quiet", quiet), ("fsdp-busy", {**BUSY, "save_interval": 1})):
        configs.append([_config(root, name, "adamw", schedule, **{"distributed_strategy": "fsdp"})])
        runs[name] = root / name
    result = run_torchrun_each(2, configs)  # one launch, the runs in turn
    assert result.returncode == 0, result.stderr[-3000:]
    assert (runs["fsdp-busy"] / "step0").is_dir()
    assert _losses(runs["fsdp-busy"]) == _losses(runs["fsdp-quiet"])
    _assert_equal_state(_final(runs["fsdp-busy"], "model.pt"), _final(runs["fsdp-quiet"], "model.pt"), "model")
    _assert_equal_state(_final(runs["fsdp-busy"], "optim.pt"), _final(runs["fsdp-quiet"], "optim.pt"), "optim")
