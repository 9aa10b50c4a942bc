"""WSD schedules and decay branches (issue 29): a checkpoint of a stable run, resumed with a shorter
``max_duration`` and a ``t_decay``, trains exactly as a run configured to decay there from the start."""

import json
from pathlib import Path

import pytest
import torch

from olmo.testing import run_train, tiny_config_dict, write_byte_memmap, write_config

N, D = 6, 4  # branch at step 6, decay over 4 steps


@pytest.fixture(autouse=True)
def one_thread():
    """Bitwise comparisons between runs of this process: the same arithmetic in each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(tmp_path: Path, name: str, data: Path, **overrides) -> Path:
    cfg = tiny_config_dict(
        tmp_path / name,
        [str(data)],
        **{"scheduler.name": "wsd", "scheduler.t_warmup": 2, "scheduler.alpha_f": 0.0, **overrides},
    )
    return write_config(tmp_path / f"{name}.yaml", cfg)


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "train/CrossEntropyLoss" in r}


@pytest.mark.parametrize("units", ["steps", "tokens"])
def test_a_decay_branch_of_a_stable_run_is_the_run_that_decays_there(tmp_path, units):
    data = tmp_path / "a.npy"
    write_byte_memmap(data, 30_000)
    scale = 1 if units == "steps" else 8 * 32  # tokens per step of the tiny config
    common = {"scheduler.units": units, "scheduler.t_warmup": 2 * scale, "save_interval_unsharded": N + D}

    # Configured from the start to decay over the last D of N + D steps.
    planned = _config(tmp_path, "planned", data, max_duration=N + D, **{**common, "scheduler.t_decay": D * scale})
    assert run_train(planned) == 0
    # A stable run (no decay) planned for far longer; only its checkpoint at step N is used.
    stable = _config(
        tmp_path, "stable", data, max_duration=10 * N, save_interval=N, **{**common, "scheduler.t_decay": 0}
    )
    assert run_train(stable, f"--stop_at={N}") == 0
    # The decay branch: that checkpoint resumed with the shorter length and the decay, into a new folder.
    branch = tmp_path / "branch"
    assert (
        run_train(
            stable,
            f"--load_path={tmp_path / 'stable' / f'step{N}'}",
            f"--max_duration={N + D}",
            f"--scheduler.t_decay={D * scale}",
            f"--save_folder={branch}",
        )
        == 0
    )
    planned_rows, stable_rows, branch_rows = _rows(tmp_path / "planned"), _rows(tmp_path / "stable"), _rows(branch)
    assert sorted(branch_rows) == list(range(N + 1, N + D + 1))
    for step in range(1, N + 1):  # the stable phase is the planned run's, bitwise
        assert stable_rows[step]["train/CrossEntropyLoss"] == planned_rows[step]["train/CrossEntropyLoss"], step
        assert stable_rows[step]["optim/learning_rate_group0"] == planned_rows[step]["optim/learning_rate_group0"]
    for step in range(N + 1, N + D + 1):
        for key in ("train/CrossEntropyLoss", "optim/learning_rate_group0", "optim/total_grad_norm"):
            assert branch_rows[step][key] == planned_rows[step][key], (step, key)
    lrs = [branch_rows[s]["optim/learning_rate_group0"] for s in range(N + 1, N + D + 1)]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] == 0.0  # it decays, to alpha_f = 0 at the end
    final = f"step{N + D}-unsharded/model.pt"
    mine, theirs = (torch.load(p / final, weights_only=True) for p in (branch, tmp_path / "planned"))
    assert all(torch.equal(mine[k], v) for k, v in theirs.items())
