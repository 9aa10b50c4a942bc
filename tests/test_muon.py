"""Muon (issue 29): its update against a reference written here with plain torch (and torch's own AdamW for the
parameters Muon leaves to AdamW), its split of the parameters, and exact resume."""

import copy
import json
import math

import pytest
import torch

from olmo.config import OptimizerConfig, TrainConfig
from olmo.model import OLMo
from olmo.optim import build_optimizer, get_param_groups
from olmo.optim.muon import Muon
from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config

LR, WD, MU, STEPS = 0.02, 0.1, 0.95, 5


def _model() -> OLMo:
    torch.manual_seed(0)
    cfg = TrainConfig.from_dict(tiny_config_dict("/tmp/unused", ["x.npy"]))
    return OLMo(cfg.model)


def _orthogonalize(m: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic Newton-Schulz iteration, written out: X <- 3.4445 X - 4.7750 (X X^T) X + 2.0315 (X X^T)^2 X."""
    x = m.double()
    flip = x.size(0) > x.size(1)
    if flip:
        x = x.t()
    x = x / (x.pow(2).sum().sqrt() + 1e-7)
    for _ in range(steps):
        a = x @ x.t()
        x = 3.4445 * x - 4.7750 * (a @ x) + 2.0315 * (a @ (a @ x))
    return (x.t() if flip else x).float()


def _grads(model: OLMo, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_muon_updates_the_block_matrices_and_adamw_the_rest_as_written_out_here():
    ours = _model()
    reference = copy.deepcopy(ours)
    cfg = OptimizerConfig(name="muon", learning_rate=LR, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    optimizer = build_optimizer(cfg, ours)
    assert isinstance(optimizer, Muon)
    muon_names = {n for g in optimizer.param_groups if g["use_muon"] for n in g["param_names"]}
    assert muon_names == {
        f"transformer.blocks.{b}.{m}.weight" for b in (0, 1) for m in ("att_proj", "attn_out", "ff_proj", "ff_out")
    }  # not the embedding, the output layer or the norms

    # The reference: torch's AdamW over the same AdamW groups, Muon by hand for the block matrices.
    named = dict(reference.named_parameters())
    adam_groups = []
    for group in get_param_groups(cfg, reference):
        params = [named[n] for n, _ in group["params"] if n not in muon_names]
        adam_groups.append({"params": params, "weight_decay": group["weight_decay"]})
    adamw = torch.optim.AdamW(adam_groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    momentum = {n: torch.zeros_like(named[n]) for n in muon_names}

    for step in range(1, STEPS + 1):
        grads = _grads(ours, step)
        for n, p in ours.named_parameters():
            p.grad = grads[n].clone()
        optimizer.step()
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.grad = grads[n].clone()
            adamw.step()
            for n in muon_names:
                p = named[n]
                momentum[n] = MU * momentum[n] + grads[n]
                o = _orthogonalize(grads[n] + MU * momentum[n])
                p.mul_(1 - LR * WD)
                p.sub_(LR * 0.2 * math.sqrt(max(p.shape)) * o)
        for n, p in ours.named_parameters():
            torch.testing.assert_close(p, named[n], rtol=1e-5, atol=1e-6, msg=f"step {step}: {n}")
    # The orthogonalized update is what Muon promises: singular values near 1.
    o = _orthogonalize(torch.randn(64, 32))
    s = torch.linalg.svdvals(o)
    assert 0.6 < s.min() and s.max() < 1.25


def test_a_muon_run_resumes_exactly_and_its_state_is_refused_for_adamw(tmp_path):
    data = tmp_path / "a.npy"
    write_byte_memmap(data, 30_000)
    overrides = {"optimizer.name": "muon", "optimizer.learning_rate": 0.01, "max_duration": 6, "save_interval": 3}
    whole = write_config(tmp_path / "whole.yaml", tiny_config_dict(tmp_path / "whole", [str(data)], **overrides))
    parts = write_config(tmp_path / "parts.yaml", tiny_config_dict(tmp_path / "parts", [str(data)], **overrides))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_train(whole) == 0
        assert run_train(parts, "--stop_at=3") == 0
        assert run_train(parts, "--try_load_latest_save") == 0
    finally:
        torch.set_num_threads(before)

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train/CrossEntropyLoss"] for r in rows if "train/CrossEntropyLoss" in r}

    assert losses(tmp_path / "parts") == losses(tmp_path / "whole")
    from olmo.exceptions import OLMoCheckpointError

    with pytest.raises(OLMoCheckpointError, match="muon's"):
        run_train(
            parts,
            f"--load_path={tmp_path / 'parts' / 'step3'}",
            "--optimizer.name=adamw",
            f"--save_folder={tmp_path / 'x'}",
        )
