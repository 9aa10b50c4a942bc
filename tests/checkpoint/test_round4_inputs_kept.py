"""Issue 50, data loss: nothing a run reads is deleted by the run. Every input (references, load_path, data, masks,
evaluators' and stages' data, the tokenizer file) is checked against what ``--save_overwrite`` removes up front and
what retention, ephemeral checkpoints or a re-save deletes later, before anything is written; links are followed as
the kernel follows them. A rewind mid-run keeps a checkpoint the run reads."""

import json
import os
import re
import shutil
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import numpy as np
import pytest

from olmo.checkpoint import MARKER, prune_checkpoints, remove_ephemeral_checkpoints
from olmo.checkpoint.restore import LaunchOptions, LaunchPlan, RestorePlan, claim_save_folder, prepare_save_folder
from olmo.config import TrainConfig
from olmo.config.input_paths import INPUT_KEYS, NOT_INPUT_KEYS, PATH_LIKE_NAME, run_inputs
from olmo.distributed.collectives import DistEnv
from olmo.exceptions import OLMoCheckpointError, OLMoTrainingError
from olmo.testing import run_train, tiny_config_dict, write_byte_corpus, write_config
from olmo.train.checkpointer import Checkpointer
from olmo.util.checkpoint_dirs import CheckpointInfo

FRESH = LaunchPlan(None)


def _checkpoint(folder: Path, step: int, sharded: bool = False, ephemeral: bool = False) -> Path:
    """A committed checkpoint as list_checkpoints finds it (marker listing its one file)."""
    path = folder / (f"step{step}" if sharded else f"step{step}-unsharded")
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(b"x")
    marker = {"step": step, "sharded": sharded, "files": {"model.pt": 1}, "ephemeral": ephemeral}
    (path / MARKER).write_text(json.dumps(marker))
    return path


