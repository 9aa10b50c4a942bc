"""Launched processes in tests: start a command in its own session, find its torchrun workers, kill all of it.

Every process :func:`launch` starts carries a unique token in its environment; on exit it SIGKILLs every process
holding the token (:func:`olmo.util.pids.kill_tagged`). That also catches torchrun's workers, which live in their own
sessions and would survive a kill of the agent alone. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from ..util.pids import alive, kill_tagged, stat

__all__ = ["TOKEN_VAR", "alive", "launch", "returncode", "tail", "wait_until", "workers"]

TOKEN_VAR = "OLMO_CRASH_TEST_TOKEN"


@contextmanager
def launch(cmd: list[str], log: Path, **env_vars: str) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in its own session, stdout+stderr appended to ``log``; on exit SIGKILL it and every
    process it started (found by the token in their environment), whatever happened."""
    token = uuid.uuid4().hex
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", TOKEN_VAR: token, **env_vars}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        kill_tagged(TOKEN_VAR, token)
        proc.wait(timeout=30)


def workers(agent: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the torchrun agent's live worker processes."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with suppress(OSError, ValueError, StopIteration):
            state, ppid = stat(int(entry))
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if ppid == agent.pid and state != "Z" and b"train.py" in cmdline:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                rank = next(int(v[len(b"RANK=") :]) for v in environ if v.startswith(b"RANK="))
                found[rank] = int(entry)
    return found


def wait_until(
    condition: Callable[[], object],
    proc: subprocess.Popen,
    log: Path,
    what: str,
    timeout: float = 120,
    poll: float = 0.01,
) -> None:
    """Poll ``condition`` until it holds; fail with the log's tail when ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s:\n{tail(log)}")
        time.sleep(poll)


def returncode(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s:\n{tail(log)}")


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]
