"""Muon under FSDP2 (issue 29): two gloo ranks train as one process, a checkpoint written on two ranks resumes on
one, and it unshards to exactly what the two-rank run writes itself."""

import json

import numpy as np
import torch

from olmo.cli import unshard as unshard_command
from olmo.testing import run_torchrun, run_train, tiny_config_dict, write_byte_memmap, write_config

MUON = {"optimizer.name": "muon", "optimizer.learning_rate": 0.01, "max_duration": 6}


def _losses(run) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/CrossEntropyLoss"] for r in rows if "train/CrossEntropyLoss" in r}


def test_two_fsdp_ranks_train_with_muon_as_one_process_and_reshard(tmp_path):
    data = tmp_path / "a.npy"
    write_byte_memmap(data, 30_000)

    def config(name, **extra):
        return write_config(
            tmp_path / f"{name}.yaml", tiny_config_dict(tmp_path / name, [str(data)], **MUON, **extra)
        )

    assert run_train(config("one", save_interval_unsharded=6)) == 0
    two = run_torchrun(2, config("two", save_interval=3, save_interval_unsharded=3), timeout=180)
    assert two.returncode == 0, two.stderr[-4000:]
    one_losses, two_losses = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two_losses) == list(range(1, 7))
    np.testing.assert_allclose(
        [two_losses[s] for s in range(1, 7)], [one_losses[s] for s in range(1, 7)], rtol=1e-5
    )
    final = torch.load(tmp_path / "two/step6-unsharded/model.pt", weights_only=True)
    expected = torch.load(tmp_path / "one/step6-unsharded/model.pt", weights_only=True)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-4, atol=1e-5, msg=key)

    # The sharded step-3 checkpoint of the two ranks: unshards to the trainer's own unsharded files (momentum
    # buffers and AdamW moments included), and resumes in one process where the one-process run went.
    out = unshard_command.unshard(str(tmp_path / "two/step3"), str(tmp_path / "unsharded"))
    for name in ("model.pt", "optim.pt"):
        mine = torch.load(out / name, weights_only=True)
        theirs = torch.load(tmp_path / "two/step3-unsharded" / name, weights_only=True)
        assert json.dumps(_shapes(mine), sort_keys=True) == json.dumps(_shapes(theirs), sort_keys=True), name
        assert _equal(mine, theirs), name
    assert any("momentum_buffer" in s for s in torch.load(out / "optim.pt", weights_only=True)["state"].values())
    resumed = config("resumed")
    assert run_train(resumed, f"--load_path={tmp_path / 'two/step3'}") == 0
    resumed_losses = _losses(tmp_path / "resumed")
    np.testing.assert_allclose(
        [resumed_losses[s] for s in (4, 5, 6)], [one_losses[s] for s in (4, 5, 6)], rtol=1e-5
    )


def _shapes(obj):
    if isinstance(obj, torch.Tensor):
        return list(obj.shape)
    if isinstance(obj, dict):
        return {str(k): _shapes(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_shapes(v) for v in obj]
    return obj


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b
