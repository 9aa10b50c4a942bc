"""SIGTERM is honoured within seconds while the run waits on a data server that never answers: one process saves the
last step it trained and exits with 75, instead of waiting out the retries."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from olmo.checkpoint import find_latest_checkpoint
from olmo.config import TrainConfig
from olmo.data import IterableDataset, build_memmap_dataset
from olmo.testing import REPO, tiny_config_dict, write_byte_memmap, write_config
from olmo.testing.http import FileServer
from olmo.train import EXIT_CODE_STOPPED

SEQ = 32


@contextmanager
def _step_3_held(tmp_path: Path, stall_seconds: float, **settings: Any) -> Iterator[Path]:
    """The config of a run (``tmp_path/run``) that reads its tokens over HTTP, one instance per request, from a
    server that holds the first instance of step 3 for ``stall_seconds`` before answering."""
    served = tmp_path / "served"
    write_byte_memmap(served / "a.npy", 100 * 8 * SEQ)
    remote = {"timeout_seconds": 600.0, "max_attempts": 10, "prefetch_bytes": 1}
    with FileServer(served, stall_seconds=stall_seconds) as server:
        cfg_dict = tiny_config_dict(
            tmp_path / "run",
            [server.url("a.npy")],
            max_duration=50,
            save_interval_unsharded=None,
            **{"data.remote": remote, **settings},
        )
        config = write_config(tmp_path / "c.yaml", cfg_dict)
        cfg = TrainConfig.from_dict(cfg_dict)
        order = IterableDataset(build_memmap_dataset(cfg, cfg.data), 8, seed=cfg.seed).global_indices()
        held = int(order[2 * 8])  # the first instance of step 3
        server.hang_range = (held * SEQ * 2, (held + 1) * SEQ * 2)  # its bytes (uint16)
        yield config


@pytest.mark.parametrize(
    "workers, sig",
    [(0, signal.SIGTERM), (2, signal.SIGINT)],  # Ctrl-C: the whole process group, DataLoader workers included
)
def test_a_signal_during_a_stuck_data_read_saves_and_exits_at_once(tmp_path, workers, sig):
    run = tmp_path / "run"
    with _step_3_held(tmp_path, 600, **{"data.num_workers": workers}) as config:
        cmd = [sys.executable, str(REPO / "scripts/train.py"), str(config)]
        env = {**os.environ, "WANDB_MODE": "disabled", "OLMo_NONINTERACTIVE": "1"}
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            deadline, metrics = time.monotonic() + 120, run / "metrics.jsonl"
            # Step 2 logged: the run now waits for step 3's batch, which the server never sends.
            while not (metrics.is_file() and '"step": 2' in metrics.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 2"
                time.sleep(0.1)
            time.sleep(1.0)
            if workers:
                os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C does
            else:
                proc.send_signal(sig)
            _, stderr = proc.communicate(timeout=30)  # not the 600 s of the read's timeout
        finally:
            proc.kill()
    assert proc.returncode == EXIT_CODE_STOPPED, stderr[-3000:]
    assert f"Received {sig.name} while waiting" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    latest = find_latest_checkpoint(run)
    assert latest is not None and latest.name == "step2-unsharded", stderr[-2000:]


def test_with_two_ranks_a_signal_during_a_slow_read_waits_for_the_step_and_all_save_it(tmp_path):
    """Two ranks, one of which waits seconds for a batch (the server holds one instance of step 3) when SIGTERM
    reaches both (as a scheduler's does): the wait is not cut short, since the other rank is inside the step's
    collectives; the step ends, and both ranks save it together and exit 75. Cutting the wait (as one process does)
    left no checkpoint of the step: the failure CI once saw as a race."""
    from olmo.testing import processes, torchrun_launch

    run = tmp_path / "run"
    with _step_3_held(tmp_path, 4) as config:  # one rank reads the held instance
        cmd, _ = torchrun_launch(2, str(REPO / "scripts/train.py"), str(config))
        log = tmp_path / "torchrun.log"
        with processes.launch(cmd, log) as agent:
            metrics = run / "metrics.jsonl"
            processes.wait_until(
                lambda: metrics.is_file() and '"step": 2' in metrics.read_text(), agent, log, "step 2"
            )
            time.sleep(1.0)  # one rank now waits for the held instance, the other inside step 3's collectives
            for pid in processes.workers(agent).values():
                os.kill(pid, signal.SIGTERM)
            assert processes.returncode(agent, log, timeout=90) == 1  # torchrun's exit; 75 is its root cause
        output = processes.tail(log, 20_000)
    assert "exitcode  : 75" in output or "exitcode: 75" in output.replace("  ", " "), output
    latest = find_latest_checkpoint(run)
    assert latest is not None and latest.name == "step3", output
