"""The training loop's callback protocol (olmo/train/callback.py, issue 37), through the real train command: the
README's example (run as written there), the hooks in order with their contexts, a rewind a callback asks for that
trains on bitwise like an uninterrupted run, and an error that no callback recovers from."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.cli.train import main
from olmo.testing import tiny_config_dict, write_byte_corpus, write_config
from olmo.train.callback import Callback

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _config(tmp_path, corpus, **overrides):
    cfg = tiny_config_dict(
        tmp_path / "run", corpus, **{"max_duration": 10, "save_interval_unsharded": 5, **overrides}
    )
    return str(write_config(tmp_path / "c.yaml", cfg))


def _metrics(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def _readme_example():
    text = README.read_text()
    section = text.split("## Your own callbacks", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert code is not None, "README.md: the section 'Your own callbacks' has no python block"
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    return namespace


class Recorder(Callback):
    """Every hook called, with what its context says."""

    def __init__(self):
        self.calls = []

    def pre_train(self, ctx):
        self.calls.append(("pre_train", ctx.step, ctx.stop_at))

    def pre_step(self, ctx):
        self.calls.append(("pre_step", ctx.step))

    def post_step(self, ctx):
        self.calls.append(("post_step", ctx.step, "train/CrossEntropyLoss" in ctx.metrics, ctx.data_wait >= 0))

    def post_metrics(self, ctx):
        self.calls.append(("post_metrics", ctx.step, ctx.values["train/CrossEntropyLoss"], ctx.instances()))

    def pre_checkpoint(self, ctx):
        self.calls.append(("pre_checkpoint", ctx.step, ctx.kind))

    def post_checkpoint(self, ctx):
        self.calls.append(("post_checkpoint", ctx.step, ctx.kind, Path(ctx.path).name))

    def on_stage(self, ctx):
        self.calls.append(("on_stage", ctx.step, ctx.stage.name, ctx.at_boundary, ctx.staged))

    def on_phase(self, phase, step):
        self.calls.append(("on_phase", phase, step))

    def post_train(self, ctx):
        self.calls.append(("post_train", ctx.step, ctx.how))

    def on_error(self, ctx):
        self.calls.append(("on_error", ctx.step, type(ctx.error).__name__))

    def close(self):
        self.calls.append(("close",))


def test_the_readme_example_stops_below_its_loss_with_a_final_checkpoint_and_logs_what_it_published(
    tmp_path, corpus
):
    example = _readme_example()
    stop, published = example["StopBelowLoss"](4.0), example["CheckpointLog"]()
    assert main([_config(tmp_path, corpus, max_duration=40)], callbacks=[stop, published]) == 75
    losses = {r["step"]: r["train/CrossEntropyLoss"] for r in _metrics(tmp_path) if "train/CrossEntropyLoss" in r}
    first_below = min(step for step, loss in losses.items() if loss < 4.0)
    assert 5 < first_below < 40 and max(losses) == first_below  # stopped right after the first step below 4.0
    assert (tmp_path / "run" / f"step{first_below}-unsharded" / "model.pt").is_file()
    steps = [step for step, kind, _ in published.published]
    assert steps == [5 * i for i in range(1, first_below // 5 + 1)] + [first_below]
    assert all(kind == "unsharded" and Path(path).is_dir() for _, kind, path in published.published)


def test_hooks_run_in_order_with_their_contexts(tmp_path, corpus):
    recorder = Recorder()
    assert main([_config(tmp_path, corpus, max_duration=6, save_interval_unsharded=3)], callbacks=[recorder]) == 0
    calls = recorder.calls
    names = [c[0] for c in calls if c[0] != "on_phase"]
    assert names[0] == "pre_train" and ("pre_train", 0, 6) in calls  # after the built-in ones' (their phases)
    assert names[-2:] == ["post_train", "close"] and ("post_train", 6, "finished") in calls
    assert [c[1] for c in calls if c[0] == "pre_step"] == [0, 1, 2, 3, 4, 5]
    assert [c for c in calls if c[0] == "on_stage"] == [
        ("on_stage", 0, "stage0", True, False)
    ]  # the run is one stage
    assert names.index("on_stage") == names.index("pre_step") + 1  # the first step's, before its batch
    assert [c[1:] for c in calls if c[0] == "post_step"] == [(s, True, True) for s in range(1, 7)]
    logged = {c[1]: c[2] for c in calls if c[0] == "post_metrics"}
    jsonl = {r["step"]: r["train/CrossEntropyLoss"] for r in _metrics(tmp_path)}
    assert logged == jsonl
    order = np.memmap(tmp_path / "run/train_data/global_indices.npy", dtype=np.uint32, mode="r")  # OLMo's raw file
    for _, step, _, instances in (c for c in calls if c[0] == "post_metrics"):  # each step's global batch
        assert instances == [int(i) for i in order[(step - 1) * 8 : step * 8]]
    checkpoints = [c for c in calls if c[0] in ("pre_checkpoint", "post_checkpoint")]
    assert checkpoints == [
        ("pre_checkpoint", 3, "unsharded"),
        ("post_checkpoint", 3, "unsharded", "step3-unsharded"),
        ("pre_checkpoint", 6, "unsharded"),
        ("post_checkpoint", 6, "unsharded", "step6-unsharded"),
    ]
    phases = [c[1:] for c in calls if c[0] == "on_phase"]
    assert ("data_wait", 1) in phases and ("optimizer", 1) in phases and ("checkpoint", 3) in phases
    assert phases[-1] == (None, 6)
    # A checkpoint is written inside the checkpoint phase.
    at = calls.index(("pre_checkpoint", 3, "unsharded"))
    assert [c for c in calls[:at] if c[0] == "on_phase"][-1] == ("on_phase", "checkpoint", 3)


def test_a_staged_run_calls_on_stage_as_each_stage_begins_and_a_kl_stage_checkpoints_there(tmp_path, corpus):
    stages = [
        {"name": "pretrain", "max_duration": 4},
        {"name": "anneal-kl", "max_duration": 3, "kl_beta": 0.1, "data": {"seed": 77}},
    ]
    recorder = Recorder()
    config = _config(tmp_path, corpus, max_duration=None, save_interval_unsharded=100, stages=stages)
    assert main([config, "--stop_at=6"], callbacks=[recorder]) == 0
    calls = [c for c in recorder.calls if c[0] in ("on_stage", "pre_checkpoint", "pre_step")]
    at = calls.index(("on_stage", 4, "anneal-kl", True, True))
    assert [c for c in calls if c[0] == "on_stage"] == [("on_stage", 0, "pretrain", True, True), calls[at]]
    # The stage callback (built in, so before ours) wrote the boundary checkpoint the reference is rebuilt from.
    assert calls[at - 2 : at + 2] == [
        ("pre_step", 4),
        ("pre_checkpoint", 4, "named"),
        ("on_stage", 4, "anneal-kl", True, True),
        ("pre_step", 5),
    ]
    assert (tmp_path / "run" / "stage1-step4").is_dir()
    resumed = Recorder()  # within the KL stage: its reference is rebuilt, no checkpoint is written
    assert main([config, "--try_load_latest_save"], callbacks=[resumed]) == 0
    calls = [c for c in resumed.calls if c[0] in ("on_stage", "pre_checkpoint")]
    assert calls == [("on_stage", 6, "anneal-kl", False, True), ("pre_checkpoint", 7, "unsharded")]


class RewindOnce(Callback):
    """Asks, once, at the logged step ``at``, to go back before step ``before``."""

    def __init__(self, at, before):
        self.at, self.before, self.rewinds = at, before, []

    def post_metrics(self, ctx):
        if ctx.step == self.at and not self.rewinds:
            ctx.loop.rewind(self.before, "a test asked for it")

    def on_rewind(self, ctx):
        self.rewinds.append((ctx.from_step, ctx.to_step, ctx.before_step, ctx.reason))


def test_a_rewind_a_callback_asks_for_goes_back_to_the_checkpoint_and_trains_on_bitwise(tmp_path, corpus):
    assert main([_config(tmp_path / "plain", corpus, **{"model.attention_dropout": 0.1})]) == 0
    rewind = RewindOnce(at=8, before=7)
    assert (
        main([_config(tmp_path / "rewound", corpus, **{"model.attention_dropout": 0.1})], callbacks=[rewind]) == 0
    )
    assert rewind.rewinds == [(8, 5, 7, "a test asked for it")]
    rows = [(r["step"], r["train/CrossEntropyLoss"]) for r in _metrics(tmp_path / "rewound")]
    plain = dict((r["step"], r["train/CrossEntropyLoss"]) for r in _metrics(tmp_path / "plain"))
    assert [s for s, _ in rows] == [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9, 10]  # 6-8 trained again
    assert all(loss == plain[step] for step, loss in rows)  # the same batches and dropout draws
    for name in ("model.pt", "optim.pt"):
        a = torch.load(tmp_path / "plain/run/step10-unsharded" / name, weights_only=False)
        b = torch.load(tmp_path / "rewound/run/step10-unsharded" / name, weights_only=False)
        assert _same(a, b), name


def _same(a, b):
    """Equal tensors (bitwise) and values; a restored optimizer's tuples read back as lists."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class FailAt(Recorder):
    def post_step(self, ctx):
        super().post_step(ctx)
        if ctx.step == 3:
            raise RuntimeError("a callback failed")


def test_an_error_no_callback_recovers_from_reaches_the_caller_after_on_error_and_close(tmp_path, corpus):
    recorder = FailAt()
    with pytest.raises(RuntimeError, match="a callback failed"):
        main([_config(tmp_path, corpus)], callbacks=[recorder])
    names = [c[0] for c in recorder.calls if c[0] != "on_phase"]
    assert names[-2:] == ["on_error", "close"] and "post_train" not in names
    assert ("on_error", 3, "RuntimeError") in recorder.calls
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3]  # what was read back is logged
