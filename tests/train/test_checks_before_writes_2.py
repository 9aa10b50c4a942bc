"""Every check that can run before a launch's first write does (issue 35, a user study): a damaged
``skipped_batches.json``, a mixture the data order cannot number, data that changed under a resume, a remote label
mask without a True, a decay branch that would jump the learning rate or train nothing, a checkpoint whose trainer
state says another step, an unusable KL reference and an absurd batch size all stop the launch with one paragraph,
before ``config.yaml``, ``mixture.json``, the data order or the save folder itself are written."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo.checkpoint import MARKER
from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError, OLMoDataError
from olmo.testing import run_main, run_train, tiny_config_dict, write_byte_corpus, write_byte_memmap, write_config
from olmo.testing.http import FileServer

CHUNK = 32  # tiny_config_dict's max_sequence_length


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_byte_corpus(tmp_path_factory.mktemp("corpus"))


def _state(run: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of the run folder but the checkpoints, with its mtime: what a refused launch must leave as it was
    (config.yaml's bytes and mtime included)."""
    return {
        str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run.rglob("*"))
        if p.is_file() and not p.relative_to(run).parts[0].startswith(("step", "stage"))
    }


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, corpus):
    """A run of 60 steps stopped at step 4, with an unsharded checkpoint of step 4 (copied by each test)."""
    root = tmp_path_factory.mktemp("stopped")
    config = write_config(
        root / "c.yaml", tiny_config_dict(root / "run", corpus, max_duration=60, save_interval_unsharded=4)
    )
    assert run_train(config, "--stop_at=4") == 0
    return root / "run"


def _copy_of(stopped: Path, tmp_path: Path, corpus, **overrides) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(stopped, run, symlinks=True)
    settings = {"max_duration": 60, "save_interval_unsharded": 4, **overrides}
    return run, write_config(tmp_path / "c.yaml", tiny_config_dict(run, corpus, **settings))


@pytest.mark.parametrize(
    "text, problem",
    [("not json", "it is not JSON"), ('{"ranges": "none"}', "it is JSON of another shape")],
)
def test_a_damaged_skipped_batches_file_stops_a_resume_before_any_write(tmp_path, corpus, stopped, text, problem):
    run, config = _copy_of(stopped, tmp_path, corpus)
    (run / "skipped_batches.json").write_text(text)
    before = _state(run)
    with pytest.raises(OLMoDataError, match=r"skipped_batches\.json' is damaged: ") as e:
        run_train(config, "--try_load_latest_save", "--stop_at=5")
    assert problem in str(e.value) and "delete it" in str(e.value) and "\n" not in str(e.value)
    assert _state(run) == before


def test_a_new_run_over_an_old_one_does_not_inherit_its_skipped_batches(tmp_path, corpus, stopped):
    run, config = _copy_of(stopped, tmp_path, corpus, max_duration=1)
    (run / "skipped_batches.json").write_text("not json")
    assert run_train(config, "--save_overwrite") == 0  # the old run's record goes with the old run
    assert not (run / "skipped_batches.json").exists()


def _huge_mixture(corpus, tokens):
    return {
        "seed": 1,
        "tokens": tokens,
        "sources": [
            {"name": "a", "paths": [corpus[0]], "ratio": 0.5, "max_repetition": 1e9},
            {"name": "b", "paths": [corpus[1]], "ratio": 0.5, "max_repetition": 1e9},
        ],
    }


