"""Every check that can run before a launch's first write does (issue 25): a resume whose KL reference, trainer
state or optimizer state cannot be used stops with one paragraph before ``config.yaml``, the data order or the
data-index files are touched, so the next launch is not refused because of what the failed one wrote."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from olmo.checkpoint import MARKER
from olmo.exceptions import OLMoCheckpointError, OLMoDataError
from olmo.testing import REPO, run_main, run_train, tiny_config_dict, write_byte_corpus, write_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _snapshot(run: Path) -> dict[str, str]:
    """Every file of the run folder but the checkpoints: what a failed launch must leave as it was."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and not p.relative_to(run).parts[0].startswith(("step", "stage"))
    }


def _rewrite_marker_size(checkpoint: Path, name: str) -> None:
    """A damaged (or crafted) file comes with a marker that agrees with it: only the content is wrong."""
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["files"][name] = (checkpoint / name).stat().st_size
    (checkpoint / MARKER).write_text(json.dumps(marker))


def test_a_resume_inside_a_kl_stage_checks_its_reference_first(tmp_path, corpus):
    stages = [{"name": "pretrain", "max_duration": 2}, {"name": "kl", "max_duration": 4, "kl_beta": 0.1}]
    cfg = tiny_config_dict(tmp_path / "run", corpus, max_duration=None, stages=stages, save_interval_unsharded=100)
    config = write_config(tmp_path / "c.yaml", cfg)
    assert run_train(config, "--stop_at=4") == 0
    run = tmp_path / "run"
    boundary = run / "stage1-step2"
    before = _snapshot(run)
    state = torch.load(boundary / "model.pt", weights_only=True)
    state["transformer.wte.weight"] = state["transformer.wte.weight"][:, :16]  # another model's shape
    torch.save(state, boundary / "model.pt")
    _rewrite_marker_size(boundary, "model.pt")
    with pytest.raises(
        OLMoCheckpointError, match=r"reference of KL stage 1 \(kl\), .*stage1-step2', cannot be used"
    ):
        run_train(config, "--try_load_latest_save")
    assert _snapshot(run) == before
    (boundary / MARKER).unlink()  # a copy that stopped half-way: no marker, no config.yaml
    (boundary / "config.yaml").unlink()
    with pytest.raises(
        OLMoCheckpointError, match=r"the KL reference .*stage1-step2' is not a committed checkpoint"
    ):
        run_train(config, "--try_load_latest_save")
    assert _snapshot(run) == before


@pytest.mark.parametrize("damage", ["missing key", "not a number"])
def test_a_damaged_trainer_state_is_found_before_anything_is_written(tmp_path, corpus, damage):
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", corpus, max_duration=4))
    assert run_train(config, "--stop_at=2", "--save_interval_unsharded=2") == 0
    run = tmp_path / "run"
    train = run / "step2-unsharded" / "train.pt"
    state = torch.load(train, weights_only=True)
    if damage == "missing key":
        del state["global_train_examples_seen_this_epoch"]
    else:
        state["global_step"] = "two"
    torch.save(state, train)
    _rewrite_marker_size(run / "step2-unsharded", "train.pt")
    before = _snapshot(run)
    with pytest.raises(OLMoCheckpointError, match=r"trainer state .*train\.pt' is damaged: global_"):
        run_train(config, f"--load_path={run / 'step2-unsharded'}")
    assert _snapshot(run) == before


@pytest.mark.parametrize("sharded", [False, True])
def test_another_optimizer_is_refused_before_anything_is_written(tmp_path, corpus, sharded):
    interval = {"save_interval": 2} if sharded else {"save_interval_unsharded": 2}
    config = write_config(
        tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", corpus, max_duration=4, **interval)
    )
    assert run_train(config, "--stop_at=2") == 0
    before = _snapshot(tmp_path / "run")
    with pytest.raises(
        OLMoCheckpointError, match=r"is adamw's .*optimizer\.name is lionw.*--reset_optimizer_state"
    ):
        run_train(config, "--try_load_latest_save", "--optimizer.name=lionw")
    assert _snapshot(tmp_path / "run") == before


def test_a_ladder_size_checks_its_data_before_writing_its_config(tmp_path):
    text = (REPO / "configs/ladder/tiny.yaml").read_text()
    text = text.replace("dir: runs/ladder/${name}", f"dir: {tmp_path / 'out'}")
    text = text.replace(
        "base_config: configs/tiny/OLMo-tiny.yaml", f"base_config: {REPO / 'configs/tiny/OLMo-tiny.yaml'}"
    )
    text = text.replace(
        "  - wandb=null", f"  - wandb=null\n  - data.paths=[{tmp_path / 'missing.npy'}]\n  - evaluators=[]"
    )
    (tmp_path / "ladder.yaml").write_text(text)
    with pytest.raises(OLMoDataError, match=r"missing\.npy.* does not exist"):
        run_main("ladder.py", "run", tmp_path / "ladder.yaml", "--size", "d64")
    assert not (tmp_path / "out").exists()
