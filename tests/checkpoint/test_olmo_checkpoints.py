"""Checkpoints written by the original OLMo trainer (ai2-olmo 0.6.0) resume here exactly where it stopped.

The fixtures under tests/fixtures/olmo_checkpoints/ were written by the original ``Trainer.fit()`` in its own
virtualenv (``make_fixtures.sh``): 4 steps on ``tokens.npy``, checkpoint at step 2, and the original's logits
after step 4 on a fixed input. Resuming here from step 2 and training steps 3-4 must land on those logits,
which holds only if the weights, the AdamW moments and step counts, the learning-rate position and the data
position all carried over.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from olmo.checkpoint import inspect_checkpoint, load_checkpoint
from olmo.checkpoint.olmo_formats import load_train_state
from olmo.config import TrainConfig
from olmo.exceptions import OLMoCheckpointError
from olmo.model import OLMo
from olmo.optim import build_optimizer
from olmo.testing import run_main, run_torchrun, run_train

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "olmo_checkpoints"
TOKENS = FIXTURES / "tokens.npy"


def _resume(checkpoint: Path, save_folder: Path, *extra: str) -> Path:
    """Resume the original's run from ``checkpoint`` with our trainer up to step 4; return our step-4 checkpoint."""
    code = run_train(
        checkpoint / "config.yaml",
        f"--load_path={checkpoint}",
        f"--save_folder={save_folder}",
        f"--data.paths=[{TOKENS}]",
        "--distributed_strategy=single",
        "--save_interval_unsharded=2",
        "--wandb=null",
        *extra,
    )
    assert code == 0
    return save_folder / "step4-unsharded"


