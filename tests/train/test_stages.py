"""Staged training (``stages:``) with a KL penalty to a frozen reference: exactness, resume, FSDP, bad input."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.checkpoint import MARKER
from olmo.cli.inspect_batch import main as inspect_batch
from olmo.config import TrainConfig
from olmo.data import read_data_indices
from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError
from olmo.testing import run_train, tiny_config_dict, write_byte_corpus, write_config
from olmo.testing.train_each import run_torchrun_each


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _stages(beta=0.1, estimator="full", data=True, first=4, second=4):
    anneal = {"name": "anneal-kl", "max_duration": second, "kl_beta": beta, "kl_estimator": estimator}
    if data:
        anneal["data"] = {"seed": 77}
    return [{"name": "pretrain", "max_duration": first}, anneal]


def _config(tmp_path, corpus, name="run", **overrides):
    overrides.setdefault("max_duration", None)
    overrides.setdefault("save_interval_unsharded", 100)
    cfg = tiny_config_dict(tmp_path / name, corpus, **overrides)
    return write_config(tmp_path / f"{name}.yaml", cfg)


def _metrics(run: Path):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _final_model(run: Path, step: int):
    return torch.load(run / f"step{step}-unsharded" / "model.pt", weights_only=True)


def _assert_models_equal(a, b, rtol=0.0, atol=0.0):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=key)


def test_two_stages_without_penalty_or_data_are_bitwise_one_stage(tmp_path, corpus):
    one = _config(tmp_path, corpus, "one", max_duration=8)
    two = _config(tmp_path, corpus, "two", stages=_stages(beta=0.0, data=False))
    assert run_train(one) == 0 and run_train(two) == 0
    _assert_models_equal(_final_model(tmp_path / "one", 8), _final_model(tmp_path / "two", 8))
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [m["train/CrossEntropyLoss"] for m in a] == [m["train/CrossEntropyLoss"] for m in b]
    assert [m["train/stage"] for m in b] == [0] * 4 + [1] * 4
    assert not list((tmp_path / "two").glob("stage*-step*"))  # no reference, so no boundary checkpoint


@pytest.mark.parametrize("estimator", ["full", "nll_diff"])
def test_kl_stage_resumes_bitwise_from_a_stop_in_the_middle_of_it(tmp_path, corpus, estimator):
    """Stop at step 6 (2 steps into the KL stage), resume with --try_load_latest_save: the reference is rebuilt
    from the boundary checkpoint and the run ends bitwise equal to the uninterrupted one."""
    whole = _config(tmp_path, corpus, "whole", stages=_stages(estimator=estimator))
    part = _config(tmp_path, corpus, "part", stages=_stages(estimator=estimator))
    assert run_train(whole) == 0
    assert run_train(part, "--stop_at=6") == 0  # a stop_at run saves its last step and ends normally
    assert run_train(part, "--try_load_latest_save") == 0
    _assert_models_equal(_final_model(tmp_path / "whole", 8), _final_model(tmp_path / "part", 8))

    metrics = {m["step"]: m for m in _metrics(tmp_path / "whole")}
    assert metrics[5]["train/KL"] == 0.0  # the first KL step: policy == reference
    assert all("train/KL" not in metrics[s] for s in range(1, 5))
    for s in range(5, 9):
        m = metrics[s]
        if estimator == "full":
            assert m["train/KL"] >= 0.0
        assert m["train/TotalLoss"] == pytest.approx(m["train/CrossEntropyLoss"] + 0.1 * m["train/KL"], rel=1e-5)
    assert metrics[8]["train/KL"] != 0.0
    resumed = {m["step"]: m for m in _metrics(tmp_path / "part")}
    assert [resumed[s]["train/KL"] for s in range(5, 9)] == [metrics[s]["train/KL"] for s in range(5, 9)]

    boundary = tmp_path / "whole" / "stage1-step4"
    assert (boundary / MARKER).is_file() and (boundary / "optim.pt").is_file()
    assert (tmp_path / "whole" / "train_data" / "stage1" / "global_indices.npy").is_file()
    # The stage's own data: a different order of the same files (data.seed 77).
    first = np.memmap(tmp_path / "whole" / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r")
    second = np.memmap(
        tmp_path / "whole" / "train_data" / "stage1" / "global_indices.npy", dtype=np.uint32, mode="r"
    )
    assert len(first) == len(second) and not np.array_equal(first, second)
    if estimator == "full":  # plot_metrics draws the KL and marks where stage 1 begins
        from olmo.cli.plot_metrics import main as plot_metrics
        from olmo.cli.plot_metrics import read_metrics, stage_starts

        plot_metrics([str(tmp_path / "whole"), "--out", str(tmp_path / "plots")])
        assert (tmp_path / "plots" / "kl.png").stat().st_size > 0
        assert stage_starts(read_metrics(tmp_path / "whole")) == [(5, 1)]
    # inspect_batch finds each step's instances in its stage's order, as the trainer recorded them.
    recorded = read_data_indices(tmp_path / "part")
    for step in (4, 5, 8):
        rows = inspect_batch([str(tmp_path / "part"), "--step", str(step)])
        assert [r.index for r in rows] == recorded[step][0], step


def test_a_resume_inside_a_kl_stage_without_its_reference_checkpoint_stops_before_any_work(tmp_path, corpus):
    import shutil

    cfg = _config(tmp_path, corpus, stages=_stages())
    assert run_train(cfg, "--stop_at=6") == 0
    shutil.rmtree(tmp_path / "run" / "stage1-step4")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(OLMoCheckpointError, match=r"inside KL stage 1 \(anneal-kl\).*stage1-step4.*missing"):
        run_train(cfg, "--try_load_latest_save")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == lines


def test_a_stage_scheduler_restarts_at_the_stage_and_spans_it(tmp_path, corpus):
    stages = _stages(beta=0.0, data=False)
    stages[1]["scheduler"] = {"name": "linear_with_warmup", "t_warmup": 2, "alpha_f": 0.0}
    assert run_train(_config(tmp_path, corpus, stages=stages)) == 0
    lr = [m["optim/learning_rate_group0"] for m in _metrics(tmp_path / "run")]
    peak = 1e-2
    assert lr[4] == pytest.approx(0.1 * peak + 0.9 * peak * 1 / 2)  # warmup step 1 of 2 of the stage
    assert lr[5] == pytest.approx(peak)
    assert lr[7] == pytest.approx(peak * (1 - (4 - 2) / (4 - 2)), abs=1e-12)  # decayed to 0 at the stage's end


def test_a_stage_can_anneal_with_its_own_wsd_decay(tmp_path, corpus):
    stages = _stages(beta=0.0, data=False)
    stages[1]["scheduler"] = {"name": "wsd", "t_warmup": 0, "t_decay": 2, "alpha_f": 0.0, "decay_shape": "1-sqrt"}
    assert run_train(_config(tmp_path, corpus, stages=stages)) == 0
    lr = [m["optim/learning_rate_group0"] for m in _metrics(tmp_path / "run")]
    peak = 1e-2
    assert lr[4:] == pytest.approx([peak, peak, peak * (1 - 0.5**0.5), 0.0], abs=1e-12)  # steps 1-4 of the stage


def test_kl_reference_load_path_trains_only_the_kl_stage_from_an_existing_model(tmp_path, corpus):
    base = _config(tmp_path, corpus, "base", max_duration=4)
    assert run_train(base) == 0
    model = tmp_path / "base" / "step4-unsharded"
    kl_only = [{"name": "kl", "max_duration": 3, "kl_beta": 0.5, "kl_estimator": "full"}]
    cfg = _config(tmp_path, corpus, "kl", stages=kl_only, load_path=str(model), reset_trainer_state=True)
    assert run_train(cfg, f"--kl_reference.load_path={model}") == 0
    kl = [m["train/KL"] for m in _metrics(tmp_path / "kl")]
    assert kl[0] == 0.0 and all(k > 0 for k in kl[1:])
    assert not list((tmp_path / "kl").glob("stage*-step*"))  # the reference is load_path: nothing to save


def _load(tmp_path, corpus, **overrides):
    return TrainConfig.load(_config(tmp_path, corpus, **overrides))


@pytest.mark.parametrize(
    "stages, extra, key",
    [
        (
            [{"name": "a", "max_duration": 4}, {"name": "b", "kl_beta": 0.1}],
            {},
            r"stages\[1\] \(b\)\.max_duration",
        ),
        ([{"max_duration": 4, "kl_beta": -0.5}], {}, r"stages\[0\]\.kl_beta=-0.5"),
        (
            [{"max_duration": 4}, {"max_duration": 4}],
            {"max_duration": 10},
            r"max_duration=10 is 10 steps.*8 steps",
        ),
        ([{"max_duration": 4, "data": {"pathz": ["x.npy"]}}], {}, r"stages\[0\]\.data\.pathz"),
        ([], {}, r"stages=\[\] has no stage"),
    ],
    ids=["stage_without_max_duration", "negative_kl_beta", "sum_disagrees", "unknown_data_key", "no_stage"],
)
def test_bad_stages_are_one_error_naming_the_key(tmp_path, corpus, stages, extra, key):
    cfg = _load(tmp_path, corpus, stages=stages, **extra)
    with pytest.raises(OLMoConfigurationError, match=key):
        cfg.validate()


def test_an_unknown_kl_estimator_names_the_key(tmp_path, corpus):
    cfg = _load(tmp_path, corpus, stages=_stages(estimator="exact"))
    with pytest.raises(OLMoConfigurationError, match=r"stages\[1\] \(anneal-kl\)\.kl_estimator='exact'"):
        cfg.validate()


def test_stages_in_epochs_must_add_up_before_any_work(tmp_path, corpus):
    # 50,000 bytes / 32 tokens = 1562 instances = 195 batches of 8: 1ep + 5 steps = 200 steps, not 10.
    cfg = _config(tmp_path, corpus, max_duration=10, stages=[{"max_duration": "1ep"}, {"max_duration": 5}])
    with pytest.raises(OLMoConfigurationError, match="add up to 200 steps"):
        run_train(cfg)
    assert not (tmp_path / "run").exists()


def test_a_kl_reference_of_another_shape_is_refused_before_any_work(tmp_path, corpus):
    other = _config(tmp_path, corpus, "other", max_duration=1, **{"model.d_model": 64})
    assert run_train(other) == 0
    cfg = _config(tmp_path, corpus, stages=_stages())
    with pytest.raises(OLMoCheckpointError, match="kl_reference.load_path"):
        run_train(cfg, f"--kl_reference.load_path={tmp_path / 'other' / 'step1-unsharded'}")
    assert not (tmp_path / "run").exists()


def test_a_train_module_without_kl_is_refused_for_a_kl_stage(tmp_path, corpus):
    cfg = _config(tmp_path, corpus, stages=_stages(), train_module="BasicTrainModule")
    with pytest.raises(OLMoConfigurationError, match="does not train a KL penalty"):
        run_train(cfg)
    assert not (tmp_path / "run").exists()


def _assert_runs_match(a: Path, b: Path, steps=8):
    _assert_models_equal(_final_model(a, steps), _final_model(b, steps), 1e-5, 1e-6)
    ma = {m["step"]: m for m in _metrics(a)}
    mb = {m["step"]: m for m in _metrics(b)}
    assert mb and set(mb) <= set(ma)
    for s in mb:
        assert mb[s]["train/CrossEntropyLoss"] == pytest.approx(ma[s]["train/CrossEntropyLoss"], rel=1e-5)
        if "train/KL" in ma[s]:
            assert mb[s]["train/KL"] == pytest.approx(ma[s]["train/KL"], rel=1e-4, abs=1e-7)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, corpus):
    """The 2-rank (FSDP) runs of this module, in one torchrun launch (each launch costs seconds of start-up), in
    turn: a KL run stopped in its KL stage, the same run uninterrupted, an nll_diff run, then the stopped run
    resumed; the uninterrupted and nll_diff runs between the stop and the resume, so that nothing the stopped run
    left in the ranks' memory can stand in for what the checkpoint must restore."""
    root = tmp_path_factory.mktemp("two_ranks")
    kl = _stages(estimator="full")
    whole, part = _config(root, corpus, "whole", stages=kl), _config(root, corpus, "part", stages=kl)
    nll_diff = _config(root, corpus, "fsdp", stages=_stages(estimator="nll_diff"))
    runs = [[part, "--stop_at=6"], [whole], [nll_diff], [part, "--try_load_latest_save"]]
    proc = run_torchrun_each(2, runs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_fsdp_kl_stage_resumes_bitwise_and_continues_on_another_world_size(two_ranks, tmp_path, corpus):
    """2 gloo ranks (FSDP): stopped inside the KL stage and resumed, the run ends bitwise equal to the
    uninterrupted 2-rank run; resumed from the same checkpoint by 1 process (another folder, --load_path), it
    continues the same data and matches 1 process (rtol 1e-5), as does the 2-rank run itself."""
    stages = _stages(estimator="full")
    root = two_ranks
    assert (root / "part" / "stage1-step4" / MARKER).is_file()
    _assert_models_equal(_final_model(root / "whole", 8), _final_model(root / "part", 8))
    single = _config(tmp_path, corpus, "single", stages=stages)
    switch = _config(tmp_path, corpus, "switch", stages=stages)
    assert run_train(single) == 0
    assert (
        run_train(switch, f"--load_path={root / 'part' / 'step6-unsharded'}") == 0
    )  # reference: part/stage1-step4
    _assert_runs_match(tmp_path / "single", root / "whole")
    _assert_runs_match(tmp_path / "single", tmp_path / "switch")
    assert read_data_indices(tmp_path / "switch")[7][0] == read_data_indices(tmp_path / "single")[7][0]


def test_fsdp_nll_diff_matches_one_process(two_ranks, tmp_path, corpus):
    assert run_train(_config(tmp_path, corpus, "single", stages=_stages(estimator="nll_diff"))) == 0
    _assert_runs_match(tmp_path / "single", two_ranks / "fsdp")  # the fixture trained "fsdp" on 2 ranks