def _previous_run(run: Path) -> None:
    """A folder holding a run: config.yaml, its data order and checkpoints at steps 5 and 9."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("run_name: old\n")
    (run / "train_data").mkdir()
    (run / "train_data" / "tokens.npy").write_bytes(b"\0" * 64)
    _checkpoint(run, 5)
    _checkpoint(run, 9)


def _cfg(run: Path, **values) -> TrainConfig:
    values.setdefault("data", {"paths": ["/nonexistent/data.npy"]})
    return TrainConfig.new(save_folder=str(run), **values)


def _prepare(cfg: TrainConfig, launch: LaunchPlan) -> None:
    prepare_save_folder(LaunchOptions.from_train_config(cfg), launch)


def _claim(cfg: TrainConfig, launch: LaunchPlan) -> None:
    claim_save_folder(LaunchOptions.from_train_config(cfg), launch, cfg)


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _refused(cfg: TrainConfig, launch: LaunchPlan, *needles: str) -> str:
    """Both the check (prepare_save_folder) and the deleting step (claim_save_folder) refuse, deleting nothing."""
    before = _listing(Path(cfg.save_folder))
    for step in (_prepare, _claim):
        with pytest.raises(OLMoCheckpointError) as raised:
            step(cfg, launch)
        message = str(raised.value)
        for needle in needles:
            assert needle in message, message
        assert "\n" not in message
    assert _listing(Path(cfg.save_folder)) == before
    return message


# The example, end to end: a DPO run whose reference lies in its own save_folder, with --save_overwrite.


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("kept")
    corpus = write_byte_corpus(root / "data")
    masks = []
    for path, n in zip(corpus, (30_000, 20_000)):
        masks.append(path.replace(".npy", "_mask.npy"))
        np.ones(n, dtype=np.bool_).tofile(masks[-1])
    extra = {"max_duration": 1, "save_interval_unsharded": 1, "scheduler.t_warmup": 0}
    assert run_train(write_config(root / "sft.yaml", tiny_config_dict(root / "run", corpus, **extra))) == 0
    return root, corpus, masks


def _dpo(root: Path, corpus: list[str], masks: list[str], reference: Path) -> Path:
    cfg = tiny_config_dict(
        root / "run",
        corpus,
        **{
            "dpo.enabled": True,
            "dpo.reference_path": str(reference),
            "data.label_mask_paths": masks,
            "max_duration": 1,
            "scheduler.t_warmup": 0,
        },
    )
    return write_config(root / "dpo.yaml", cfg)


def test_dpo_reference_in_its_own_save_folder_survives_save_overwrite(trained, tmp_path):
    root, corpus, masks = trained
    reference = root / "run" / "step1-unsharded"
    config = (root / "run" / "config.yaml").read_bytes()
    for extra in (["--dry_run"], []):
        with pytest.raises(OLMoCheckpointError, match=r"dpo.reference_path .*--save_overwrite removes") as raised:
            run_train(_dpo(root, corpus, masks, reference), "--save_overwrite", *extra)
        assert "choose another --save_folder" in str(raised.value)
        assert (reference / MARKER).is_file() and (reference / "model.pt").is_file()
        assert (root / "run" / "config.yaml").read_bytes() == config
    # The fix the message gives: a copy of the reference outside the save folder.
    shutil.copytree(reference, tmp_path / "ref")
    assert run_train(_dpo(root, corpus, masks, tmp_path / "ref"), "--save_overwrite", "--dry_run") == 0


# Variants, each through the real prepare/claim functions.


def test_every_kind_of_input_in_the_removed_run_is_refused(tmp_path):
    run = tmp_path / "run"
    _previous_run(run)
    tokens = str(run / "train_data" / "tokens.npy")
    cases = {
        "data.paths[0]": dict(data={"paths": [tokens]}),
        "data.label_mask_paths[0]": dict(data={"paths": ["/x.npy"], "label_mask_paths": [tokens]}),
        "data.datasets.c4[0]": dict(data={"datasets": {"c4": [tokens]}}),
        "data.mixture.sources[0].paths[0]": dict(
            data={"mixture": {"sources": [{"name": "a", "paths": [tokens], "ratio": 1.0}]}}
        ),
        "evaluators[0].data.paths[0]": dict(
            evaluators=[{"label": "ev", "data": {"paths": [str(run / "train_data" / "*.npy")]}}]
        ),
        "stages[1].data.paths[0]": dict(
            stages=[{"max_duration": 1}, {"max_duration": 1, "data": {"paths": [tokens]}}]
        ),
        "kl_reference.load_path": dict(
            kl_reference={"load_path": str(run / "step5-unsharded")},
            stages=[{"max_duration": 1}, {"max_duration": 1, "kl_beta": 0.1}],
        ),
        "tokenizer.identifier": dict(tokenizer={"identifier": tokens}),
    }
    for key, values in cases.items():
        cfg = TrainConfig.new(save_folder=str(run), save_overwrite=True, **values)
        _refused(cfg, FRESH, key, "--save_overwrite removes")


def test_an_unread_reference_does_not_stop_the_launch(tmp_path):
    run = tmp_path / "run"
    _previous_run(run)
    # kl_reference.load_path without a KL stage and dpo.reference_path without dpo are never read.
    cfg = _cfg(
        run,
        save_overwrite=True,
        kl_reference={"load_path": str(run / "step5-unsharded")},
        dpo={"reference_path": str(run / "step9-unsharded")},
    )
    _prepare(cfg, FRESH)
    _claim(cfg, FRESH)
    assert not (run / "step5-unsharded").exists() and (run / "config.yaml").is_file()


def test_links_are_followed_as_the_kernel_follows_them(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _previous_run(run)
    kept = _checkpoint(elsewhere, 3)
    (run / "step3-unsharded").symlink_to(kept)  # a link entry of the previous run, to a checkpoint outside
    (tmp_path / "mask_link").symlink_to(run / "step5-unsharded" / "model.pt")  # a link outside, into the run
    # Reached through a link outside the folder that points into a removed entry.
    cfg = _cfg(
        run, save_overwrite=True, data={"paths": ["/x.npy"], "label_mask_paths": [str(tmp_path / "mask_link")]}
    )
    _refused(cfg, FRESH, "data.label_mask_paths[0]", "step5-unsharded")
    # Reached through the link entry, which is removed as a link: the path would lead nowhere.
    cfg = _cfg(run, save_overwrite=True, dpo={"enabled": True, "reference_path": str(run / "step3-unsharded")})
    _refused(cfg, FRESH, "dpo.reference_path", "removed as a link")
    # load_path through a link outside: not a resume in the folder, so the previous run (step5 too) would go first.
    (tmp_path / "ckpt_link").symlink_to(run / "step5-unsharded")
    restore = LaunchPlan(RestorePlan(CheckpointInfo(str(tmp_path / "ckpt_link"), 5, False, True), True, False))
    _refused(_cfg(run, save_overwrite=True, load_path=str(tmp_path / "ckpt_link")), restore, "load_path")
    # Named directly, the link's target is safe: the link goes, the checkpoint stays.
    cfg = _cfg(run, save_overwrite=True, dpo={"enabled": True, "reference_path": str(kept)})
    _prepare(cfg, FRESH)
    _claim(cfg, FRESH)
    assert not (run / "step3-unsharded").is_symlink() and (kept / MARKER).is_file()


def test_a_relative_input_under_the_default_save_folder(tmp_path, monkeypatch):
    _previous_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig.new(save_folder="./", save_overwrite=True, data={"paths": ["train_data/tokens.npy"]})
    _refused(cfg, FRESH, "data.paths[0]", "train_data")


def test_urls_and_link_loops_are_no_inputs_in_the_folder(tmp_path):
    run = tmp_path / "run"
    _previous_run(run)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    cfg = _cfg(run, save_overwrite=True, data={"paths": ["s3://bucket/tokens.npy", str(tmp_path / "loop" / "x")]})
    _prepare(cfg, FRESH)


def test_a_resume_in_the_folder_keeps_the_reference_newer_checkpoints_hold(tmp_path):
    run = tmp_path / "run"
    _previous_run(run)
    resume = LaunchPlan(RestorePlan(CheckpointInfo(str(run / "step5-unsharded"), 5, False, True), True, True))
    cfg = _cfg(
        run,
        save_overwrite=True,
        load_path=str(run / "step5-unsharded"),
        dpo={"enabled": True, "reference_path": str(run / "step9-unsharded")},
    )
    _refused(cfg, resume, "dpo.reference_path", "newer than step 5", "--try_load_latest_save")


def test_resaves_that_would_replace_a_reference_are_refused_up_front_and_retention_passes_over_it(tmp_path):
    run = tmp_path / "run"
    for step in (3, 5):
        _checkpoint(run, step)
    _checkpoint(run, 4, sharded=True, ephemeral=True)
    # A new run from step 5 of the folder (reset_trainer_state: it starts at step 0), against a reference in it.
    start = LaunchPlan(RestorePlan(CheckpointInfo(str(run / "step5-unsharded"), 5, False, True), True, False))
    base = dict(load_path=str(run / "step5-unsharded"), reset_trainer_state=True)

    def dpo(reference: str, **values) -> TrainConfig:
        return _cfg(run, **base, dpo={"enabled": True, "reference_path": str(run / reference)}, **values)

    # From step 0 the run saves step 3 again, and --save_overwrite would replace it.
    _refused(dpo("step3-unsharded", save_overwrite=True), start, "saves again at step 3", "drop --save_overwrite")
    # Retention and ephemeral removal pass over what the run reads (test below), so neither stops the launch; nor
    # does keeping every checkpoint without --save_overwrite; and load_path (read once, at the restore) may be pruned
    # later as any resumed checkpoint is.
    _prepare(dpo("step5-unsharded", save_num_unsharded_checkpoints_to_keep=2), start)
    _prepare(dpo("step4"), start)
    _prepare(dpo("step3-unsharded"), start)
    _prepare(_cfg(run, **base, save_num_unsharded_checkpoints_to_keep=1), start)


def test_many_inputs_in_one_paragraph(tmp_path):
    run = tmp_path / "run"
    _previous_run(run)
    tokens = [str(run / "train_data" / f"t{i}.npy") for i in range(5)]
    for path in tokens:
        Path(path).write_bytes(b"\0" * 8)
    message = _refused(
        _cfg(run, save_overwrite=True, data={"paths": tokens}), FRESH, "data.paths[2]", "and 2 more"
    )
    assert "data.paths[3]" not in message


def test_a_rewind_and_retention_keep_a_checkpoint_the_run_reads(tmp_path):
    run = tmp_path / "run"
    _previous_run(run)
    _checkpoint(run, 12, sharded=True, ephemeral=True)
    cfg = _cfg(run, dpo={"enabled": True, "reference_path": str(run / "step9-unsharded" / "model.pt")})
    checkpointer = Checkpointer(cfg, DistEnv(device=None, rank=0, local_rank=0, world_size=1), None, lambda _: {})
    with pytest.raises(
        OLMoTrainingError, match=r"Cannot rewind to before step 6: .*step9-unsharded.*Nothing was deleted"
    ):
        checkpointer.delete_from(6)  # a rewind to before step 6 would delete step 9, which the run reads
    assert (run / "step9-unsharded" / MARKER).is_file() and (run / "step12").exists()
    checkpointer.delete_from(10)  # a rewind past it deletes what is stale
    assert (run / "step9-unsharded" / MARKER).is_file() and not (run / "step12").exists()
    assert prune_checkpoints(run, False, 1, checkpointer.kept) == []  # step5 alone is counted, and kept
    cfg = _cfg(run, data={"paths": [str(run / "step5-unsharded")]})
    _checkpoint(run, 13, sharded=True, ephemeral=True)
    assert remove_ephemeral_checkpoints(
        run, kept=Checkpointer(cfg, checkpointer.env, None, lambda _: {}).kept
    ) == [run / "step13"]
    assert (run / "step5-unsharded" / MARKER).is_file()


# Every path-valued key is an input or said not to be one, so that a new key cannot escape the check.


def _holds_str(hint) -> bool:
    return hint is str or any(_holds_str(a) for a in typing.get_args(hint))


def _string_fields(cls: type, prefix: str = "") -> list[str]:
    """Every field of the config dataclass ``cls`` whose type holds a ``str``, by key (``[]`` for a list's items)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        if typing.get_origin(hint) is typing.Union:
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if typing.get_origin(hint) is list and is_dataclass(typing.get_args(hint)[0]):
            out += _string_fields(typing.get_args(hint)[0], f"{key}[].")
        elif is_dataclass(hint):
            out += _string_fields(hint, f"{key}.")
        elif _holds_str(hint):
            out.append(key)
    return out


def test_every_path_like_key_is_classified():
    keys = _string_fields(TrainConfig)
    assert "dpo.reference_path" in keys and "evaluators[].data.paths" in keys  # the walk finds nested keys
    path_like = [k for k in keys if PATH_LIKE_NAME.search(k.rsplit(".", 1)[-1].replace("[]", ""))]
    unclassified = [k for k in path_like if k not in INPUT_KEYS and k not in NOT_INPUT_KEYS]
    assert not unclassified, (
        f"add these to olmo/config/input_paths.py (INPUT_KEYS or NOT_INPUT_KEYS): {unclassified}"
    )


def test_run_inputs_covers_every_input_key(tmp_path):
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text("{}")

    def data(tag: str) -> dict:
        source = {"name": "a", "paths": [f"{tag}s"], "label_mask_paths": [f"{tag}sm"], "ratio": 1.0}
        files = {"paths": [f"{tag}p"], "label_mask_paths": [f"{tag}m"], "datasets": {"l": [f"{tag}d"]}}
        return {**files, "mixture": {"sources": [source]}}

    cfg = TrainConfig.new(
        load_path="lp",
        dpo={"enabled": True, "reference_path": "ref"},
        kl_reference={"load_path": "kl"},
        rl={"enabled": True, "prompts": "prompts", "beta": 0.1, "reference_path": "rlref"},
        stages=[{"max_duration": 1, "kl_beta": 0.1}, {"max_duration": 1, "data": {"paths": ["st"]}}],
        tokenizer={"identifier": str(tokenizer)},
        data=data("run"),
        evaluators=[{"label": "e", "data": data("eval")}],
    )
    generic = {
        re.sub(r"\[\d+\]", "[]", r.key).removesuffix("[]").replace(".datasets.l", ".datasets")
        for r in run_inputs(cfg)
    }
    generic = {k.replace("stages[].data.paths", "stages[].data") for k in generic}
    assert generic == set(INPUT_KEYS), set(INPUT_KEYS) ^ generic
    assert os.fspath(tokenizer) in {r.path for r in run_inputs(cfg)}
