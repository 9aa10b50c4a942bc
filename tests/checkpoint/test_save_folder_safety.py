"""What a run did not create, it never deletes or modifies: symlinked checkpoints in its save folder (to another
run's) are removed as links, and with ``--save_overwrite --try_load_latest_save`` (OLMo's launch scripts pass both)
an unusable newest checkpoint is moved aside, never deleted. Through scripts/train.py, with real files and links."""

import hashlib
from pathlib import Path

import pytest

from olmo.checkpoint import MARKER, list_checkpoints, save_checkpoint
from olmo.config import TrainConfig
from olmo.model import OLMo
from olmo.optim import build_optimizer
from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_byte_memmap(root / "a.npy", 10_000)
    return [str(root / "a.npy")]


@pytest.fixture(scope="module")
def other_run(tmp_path_factory, corpus):
    """Another run's folder, with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("other")
    config = write_config(
        root / "c.yaml", tiny_config_dict(root / "run", corpus, max_duration=4, save_interval_unsharded=2)
    )
    assert run_train(config) == 0
    return root / "run"


def _digest(folder: Path, skip: str = "") -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != skip):
        h.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return h.hexdigest()


def _config(tmp_path, corpus, **overrides):
    return write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", corpus, **overrides))


def test_links_to_another_runs_checkpoints_are_never_followed(tmp_path, corpus, other_run):
    before = _digest(other_run)
    run = tmp_path / "run"
    run.mkdir()
    (run / "step2-unsharded").symlink_to(other_run / "step2-unsharded")
    (run / "step6-unsharded").symlink_to(other_run / "step4-unsharded")
    # A new run over it: --save_overwrite removes the links, not the other run's markers.
    config = _config(tmp_path, corpus, max_duration=2, save_interval_unsharded=2)
    assert run_train(config, "--save_overwrite") == 0
    assert not (run / "step6-unsharded").exists() and not (run / "step2-unsharded").is_symlink()
    assert _digest(other_run) == before
    # Resuming from step 2 with --save_overwrite removes the "newer" link at step 4 as a link; retention (keep 1)
    # removes the link at step 1 as a link too.
    (run / "step1-unsharded").symlink_to(other_run / "step2-unsharded")
    (run / "step4-unsharded").symlink_to(other_run / "step4-unsharded")
    config = _config(
        tmp_path, corpus, max_duration=4, save_interval_unsharded=2, save_num_unsharded_checkpoints_to_keep=1
    )
    assert run_train(config, f"--load_path={run / 'step2-unsharded'}", "--save_overwrite") == 0
    assert [Path(c.path).name for c in list_checkpoints(run)] == ["step4-unsharded"]
    assert not (run / "step4-unsharded").is_symlink() and not (run / "step1-unsharded").exists()
    assert _digest(other_run) == before


def test_a_save_onto_a_link_replaces_the_link(tmp_path, other_run):
    cfg = TrainConfig.from_dict(tiny_config_dict(tmp_path, ["x.npy"]))
    model = OLMo(cfg.model)
    before = _digest(other_run)
    (tmp_path / "step4-unsharded").symlink_to(other_run / "step4-unsharded")
    path = save_checkpoint(
        tmp_path, 4, model, build_optimizer(cfg.optimizer, model), {}, cfg, False, overwrite=True
    )
    assert path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()
    assert _digest(other_run) == before


@pytest.mark.parametrize("damage", ["marker", "renamed"])
def test_overwrite_with_try_load_moves_an_unusable_checkpoint_aside(tmp_path, corpus, damage):
    config = _config(tmp_path, corpus, max_duration=4, save_interval_unsharded=2)
    assert run_train(config, "--stop_at=2") == 0
    run = tmp_path / "run"
    if damage == "marker":
        assert run_train(config, "--try_load_latest_save", "--stop_at=4") == 0
        (run / "step4-unsharded" / MARKER).write_text("{not json")
    else:  # a folder whose marker says another step: resuming it would delete it as "newer than step 2"
        (run / "step2-unsharded").rename(run / "step40-unsharded")
    damaged = "step4-unsharded" if damage == "marker" else "step40-unsharded"
    content = _digest(run / damaged, skip=MARKER)
    assert run_train(config, "--save_overwrite", "--try_load_latest_save") == 0
    aside = [p for p in run.iterdir() if p.name.startswith(f".{damaged}.damaged-")]
    assert len(aside) == 1, sorted(p.name for p in run.iterdir())
    assert _digest(aside[0]) == content  # every file kept (only the marker is taken out, to un-commit it)
    assert (run / "step4-unsharded" / MARKER).is_file()  # and the run trained to its end
