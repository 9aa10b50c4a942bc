"""Checkpoints written by OLMo-core's trainer (ai2-olmo-core 3.0.0, OLMo 3) convert into a model that computes what
OLMo-core's own model computes.

tests/fixtures/olmo_core_v3/ was written in OLMo-core's own virtualenv (``make_fixture.sh``): OLMo 3 7B's
architecture shrunk (GQA, QK-norm, reordered norm, RoPE theta 500,000, windows [8, 8, 8, full]) trained two steps
by OLMo-core's ``Trainer`` with SkipStepAdamW, its ``step2/`` as the trainer saved it, the ``config.json`` the same
run writes for four other model configs on the same weights (no window; YaRN, or Llama 3.1's scaling, on the
full-attention layers; the first layer forced to full attention, which shifts OLMo-core's pattern), and OLMo-core's
fp32 logits for each.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from olmo.checkpoint import inspect_checkpoint, load_checkpoint, load_model
from olmo.config import TrainConfig
from olmo.exceptions import OLMoCheckpointError, OLMoConfigurationError
from olmo.model import OLMo
from olmo.optim import build_optimizer
from olmo.testing import run_main, run_train

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "olmo_core_v3"
REFERENCE = torch.load(FIXTURE / "reference.pt", weights_only=True)


def _checkpoint(tmp_path: Path, variant: str = "window") -> Path:
    """A copy of the fixture's ``step2/`` whose config.json is ``variant``'s."""
    checkpoint = tmp_path / "step2"
    shutil.copytree(FIXTURE / "step2", checkpoint)
    shutil.copyfile(FIXTURE / "configs" / f"{variant}.json", checkpoint / "config.json")
    return checkpoint


def _convert(checkpoint: Path, target: Path, *flags: str) -> Path:
    assert run_main("convert_olmo_checkpoint.py", checkpoint, target, *flags) == 0
    return target


VARIANTS = ["window", "full", "yarn", "llama3", "first_layer"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_model_computes_olmo_cores_logits(variant, tmp_path):
    converted = _convert(_checkpoint(tmp_path, variant), tmp_path / "converted")
    model, cfg, _ = load_model(str(converted))
    with torch.no_grad():
        logits = model(REFERENCE["input_ids"]).logits
    assert float((logits - REFERENCE[variant]).abs().max()) < 1e-5
    windows = {
        "window": [8, 8, 8, None],
        "full": [None] * 4,
        "yarn": [8, 8, 8, None],
        "llama3": [8, 8, 8, None],
        "first_layer": [None, 8, 4, None],
    }
    assert cfg.model.layer_windows() == windows[variant]
    scaling = cfg.model.rope_scaling
    assert (scaling.name if scaling else None) == {"yarn": "yarn", "llama3": "llama3"}.get(variant)


def test_the_variants_differ_so_the_logits_check_can_fail():
    """Each variant's logits are far from the others' (a converter that dropped the window or YaRN would fail)."""
    for i, a in enumerate(VARIANTS):
        for b in VARIANTS[i + 1 :]:
            assert float((REFERENCE[a] - REFERENCE[b]).abs().max()) > 1e-2, (a, b)


def test_adamw_moments_land_in_the_fused_projections(tmp_path):
    converted = _convert(_checkpoint(tmp_path), tmp_path / "converted")
    cfg = TrainConfig.load(converted / "config.yaml")
    assert (cfg.optimizer.name, cfg.optimizer.learning_rate, cfg.optimizer.betas) == ("adamw", 1e-2, (0.9, 0.95))
    model = OLMo(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model)
    load_checkpoint(inspect_checkpoint(str(converted)), model, optimizer, load_trainer_state=False)
    params = dict(model.named_parameters())
    att_proj = optimizer.state[params["transformer.blocks.0.att_proj.weight"]]
    ff_proj = optimizer.state[params["transformer.blocks.1.ff_proj.weight"]]
    w_k = REFERENCE["optim"]["blocks.0.attention.w_k.weight"]  # rows 48..71 of att_proj: [q (48); k (24); v (24)]
    w1 = REFERENCE["optim"]["blocks.1.feed_forward.w1.weight"]  # the gate: the second half of ff_proj
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(att_proj[key][48:72], w_k[key])
        assert torch.equal(ff_proj[key][48:], w1[key])
    assert all(float(optimizer.state[p]["step"]) == float(w_k["step"]) == 2.0 for p in params.values())


def test_converted_checkpoint_fine_tunes_here(tmp_path):
    converted = _convert(_checkpoint(tmp_path, "yarn"), tmp_path / "converted")
    tokens = tmp_path / "tokens.npy"
    np.random.default_rng(0).integers(2, 250, size=8 * 32).astype(np.uint16).tofile(tokens)
    code = run_train(
        converted / "config.yaml",
        f"--load_path={converted}",
        "--reset_trainer_state",
        f"--save_folder={tmp_path / 'run'}",
        f"--data.paths=[{tokens}]",
        "--global_train_batch_size=2",
        "--device_train_microbatch_size=2",
        "--max_duration=2",
        "--distributed_strategy=single",
        "--save_interval_unsharded=2",
        "--wandb=null",
    )
    assert code == 0
    assert torch.load(tmp_path / "run" / "step2-unsharded" / "train.pt", weights_only=True)["global_step"] == 2


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


class _Payload:
    def __reduce__(self) -> Any:
        return (print, ("this must never run",))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "no config.json": (lambda c: (c / "config.json").unlink(), r"config\.json' is missing"),
    "damaged config.json": (lambda c: _truncate(c / "config.json"), r"config\.json' is damaged"),
    "no .metadata.json": (lambda c: (c / ".metadata.json").unlink(), r"no \.metadata\.json.*did not finish"),
    "no DCP metadata": (lambda c: (c / "model_and_optim" / ".metadata").unlink(), r"\.metadata' is missing"),
    "crafted DCP metadata": (
        lambda c: (c / "model_and_optim" / ".metadata").write_bytes(pickle.dumps(_Payload())),
        r"Refusing to read .*\.metadata'",
    ),
    "truncated shard": (lambda c: _truncate(c / "model_and_optim" / "__0_0.distcp"), r"incomplete|truncated"),
    "missing shard": (lambda c: (c / "model_and_optim" / "__0_3.distcp").unlink(), r"incomplete|missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_or_missing_files_are_refused_before_any_write(damage, tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path)
    harm, message = DAMAGE[damage]
    harm(checkpoint)
    with pytest.raises(OLMoCheckpointError, match=message):
        _convert(checkpoint, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()
    assert not list(tmp_path.glob(".converted*"))  # no temporary directory left either
    assert "this must never run" not in capsys.readouterr().out


def _edit(cfg: dict[str, Any], change: str) -> None:
    """One OLMo-core option our model lacks, set in a real config.json."""
    model = cfg["model"]
    mixer = model["block"]["sequence_mixer"]
    if change == "moe":
        model["block"]["name"] = "moe_reordered_norm"
        model["block"]["feed_forward_moe"] = {"num_experts": 8, "hidden_size": 32}
    elif change == "rope per layer type":  # with_rope_scaling(..., full_attn_layers_only=False)
        mixer["rope"]["scaling"] = model["block_overrides"].pop("3")["sequence_mixer"]["rope"]["scaling"]
    elif change == "head-wise qk-norm":
        mixer["use_head_qk_norm"] = True
    elif change == "zero window":
        mixer["sliding_window"]["pattern"] = [0, -1]
    elif change == "yarn ramp":
        model["block_overrides"]["3"]["sequence_mixer"]["rope"]["scaling"]["old_context_len"] = 2**40


@pytest.mark.parametrize(
    "change, message",
    [
        ("moe", r"model\.block is a mixture-of-experts block"),
        (
            "rope per layer type",
            r"rope\.scaling \(with model\.block_overrides\) is set on layers \[0, 1, 2, 3\] \(full attention: \[3\]\)"
            r".*per layer type",
        ),
        ("head-wise qk-norm", r"sequence_mixer\.use_head_qk_norm=True has no counterpart"),
        ("zero window", r"model\.sliding_window\.pattern=\[0, -1\] holds \[0\]"),
        ("yarn ramp", r"ramp ends past the last frequency"),
    ],
)
def test_unsupported_olmo_core_models_are_refused_naming_the_option(change, message, tmp_path):
    checkpoint = _checkpoint(tmp_path, "yarn")
    cfg = json.loads((checkpoint / "config.json").read_text())
    _edit(cfg, change)
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        OLMoConfigurationError, match=f"cannot be represented by our model exactly; nothing was written.*{message}"
    ):
        _convert(checkpoint, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_every_problem_of_a_config_is_reported_at_once(tmp_path):
    checkpoint = _checkpoint(tmp_path, "yarn")
    cfg = json.loads((checkpoint / "config.json").read_text())
    _edit(cfg, "head-wise qk-norm")
    cfg["model"]["embed_scale"] = 8.0
    cfg["model"]["block"]["sequence_mixer"]["some_future_option"] = 1
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OLMoConfigurationError) as refused:
        _convert(checkpoint, tmp_path / "converted")
    text = str(refused.value)
    assert (
        "use_head_qk_norm" in text
        and "model.embed_scale=8.0" in text
        and "some_future_option=1 is unknown" in text
    )


def test_load_path_at_an_olmo_core_checkpoint_says_to_convert_it(tmp_path):
    """--load_path pointed straight at OLMo-core's stepN/ is refused before anything is written, with the command
    that converts it (not as a save of ours that did not finish)."""
    from olmo.exceptions import OLMoCheckpointError
    from olmo.testing import run_main, tiny_config_dict, write_config

    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(tmp_path / "a.npy")]))
    with pytest.raises(OLMoCheckpointError, match="checkpoint of OLMo-core's trainer") as e:
        run_main("train.py", config, f"--load_path={FIXTURE / 'step2'}")
    assert "convert_olmo_checkpoint.py" in str(e.value) and not (tmp_path / "run").exists()