def _logits(checkpoint: Path, input_ids: torch.Tensor) -> torch.Tensor:
    cfg = TrainConfig.load(checkpoint / "config.yaml")
    model = OLMo(cfg.model)
    model.load_state_dict(torch.load(checkpoint / "model.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits


def _max_diff_to_original(run: str, ours: Path) -> float:
    reference = torch.load(FIXTURES / run / "reference.pt", weights_only=True)
    return float((_logits(ours, reference["input_ids"]) - reference["logits"]).abs().max())


@pytest.mark.parametrize(
    "run, step_dir",
    [("ddp", "step2-unsharded"), ("fsdp_unsharded", "step2-unsharded"), ("torch_new", "step2")],
)
def test_resume_from_an_original_checkpoint_continues_the_original_run(run, step_dir, tmp_path):
    checkpoint = FIXTURES / run / step_dir
    assert not (checkpoint / ".olmo-checkpoint.json").exists()  # as the original wrote it
    ours = _resume(checkpoint, tmp_path / "run")
    # The original's own step-4 logits, to float rounding (the step-2 weights are 3e-2 away).
    assert _max_diff_to_original(run, ours) < 1e-6
    if (checkpoint / "model.pt").is_file():
        assert _max_diff_to_original(run, checkpoint) > 1e-2
    state = torch.load(ours / "train.pt", weights_only=True)
    assert (state["global_step"], state["global_train_examples_seen_this_epoch"]) == (4, 16)
    assert state["global_train_tokens_seen"] == 4 * 4 * 16


def test_a_fresh_optimizer_does_not_reach_the_original(tmp_path):
    """The check above can fail: without the original's AdamW moments the run lands elsewhere."""
    ours = _resume(FIXTURES / "ddp" / "step2-unsharded", tmp_path / "run", "--reset_optimizer_state")
    assert _max_diff_to_original("ddp", ours) > 1e-3


def test_two_ranks_resume_an_original_torch_new_checkpoint(tmp_path):
    checkpoint = FIXTURES / "torch_new" / "step2"
    result = run_torchrun(
        2,
        checkpoint / "config.yaml",
        f"--load_path={checkpoint}",
        f"--save_folder={tmp_path / 'run'}",
        f"--data.paths=[{TOKENS}]",
        "--distributed_strategy=fsdp",
        "--save_interval_unsharded=2",
        "--wandb=null",
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "World size changed" not in result.stderr  # saved by 2 ranks: each rank's RNG is restored
    assert _max_diff_to_original("torch_new", tmp_path / "run" / "step4-unsharded") < 1e-6


def test_olmo_core_checkpoint_converts_with_one_command_and_resumes(tmp_path):
    checkpoint = FIXTURES / "olmo_core" / "step2"
    with pytest.raises(OLMoCheckpointError, match="convert_olmo_checkpoint.py"):
        inspect_checkpoint(str(checkpoint))
    converted = tmp_path / "step2-converted"
    assert run_main("convert_olmo_checkpoint.py", checkpoint, converted) == 0
    assert (converted / ".olmo-checkpoint.json").is_file()
    train = torch.load(converted / "train.pt", weights_only=True)
    assert set(train["rng"]) == {0, 1}  # both ranks' RNG, from train/rank0.pt and train/rank1.pt
    ours = _resume(converted, tmp_path / "run")
    assert _max_diff_to_original("olmo_core", ours) < 1e-6
    with pytest.raises(OLMoCheckpointError, match="already exists"):
        run_main("convert_olmo_checkpoint.py", checkpoint, converted)


def test_optimizer_moments_and_trainer_state_carry_over(tmp_path):
    checkpoint = FIXTURES / "ddp" / "step2-unsharded"
    cfg = TrainConfig.load(checkpoint / "config.yaml")
    model = OLMo(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model)
    state = load_checkpoint(inspect_checkpoint(str(checkpoint)), model, optimizer)
    assert state is not None
    assert (state["global_step"], state["global_train_examples_seen_this_epoch"], state["world_size"]) == (2, 8, 1)
    # DDP's optim.pt is keyed by parameter index with "module."-prefixed names in its param groups.
    original = torch.load(checkpoint / "optim.pt", weights_only=True)
    by_name = {}
    for group in original["param_groups"]:
        for name, index in zip(group["param_names"], group["params"]):
            assert name.startswith("module.")
            by_name[name[len("module.") :]] = original["state"][index]
    params = dict(model.named_parameters())
    assert set(by_name) == set(params)
    for name, values in by_name.items():
        ours = optimizer.state[params[name]]
        assert torch.equal(ours["exp_avg"], values["exp_avg"]) and torch.equal(
            ours["exp_avg_sq"], values["exp_avg_sq"]
        )
        assert float(ours["step"]) == 2.0
    # This run's hyperparameters, not the checkpoint's (OLMo re-derives them from the config too).
    assert [g["weight_decay"] for g in optimizer.param_groups] == [
        g["weight_decay"] for g in original["param_groups"]
    ]


def test_wrapper_prefixes_in_parameter_names_are_removed(tmp_path):
    source = FIXTURES / "fsdp_unsharded" / "step2-unsharded"
    target = tmp_path / "step2-unsharded"
    shutil.copytree(source, target)
    model_sd = torch.load(source / "model.pt", weights_only=True)
    renamed = {k.replace("blocks.", "blocks._fsdp_wrapped_module.", 1): v for k, v in model_sd.items()}
    torch.save({f"module.{k}": v for k, v in renamed.items()}, target / "model.pt")
    cfg = TrainConfig.load(target / "config.yaml")
    model = OLMo(cfg.model)
    load_checkpoint(inspect_checkpoint(str(target)), model, build_optimizer(cfg.optimizer, model))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in model_sd.items())


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_train_pt_allows_paths_and_numpy_rng_but_nothing_else(tmp_path):
    state = load_train_state(FIXTURES / "ddp" / "step2-unsharded" / "train.pt")
    assert state["global_step"] == 2 and state["rng"]["numpy"][0] == "MT19937"
    crafted = tmp_path / "train.pt"
    torch.save({"global_step": 2, "checkpoints": [Path("/x")], "evil": _Payload()}, crafted)
    with pytest.raises(OLMoCheckpointError, match="Refusing to load"):
        load_train_state(crafted)


def test_olmo_core_param_groups_are_unpickled_without_any_class(tmp_path):
    from olmo.checkpoint.olmo_formats import _unpickle_plain

    plain = torch.frombuffer(bytearray(pickle.dumps({"lr": 1e-3, "_param_names": ["a"]})), dtype=torch.uint8)
    assert _unpickle_plain(plain, "group")["_param_names"] == ["a"]
    evil = torch.frombuffer(bytearray(pickle.dumps(_Payload())), dtype=torch.uint8)
    with pytest.raises(OLMoCheckpointError, match="Refusing to load group"):
        _unpickle_plain(evil, "group")


def test_unknown_incomplete_and_unsupported_directories_get_clear_errors(tmp_path):
    unknown = tmp_path / "step7"
    unknown.mkdir()
    (unknown / "notes.txt").write_text("x")
    with pytest.raises(OLMoCheckpointError, match=r"holds notes\.txt.*Expected"):
        inspect_checkpoint(str(unknown))
    partial = tmp_path / "step2"
    shutil.copytree(FIXTURES / "torch_new" / "step2", partial)
    (partial / "config.yaml").unlink()
    with pytest.raises(OLMoCheckpointError, match="not a committed checkpoint.*torch_new layout"):
        inspect_checkpoint(str(partial))
    legacy = tmp_path / "step3"
    legacy.mkdir()
    (legacy / "rank0.pt").write_bytes(b"")
    (legacy / "config.yaml").write_text("{}")
    with pytest.raises(OLMoCheckpointError, match="torch_legacy layout.*unshard.py"):
        inspect_checkpoint(str(legacy))


@pytest.mark.parametrize("shape", [[2**40, 2**30], [-64, 32], [64, 64]])
def test_an_olmo_core_shape_the_shards_cannot_fill_is_refused_before_allocating(tmp_path, shape):
    import json

    checkpoint = tmp_path / "step2"
    shutil.copytree(FIXTURES / "olmo_core" / "step2", checkpoint)
    meta_path = checkpoint / "model" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["tensors"]["transformer.wte.weight"]["shape"] = shape
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(
        OLMoCheckpointError, match=r"olmo_core checkpoint folder '.*model'.*transformer\.wte\.weight"
    ):
        run_main("convert_olmo_checkpoint.py", checkpoint, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_an_original_train_pt_whose_step_is_not_a_number_is_refused_before_any_write(tmp_path):
    checkpoint = tmp_path / "step2-unsharded"
    shutil.copytree(FIXTURES / "ddp" / "step2-unsharded", checkpoint)
    state = load_train_state(checkpoint / "train.pt")
    state["global_step"] = "2x"
    torch.save(state, checkpoint / "train.pt")
    with pytest.raises(
        OLMoCheckpointError, match=r"train\.pt' is damaged: global_step is '2x', not a whole number"
    ):
        _resume(checkpoint, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    with pytest.raises(OLMoCheckpointError, match=r"global_step is '2x'"):
        run_main("convert_olmo_checkpoint.py", checkpoint, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()
