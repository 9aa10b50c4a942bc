"""TrainModule: a custom module written here runs through the real trainer (scripts/train.py), checkpoints,
resumes bitwise, and trains under 2 gloo ranks; a bad module name is a clear configuration error."""

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.config import TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.testing import run_torchrun, run_train, tiny_config_dict, write_byte_memmap, write_config
from olmo.train.build_module import build_train_module, resolve_train_module_class
from olmo.train.train_module import (
    BasicTrainModule,
    EvalBatchSpec,
    ReduceType,
    TrainModule,
    TransformerTrainModule,
)

TESTS = Path(__file__).resolve().parent
README = TESTS.parents[1] / "README.md"


class LabelCountingTrainModule(BasicTrainModule):
    """BasicTrainModule plus one metric of its own: the labels this rank trained on, summed over ranks."""

    def train_batch(self, batch, dry_run=False):
        super().train_batch(batch, dry_run)
        labels = batch["input_ids"][:, 1:].numel()
        self.record_metric("train/Labels", torch.tensor(float(labels)), ReduceType.sum)


class SmallEvalBatchModule(LabelCountingTrainModule):
    """A module whose eval_batch takes at most 2 instances a call."""

    @property
    def eval_batch_spec(self):
        return EvalBatchSpec(rank_batch_size=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_byte_memmap(root / "a.npy", 30_000)
    return [str(root / "a.npy")]


def _config(tmp_path, corpus, **overrides):
    settings = {
        "max_duration": 8,
        "save_interval_unsharded": 4,
        "train_module": "test_train_module.LabelCountingTrainModule",
        **overrides,
    }
    cfg = tiny_config_dict(tmp_path / "run", corpus, **settings)
    return write_config(tmp_path / "config.yaml", cfg)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def custom_module(monkeypatch):
    """LabelCountingTrainModule importable by its dotted path, here and in torchrun's worker processes."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p))


def test_custom_module_trains_checkpoints_and_resumes_bitwise(tmp_path, corpus, custom_module):
    full, resumed = [], []
    assert run_train(_config(tmp_path / "full", corpus), record=full) == 0
    part = _config(tmp_path / "part", corpus, stop_at=4)
    assert run_train(part, record=resumed) == 0
    assert run_train(part, "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    losses = [r["train/CrossEntropyLoss"] for r in full]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert [r["train/CrossEntropyLoss"] for r in resumed] == losses  # bitwise on CPU
    assert {r["train/Labels"] for r in full} == {8 * 31.0}  # global batch 8 x (32 - 1) labels
    for name in ("model.pt", "optim.pt"):
        before = torch.load(tmp_path / "full/run/step8-unsharded" / name, weights_only=True)
        after = torch.load(tmp_path / "part/run/step8-unsharded" / name, weights_only=True)
        flat_before, flat_after = _flatten(before), _flatten(after)
        assert flat_before.keys() == flat_after.keys()
        for key, value in flat_before.items():
            other = flat_after[key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (name, key)


def _flatten(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flatten(value, f"{prefix}.{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in _flatten(value, f"{prefix}[{i}]").items()}
    return {prefix: obj}


def test_custom_module_under_two_gloo_ranks_matches_one_process(tmp_path, corpus, custom_module):
    one = []
    assert run_train(_config(tmp_path / "one", corpus, max_duration=4), record=one) == 0
    proc = run_torchrun(2, _config(tmp_path / "two", corpus, max_duration=4), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = _metrics(tmp_path / "two/run")
    np.testing.assert_allclose(
        [r["train/CrossEntropyLoss"] for r in two], [r["train/CrossEntropyLoss"] for r in one], rtol=1e-5
    )
    assert {r["train/Labels"] for r in two} == {8 * 31.0}  # each rank's 4 x 31, summed over the 2 ranks


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_package.MyModule", "cannot import 'no_such_package.MyModule'"),
        ("olmo.train.train_module.NoSuchModule", "cannot import"),
        ("olmo.model.OLMo", "not a subclass of olmo.train.train_module.TrainModule"),
        ("olmo.train.build_module.build_train_module", "not a subclass"),
    ],
)
def test_a_bad_train_module_name_is_a_configuration_error(name, message):
    with pytest.raises(OLMoConfigurationError, match="train_module: .*" + message.replace(".", r"\.")):
        resolve_train_module_class(name)


def test_train_module_names_resolve():
    assert resolve_train_module_class("BasicTrainModule") is BasicTrainModule
    assert resolve_train_module_class("olmo.train.train_module.TransformerTrainModule") is TransformerTrainModule
    assert issubclass(resolve_train_module_class(LabelCountingTrainModule), TrainModule)


def test_state_dict_round_trips_and_eval_batch_matches_the_model(tmp_path):
    from olmo.distributed import ParallelizeOptions, ParallelLayout, build_model, init_distributed
    from olmo.optim import build_optimizer, build_scheduler

    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, [str(tmp_path / "unused.npy")]))
    env = init_distributed()
    model = build_model(cfg.model, ParallelLayout.of_run(cfg, env), ParallelizeOptions.from_train_config(cfg))
    optimizer = build_optimizer(cfg.optimizer, model)
    module = build_train_module(cfg, env, model, optimizer, build_scheduler(cfg.scheduler))
    assert isinstance(module, TransformerTrainModule)
    state = module.state_dict()
    assert state["model"].keys() == model.state_dict().keys()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    module.load_state_dict(state)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state["model"].items())
    input_ids = torch.randint(0, cfg.model.vocab_size, (2, 32))
    logits = module.eval_batch({"input_ids": input_ids})
    assert logits.shape == (2, 32, cfg.model.embedding_size)
    labels = torch.cat([input_ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    ce = module.eval_batch({"input_ids": input_ids}, labels)  # (B, T)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(ce[:, :-1].mean(), expected)
    assert torch.all(ce[:, -1] == 0)


def test_a_bad_train_module_in_the_config_stops_the_launch_before_anything_is_written(tmp_path, corpus):
    config = _config(tmp_path, corpus, train_module="no_such_package.MyModule")
    with pytest.raises(OLMoConfigurationError, match="train_module: cannot import"):
        run_train(config)
    assert not (tmp_path / "run").exists()


def test_an_evaluator_batch_larger_than_the_modules_eval_batch_spec_is_refused_before_training(
    tmp_path, corpus, custom_module
):
    lm_eval = [{"label": "held-out", "type": "lm", "data": {"paths": corpus}, "device_eval_batch_size": 3}]
    config = _config(tmp_path, corpus, train_module="test_train_module.SmallEvalBatchModule", evaluators=lm_eval)
    with pytest.raises(
        OLMoConfigurationError, match=r"evaluators\[0\] \('held-out'\) makes batches of 3 .* at most 2"
    ):
        run_train(config)
    assert not list((tmp_path / "run").glob("step*"))


def _readme_module():
    """The TrainModule example of the README, run as the module ``readme_train_module``."""
    section = README.read_text().split("## The training step: `TrainModule`", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("readme_train_module")
    exec(compile(code, str(README), "exec"), module.__dict__)
    return module


def test_the_readme_example_trains_checkpoints_and_resumes_bitwise(tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "readme_train_module", _readme_module())
    settings = {"max_duration": 4, "save_interval_unsharded": 2}
    settings["train_module"] = "readme_train_module.LabelSmoothingTrainModule"
    full, resumed = [], []
    assert run_train(_config(tmp_path / "full", corpus, **settings), record=full) == 0
    part = _config(tmp_path / "part", corpus, stop_at=2, **settings)
    assert run_train(part, record=resumed) == 0
    assert run_train(part, "--try_load_latest_save", "--stop_at=null", record=resumed) == 0
    losses = [r["train/CrossEntropyLoss"] for r in full]
    assert [r["train/CrossEntropyLoss"] for r in resumed] == losses and losses[-1] < losses[0]
    assert all(r["train/SmoothedLoss"] > r["train/CrossEntropyLoss"] for r in full)  # smoothing costs loss
