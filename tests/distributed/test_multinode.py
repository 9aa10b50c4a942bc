"""Two nodes on one machine (issue 27): two torchrun agents (``--nnodes=2 --nproc_per_node=2``, c10d rendezvous on
127.0.0.1) train with HYBRID_SHARD (one replica per node) like one process, and with ``--max-restarts=1`` a worker
SIGKILLed on the second node restarts the job from its newest committed checkpoint, bitwise equal at the end.

The restart used to fail one time in four (RESEARCH_LOG 2026-11-26, third session): the healthy node's agent
restarted its workers for the membership change without counting a restart, so the two nodes' workers scoped their
store keys by different restart counts and read the dead attempt's addresses. :mod:`olmo.distributed.store` now
gives each launch a namespace of its own."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch

from olmo.checkpoint import find_latest_checkpoint
from olmo.testing import free_port, processes, run_train, tiny_config_dict, write_byte_memmap, write_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
STEPS = 8


def _config(tmp_path: Path, name: str, data: Path) -> Path:
    cfg = tiny_config_dict(
        tmp_path / name,
        [str(data)],
        max_duration=STEPS,
        global_train_batch_size=16,
        save_interval=2,
        save_interval_unsharded=STEPS,  # the final checkpoint is unsharded: its weights compare directly
        **{"fsdp.sharding_strategy": "HYBRID_SHARD"},
    )
    return write_config(tmp_path / f"{name}.yaml", cfg)


@contextmanager
def _agents(config: Path, log: Path, *args: str) -> Iterator[list[subprocess.Popen]]:
    """Two torchrun agents of one job; when the block ends, they and every worker they started are killed."""
    port, job = free_port(), uuid.uuid4().hex[:8]
    rendezvous = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--rdzv_id={job}", *args]
    with ExitStack() as stack:
        yield [
            stack.enter_context(processes.launch([*cmd, str(SCRIPT), str(config), "--try_load_latest_save"], log))
            for _ in range(2)
        ]


def _wait(agents: list[subprocess.Popen], log: Path, timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [a.wait(timeout=max(1.0, deadline - time.monotonic())) for a in agents]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the agents still run after {timeout} s:\n{processes.tail(log)}")


def _rows(run: Path) -> list[tuple[int, float]]:
    """(step, loss) of every logged step, in order; a restarted run logs the steps after its checkpoint again."""
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(r["step"], r["train/CrossEntropyLoss"]) for r in rows if "train/CrossEntropyLoss" in r]


def _losses(run: Path) -> dict[int, float]:
    return dict(_rows(run))


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / f"step{STEPS}-unsharded" / "model.pt", weights_only=True)


@contextmanager
def _srun(config: Path, log: Path, port: int) -> Iterator[list[subprocess.Popen]]:
    """The four tasks ``srun --nodes=2 --ntasks-per-node=2 python scripts/train.py CONFIG`` starts, with the
    variables srun gives each (neither srun nor a second node exists here)."""
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    }
    slurm.update({"SLURM_STEP_NODELIST": "node[1-2]", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cmd = [sys.executable, str(SCRIPT), str(config), "--try_load_latest_save"]
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                processes.launch(
                    cmd, log, **slurm, SLURM_PROCID=str(r), SLURM_NODEID=str(r // 2), SLURM_LOCALID=str(r % 2)
                )
            )
            for r in range(4)
        ]


def _assert_resumed_bitwise(run: Path, log: Path, whole: Path, killed_after: Path) -> None:
    """The run restored one checkpoint (the newest when the kill came, or one committed just after it), trained
    every step after it once more, and every logged loss and the final weights equal the uninterrupted run's."""
    restored = set(re.findall(r"Restoring (\S+) \(", log.read_text(errors="replace")))
    assert len(restored) == 1, processes.tail(log, 6000)
    resumed = int(Path(restored.pop()).name[len("step") :])
    assert resumed >= int(killed_after.name[len("step") :])
    rows, expected_losses = _rows(run), _losses(whole)
    assert [step for step, _ in rows[-(STEPS - resumed) :]] == list(range(resumed + 1, STEPS + 1))
    assert all(loss == expected_losses[step] for step, loss in rows), "a loss differs from the uninterrupted run"
    final, expected = _weights(run), _weights(whole)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[key], value) for key, value in expected.items())


def test_two_node_agents_train_like_one_process_and_restart_after_a_killed_worker(tmp_path):
    """One test, so that the uninterrupted two-node run (18 s here) serves as the reference of both restarts."""
    data = tmp_path / "a.npy"
    write_byte_memmap(data, 100 * 16 * 32)
    one = _config(tmp_path, "one", data)
    assert run_train(one) == 0
    log = tmp_path / "whole.log"
    with _agents(_config(tmp_path, "whole", data), log) as agents:
        assert _wait(agents, log) == [0, 0], processes.tail(log)
    reference, whole = _losses(tmp_path / "one"), _losses(tmp_path / "whole")
    assert sorted(whole) == list(range(1, STEPS + 1))
    for step, loss in reference.items():  # HYBRID_SHARD over two nodes trains as one process
        assert whole[step] == pytest.approx(loss, rel=1e-5), step
    final, expected = _weights(tmp_path / "whole"), _weights(tmp_path / "one")
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-4, atol=1e-5)

    # torchrun --max-restarts=1: the agents restart every worker by themselves.
    run, log = tmp_path / "restarted", tmp_path / "restarted.log"
    with _agents(_config(tmp_path, "restarted", data), log, "--max-restarts=1") as agents:
        # Right as the first checkpoint is committed: the moment that made the old restart fail.
        processes.wait_until(lambda: find_latest_checkpoint(run), agents[1], log, "a checkpoint", timeout=180)
        os.kill(max(processes.workers(agents[1]).items())[1], signal.SIGKILL)
        killed_after = find_latest_checkpoint(run)
        assert _wait(agents, log) == [0, 0], processes.tail(log, 6000)
    _assert_resumed_bitwise(run, log, tmp_path / "whole", killed_after)

    # srun without torchrun: a killed task ends the job step (the others fail fast on the broken connection), and
    # the batch script's next srun (a requeued job) resumes, on the same port.
    run, log, port = tmp_path / "slurm", tmp_path / "slurm.log", free_port()
    config = _config(tmp_path, "slurm", data)
    with _srun(config, log, port) as tasks:
        processes.wait_until(lambda: find_latest_checkpoint(run), tasks[0], log, "a checkpoint", timeout=180)
        tasks[3].kill()
        killed_after = find_latest_checkpoint(run)
        codes = _wait(tasks, log, timeout=120)
    assert codes[3] == -signal.SIGKILL and all(code not in (0, None) for code in codes[:3]), codes
    survivors = log.read_text(errors="replace")
    assert "lost its connection to another process of the job" in survivors or "Another rank" in survivors
    assert "Traceback" not in survivors, processes.tail(log, 6000)  # one paragraph each, not gloo's stack
    with _srun(config, log, port) as tasks:
        assert _wait(tasks, log) == [0, 0, 0, 0], processes.tail(log, 6000)
    _assert_resumed_bitwise(run, log, tmp_path / "whole", killed_after)
