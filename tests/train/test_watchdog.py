"""The hang watchdog (``stability.watchdog``, issue 27) against real hangs: a data server that accepts requests and
never answers them (one process), and one that hangs only the byte range of an instance that rank 1 reads at step
3 (two gloo ranks under torchrun): the stuck rank writes its stacks and exits with 76, and so does the other one.
No test asserts a time: a watchdog that did not fire would leave the run waiting on the server for minutes, past
the subprocess timeout."""

import re
from pathlib import Path

import numpy as np

from olmo.config import TrainConfig
from olmo.data import IterableDataset, build_memmap_dataset
from olmo.testing import run_script, run_torchrun, tiny_config_dict, write_byte_memmap, write_config
from olmo.testing.http import FileServer
from olmo.train.watchdog import EXIT_CODE_HANG

SEQ = 32


def _served(tmp_path: Path) -> Path:
    served = tmp_path / "served"
    served.mkdir()
    write_byte_memmap(served / "a.npy", 100 * 8 * SEQ)
    return served


def _config(run: Path, url: str, **overrides) -> dict:
    settings = {
        "max_duration": 6,
        "save_interval_unsharded": None,
        "stability.watchdog.enabled": True,
        "stability.watchdog.data_wait": 3.0,
        "stability.watchdog.forward_backward": 60.0,
        "data.remote": {"timeout_seconds": 600.0, "max_attempts": 1},
    }
    return tiny_config_dict(run, [url], **{**settings, **overrides})


def test_a_rank_waiting_on_a_silent_data_server_writes_its_stacks_and_exits(tmp_path):
    served = _served(tmp_path)
    run = tmp_path / "run"
    with FileServer(served, stall_seconds=900) as server:
        # Every read past the first 8 kB hangs; the start-up (sizes, the first 1 kB for an npy header) still answers.
        server.hang_range = (8192, 2**62)
        config = write_config(tmp_path / "c.yaml", _config(run, server.url("a.npy")))
        result = run_script("train.py", config, timeout=240)
    assert result.returncode == EXIT_CODE_HANG, result.stderr[-3000:]
    text = (run / "hang-rank0.txt").read_text()
    assert text.startswith("Watchdog of rank 0") and re.search(r"phase data_wait of step \d", text), text[:500]
    assert "over its limit of 3 s" in text
    assert "Thread 0x" in text and "Current thread" not in text.splitlines()[0]
    assert "remote" in text  # the stack of the thread stuck reading the data
    assert "Watchdog: rank 0 ends the run" in result.stderr and "hang-rank0.txt" in result.stderr


def test_one_stuck_rank_of_two_ends_both_and_both_leave_their_stacks(tmp_path):
    """Rank 1 waits for an instance of step 3 that never comes (the server hangs that byte range only); rank 0
    waits for rank 1 in the step's first collective. Rank 1's watchdog fires (data_wait), rank 0 follows."""
    served = _served(tmp_path)
    run = tmp_path / "run"
    with FileServer(served, stall_seconds=900) as server:
        cfg_dict = _config(run, server.url("a.npy"), **{"data.remote.prefetch_bytes": 1})
        cfg = TrainConfig.from_dict(cfg_dict)
        order = IterableDataset(build_memmap_dataset(cfg, cfg.data), 8, seed=cfg.seed).global_indices()
        stuck = int(order[2 * 8 + 1])  # step 3, rank 1 of 2 (ranks take alternate instances of the batch)
        server.hang_range = (stuck * SEQ * 2, (stuck + 1) * SEQ * 2)  # bytes of a uint16 instance
        config = write_config(tmp_path / "c.yaml", cfg_dict)
        result = run_torchrun(2, config, timeout=240)
    assert result.returncode != 0
    stuck_rank = (run / "hang-rank1.txt").read_text()
    assert "phase data_wait of step 3" in stuck_rank, stuck_rank[:500]
    other = (run / "hang-rank0.txt").read_text()
    assert "another rank hung (hang-rank1.txt)" in other and "step 3" in other, other[:500]
    assert f"exitcode: {EXIT_CODE_HANG}" in result.stderr or f"exit code {EXIT_CODE_HANG}" in result.stderr.lower()
    assert np.fromfile(run / "train_data" / "global_indices.npy", dtype=np.uint32)[17] == stuck


class _SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.connections: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)

    def close(self):
        self.sock.close()
        for conn in self.connections:
            conn.close()


def test_a_load_path_on_a_silent_server_fails_in_bounded_time_with_one_paragraph(tmp_path):
    import os
    import subprocess
    import sys

    served = _served(tmp_path)
    config = write_config(tmp_path / "c.yaml", tiny_config_dict(tmp_path / "run", [str(served / "a.npy")]))
    silent = _SilentServer()
    try:
        env = {**os.environ, "WANDB_MODE": "disabled", "OLMO_REMOTE_TIMEOUT": "2"}
        script = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
        result = subprocess.run(
            [
                sys.executable,
                str(script),
                str(config),
                f"--load_path=http://127.0.0.1:{silent.port}/step5-unsharded",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        silent.close()
    assert result.returncode != 0
    assert "the server did not answer within 2 s" in result.stderr and "OLMO_REMOTE_TIMEOUT" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_uploads_to_a_silent_s3_endpoint_hold_the_finished_run_only_as_long_as_upload_wait(tmp_path):
    import os
    import subprocess
    import sys

    served = _served(tmp_path)
    run = tmp_path / "run"
    cfg = tiny_config_dict(
        run,
        [str(served / "a.npy")],
        max_duration=4,
        save_interval_unsharded=4,
        remote_save_folder="s3://bucket/run",
        **{"stability.watchdog.enabled": True, "stability.watchdog.upload_wait": 3.0},
    )
    config = write_config(tmp_path / "c.yaml", cfg)
    silent = _SilentServer()
    try:
        env = {
            **os.environ,
            "WANDB_MODE": "disabled",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.port}",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        script = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
        result = subprocess.run(
            [sys.executable, str(script), str(config)], env=env, capture_output=True, text=True, timeout=150
        )
    finally:
        silent.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Stopped waiting for the upload of" in result.stderr and "after 3.0 s" in result.stderr
    assert (
        run / "step4-unsharded" / ".olmo-checkpoint.json"
    ).is_file()  # kept locally, uploaded by a later launch