def test_a_mixture_of_2_32_instances_is_refused_before_any_write_and_by_dry_run(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    mixture = _huge_mixture(corpus, 2**32 * CHUNK)
    config = write_config(
        tmp_path / "c.yaml",
        tiny_config_dict(run, [], max_duration=2, **{"data.paths": None, "data.mixture": mixture}),
    )
    for flags in ([], ["--dry_run"]):
        with pytest.raises(OLMoDataError, match=r"holds 4,294,967,296 instances, more than the 2\^32 - 1"):
            run_train(config, *flags)
        assert not run.exists()
    assert "mixture (mixture.json)" not in capsys.readouterr().out  # the dry run printed no plan of it
    # The corrected launch is not refused as "already holds a run": the refused one wrote nothing.
    assert run_train(config, f"--data.mixture.tokens={16 * CHUNK}") == 0
    assert json.loads((run / "train_data" / "mixture.json").read_text())["total_instances"] == 16


@pytest.mark.parametrize("batch_size", [10**11, 10**18])
def test_an_absurd_global_batch_is_refused_before_the_save_folder_is_made(tmp_path, corpus, batch_size):
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", corpus, max_duration=2))
    for flags in ([], ["--dry_run"]):
        with pytest.raises(
            OLMoDataError, match=rf"fewer than one global batch of global_train_batch_size={batch_size}"
        ):
            run_train(config, f"--global_train_batch_size={batch_size}", *flags)
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["mixture", "paths"])
def test_data_that_grew_since_the_run_began_stops_its_resume(tmp_path, kind):
    data = tmp_path / "data"
    write_byte_memmap(data / "web-0.npy", 100 * CHUNK)
    write_byte_memmap(data / "code.npy", 60 * CHUNK, skip_bytes=600_000)
    if kind == "mixture":
        sources = [
            {"name": "web", "paths": [str(data / "web-*.npy")], "ratio": 0.5, "max_repetition": 2.0},
            {"name": "code", "paths": [str(data / "code.npy")], "ratio": 0.5, "max_repetition": 2.0},
        ]
        overrides = {"data.paths": None, "data.mixture": {"seed": 3, "sources": sources}}
    else:
        overrides = {"data.paths": [str(data / "*.npy")]}
    run = tmp_path / "run"
    config = write_config(
        tmp_path / "c.yaml", tiny_config_dict(run, [], max_duration=6, save_interval_unsharded=2, **overrides)
    )
    assert run_train(config, "--stop_at=2") == 0
    write_byte_memmap(data / "web-1.npy", 50 * CHUNK, skip_bytes=300_000)  # the glob now matches one more file
    before = _state(run)
    if kind == "mixture":
        pattern = (
            r"mixture\.json' when it began: source 'web' \(data\.mixture\.sources\[0\]\) held 100 instances of 32 "
            r"tokens and holds 150 now: its files \(data\.mixture\.sources\[0\]\.paths\) grew"
        )
    else:
        pattern = r"global_indices\.npy' numbers 160 instances .*data's files hold 210 instances now"
    with pytest.raises(OLMoDataError, match=pattern) as e:
        run_train(config, "--try_load_latest_save")
    assert "Restore the" in str(e.value) and "--load_path=" in str(e.value) and "--save_folder=" in str(e.value)
    assert _state(run) == before
    with pytest.raises(
        OLMoDataError, match=pattern
    ):  # nor would inspect_batch.py show other instances as the run's
        run_main("inspect_batch.py", run, "--step", 1)
    (data / "web-1.npy").unlink()  # the files as they were: the resume goes on
    assert run_train(config, "--try_load_latest_save", "--stop_at=3") == 0


def test_a_remote_label_mask_without_a_true_is_refused_like_a_local_one(tmp_path, corpus):
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(corpus[0], served / "a.npy")
    n = len(np.memmap(corpus[0], dtype=np.uint16, mode="r"))
    np.zeros(n, dtype=bool).tofile(served / "a_mask.npy")
    with FileServer(served) as server:
        overrides = {"data.paths": [server.url("a.npy")], "data.label_mask_paths": [server.url("a_mask.npy")]}
        config = write_config(
            tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [], max_duration=2, **overrides)
        )
        with pytest.raises(
            OLMoDataError, match=r"No label mask in data\.label_mask_paths holds a True.*loss would be 0"
        ):
            run_train(config)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def stable(tmp_path_factory):
    """A stable WSD run (t_decay 0) planned for 60 steps, stopped at step 6 with a checkpoint there."""
    root = tmp_path_factory.mktemp("stable")
    write_byte_memmap(root / "a.npy", 30_000)
    cfg = tiny_config_dict(
        root / "run",
        [str(root / "a.npy")],
        max_duration=60,
        save_interval_unsharded=6,
        **{"scheduler.name": "wsd", "scheduler.t_warmup": 2, "scheduler.t_decay": 0, "scheduler.alpha_f": 0.0},
    )
    config = write_config(root / "c.yaml", cfg)
    assert run_train(config, "--stop_at=6") == 0
    return config, root / "run" / "step6-unsharded"


@pytest.mark.parametrize(
    "flags, error, pattern",
    [
        (
            ["--max_duration=8", "--scheduler.t_decay=4"],
            OLMoConfigurationError,
            r"continues step 6 of .* WSD decay that starts at 4 steps \(max_duration=8 \(8 steps\) minus "
            r"scheduler\.t_decay=4\), before that step \(6 steps\).*--max_duration=10, or keep the length with "
            r"--scheduler\.t_decay=2",
        ),
        (["--max_duration=5"], OLMoConfigurationError, r"max_duration=5 \(5 steps\) ends before step 6.*no step"),
        (
            ["--max_duration=6", "--scheduler.t_decay=0"],
            OLMoConfigurationError,
            r"max_duration=6 \(6 steps\) ends at step 6.*write a new run folder",
        ),
    ],
)
def test_a_decay_branch_that_would_jump_the_learning_rate_or_train_nothing_is_refused(
    tmp_path, stable, flags, error, pattern
):
    config, checkpoint = stable
    branch = tmp_path / "branch"
    with pytest.raises(error, match=pattern):
        run_train(config, f"--load_path={checkpoint}", f"--save_folder={branch}", *flags)
    assert not branch.exists()


