"""scripts/unshard.py: a sharded checkpoint becomes an unsharded one that holds the same state and resumes
training exactly like the sharded original."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo.checkpoint import MARKER, inspect_checkpoint, load_checkpoint
from olmo.cli import unshard as unshard_command
from olmo.config import TrainConfig
from olmo.exceptions import OLMoCheckpointError
from olmo.model import OLMo
from olmo.optim import build_optimizer
from olmo.testing import run_torchrun, run_train, tiny_config_dict, write_byte_memmap, write_config

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/unshard.py"


def _run_script(*args):
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], env=env, capture_output=True, text=True, timeout=120
    )


def _config(tmp_path, name, **overrides):
    if not (tmp_path / "a.npy").exists():
        write_byte_memmap(tmp_path / "a.npy", 20_000)
    settings = {"save_interval": 3, "save_interval_unsharded": None, "max_duration": 3, **overrides}
    return write_config(
        tmp_path / f"{name}.yaml", tiny_config_dict(tmp_path / name, [str(tmp_path / "a.npy")], **settings)
    )


def _restored(path, with_optimizer=True):
    """A fresh tiny model (and optimizer) with the checkpoint at ``path`` loaded into it."""
    cfg = TrainConfig.load(Path(path) / "config.yaml")
    torch.manual_seed(99)  # different initial weights, so an incomplete load cannot pass
    model = OLMo(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model) if with_optimizer else None
    state = load_checkpoint(inspect_checkpoint(str(path)), model, optimizer)
    return model, optimizer, state


def _assert_same_state(a, b):
    (model_a, optim_a, _), (model_b, optim_b, _) = a, b
    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for name in sd_a:
        assert torch.equal(sd_a[name], sd_b[name]), name
    if optim_a is not None:
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(optim_a.state[pa][key], optim_b.state[pb][key]), key


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A 3-step tiny run whose only checkpoint is the sharded ``step3/``."""
    tmp_path = tmp_path_factory.mktemp("unshard")
    config = _config(tmp_path, "run")
    assert run_train(config) == 0
    assert sorted(p.name for p in (tmp_path / "run").glob("step*")) == ["step3"]
    return tmp_path, config


def test_unsharded_output_holds_the_sharded_state_and_resumes_identically(sharded_run):
    tmp_path, config = sharded_run
    sharded, out = tmp_path / "run/step3", tmp_path / "converted/step3-unsharded"
    result = _run_script(sharded, out)
    assert result.returncode == 0, result.stderr
    assert "Wrote unsharded checkpoint" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.yaml", "model.pt", "optim.pt", "train.pt"]
    assert (out / "config.yaml").read_bytes() == (sharded / "config.yaml").read_bytes()
    assert [p.name for p in out.parent.iterdir()] == ["step3-unsharded"], "no temporary directory may remain"
    info = inspect_checkpoint(str(out))
    assert (info.step, info.sharded, info.marked) == (3, False, True)
    weights = torch.load(out / "model.pt", weights_only=True)
    assert "transformer.blocks.0.att_proj.weight" in weights and "transformer.ff_out.weight" in weights

    from_sharded, from_unsharded = _restored(sharded), _restored(out)
    _assert_same_state(from_sharded, from_unsharded)
    assert from_unsharded[2]["global_step"] == 3
    assert torch.equal(from_unsharded[2]["rng"][0]["torch"], from_sharded[2]["rng"][0]["torch"])

    losses = {}
    for name, load_path in (("resume_sharded", sharded), ("resume_unsharded", out)):
        record: list = []
        args = (f"--load_path={load_path}", "--max_duration=6", f"--save_folder={tmp_path / name}")
        assert run_train(config, *args, record=record) == 0
        losses[name] = [(r["step"], r["train/CrossEntropyLoss"]) for r in record]
    assert [step for step, _ in losses["resume_unsharded"]] == [4, 5, 6]
    assert losses["resume_unsharded"] == losses["resume_sharded"]


def test_model_only_and_safetensors(sharded_run):
    tmp_path, _ = sharded_run
    out = unshard_command.unshard(
        str(tmp_path / "run/step3"), str(tmp_path / "weights"), model_only=True, safetensors=True
    )
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.yaml", "model.safetensors", "train.pt"]
    _assert_same_state(_restored(tmp_path / "run/step3", False), _restored(out, False))


def test_refuses_bad_inputs_and_an_existing_output(sharded_run, tmp_path):
    run_dir, _ = sharded_run
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    result = _run_script(not_a_checkpoint, tmp_path / "out")
    assert result.returncode != 0
    assert "OLMoCheckpointError" in result.stderr and "is not a checkpoint: it holds nothing" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()

    unshard = unshard_command.unshard
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(OLMoCheckpointError, match="already exists"):
        unshard(str(run_dir / "run/step3"), str(existing))
    assert list(existing.iterdir()) == [], "nothing may be written into an existing directory"

    unsharded = unshard(str(run_dir / "run/step3"), str(tmp_path / "step3-unsharded"), model_only=True)
    with pytest.raises(OLMoCheckpointError, match="already an unsharded checkpoint"):
        unshard(str(unsharded), str(tmp_path / "again"))


@pytest.mark.slow
def test_two_rank_fsdp_checkpoint_unshards_to_what_the_trainer_writes(tmp_path):
    """A 2-rank FSDP run saves sharded and unsharded at the same step; unsharding the sharded one in one
    process reproduces the trainer's own unsharded files, down to every rank's RNG state (about 13 s)."""
    config = _config(tmp_path, "run", save_interval_unsharded=3)
    result = run_torchrun(2, config)
    assert result.returncode == 0, result.stderr[-4000:]
    out = unshard_command.unshard(str(tmp_path / "run/step3"), str(tmp_path / "out"))
    for name in ("model.pt", "optim.pt", "train.pt"):
        expected = torch.load(tmp_path / "run/step3-unsharded" / name, weights_only=True)
        assert _equal(torch.load(out / name, weights_only=True), expected), name


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b