def test_a_decay_branch_resumes_inside_its_decay(tmp_path, stable):
    """The branch's own checkpoints continue its schedule: a resume past the decay's start is no branch."""
    config, checkpoint = stable
    branch = tmp_path / "branch"
    flags = [f"--load_path={checkpoint}", f"--save_folder={branch}", "--max_duration=10", "--scheduler.t_decay=4"]
    assert run_train(config, *flags, "--stop_at=8", "--save_interval_unsharded=2") == 0
    assert run_train(config, *flags, "--try_load_latest_save") == 0
    assert (branch / "step10-unsharded" / MARKER).is_file()


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_whose_trainer_state_says_another_step_is_refused(tmp_path, corpus, sharded):
    interval = {"save_interval": 4} if sharded else {"save_interval_unsharded": 4}
    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(run, corpus, max_duration=60, **interval))
    assert run_train(config, "--stop_at=4") == 0
    name = "step4" if sharded else "step4-unsharded"
    if sharded:
        shutil.rmtree(run / "step4-unsharded")  # the stop's own save: leave the renamed checkpoint the only one
    renamed = run / name.replace("step4", "step40")
    (run / name).rename(renamed)
    marker = json.loads((renamed / MARKER).read_text())
    (renamed / MARKER).write_text(json.dumps({**marker, "step": 40}))  # marker and name agree; train.pt says 4
    before = _state(run)
    with pytest.raises(
        OLMoCheckpointError, match=r"marker says step 40, but its trainer state .* says global_step 4"
    ):
        run_train(config, f"--load_path={renamed}")
    assert _state(run) == before
    with pytest.raises(
        OLMoCheckpointError, match=r"already holds a run, but none of its checkpoints can be restored"
    ):
        run_train(config, "--try_load_latest_save")
    assert _state(run) == before and renamed.is_dir()


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory, corpus):
    """A two-stage run whose second stage has a KL penalty, stopped at step 4 (its reference saved at step 2), and
    another run's checkpoint of step 2."""
    root = tmp_path_factory.mktemp("kl")
    stages = [{"name": "pretrain", "max_duration": 2}, {"name": "kl", "max_duration": 4, "kl_beta": 0.1}]
    cfg = tiny_config_dict(root / "run", corpus, max_duration=None, stages=stages, save_interval_unsharded=100)
    config = write_config(root / "c.yaml", cfg)
    assert run_train(config, "--stop_at=4") == 0
    other = tiny_config_dict(root / "other", corpus, max_duration=4, save_interval_unsharded=2, seed=99)
    assert run_train(write_config(root / "other.yaml", other), "--stop_at=2") == 0
    return cfg, root / "run", root / "other" / "step2-unsharded"


@pytest.mark.parametrize(
    "damage, pattern",
    [
        ("marker", r"stage1-step2', cannot be used: it has no \.olmo-checkpoint\.json marker"),
        (
            "link",
            r"stage1-step2', cannot be used: it is a link to '.*other/step2-unsharded', a checkpoint of another",
        ),
    ],
)
def test_an_unusable_kl_reference_stops_the_resume_before_config_yaml_is_rewritten(
    tmp_path, kl_run, damage, pattern
):
    cfg, original, other = kl_run
    run = tmp_path / "run"
    shutil.copytree(original, run, symlinks=True)
    config = write_config(tmp_path / "c.yaml", {**cfg, "save_folder": str(run)})
    boundary = run / "stage1-step2"
    if damage == "marker":
        (boundary / MARKER).unlink()  # config.yaml is still there: it looks like an original OLMo checkpoint
    else:
        shutil.rmtree(boundary)
        boundary.symlink_to(other)
    before = _state(run)
    with pytest.raises(OLMoCheckpointError, match=pattern):
        run_train(config, "--try_load_latest_save")
    assert _state(run) == before
    state = torch.load(run / "step4-unsharded" / "train.pt", weights_only=True)
    assert state["global_step"] == 4  # the checkpoint resumed from is untouched too
