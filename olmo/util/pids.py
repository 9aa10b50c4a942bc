"""Processes as ``/proc`` shows them (Linux): a process's state and parent, whether it is alive, and how to end a
command together with every process it started. Standard library only.

A command started with a token in its environment (``NAME=VALUE``) passes it to everything it starts, so
:func:`kill_tagged` finds all of them, also torchrun's workers, which live in sessions of their own (a signal to the
command's process group never reaches them) and outlive their parent when it is killed first.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path

__all__ = ["stat", "alive", "tagged", "kill_tagged"]


def stat(pid: int) -> tuple[str, int]:
    """(state, parent pid) of a process; the command name may hold spaces, so split after ')'."""
    state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return stat(pid)[0] != "Z"
    except OSError:
        return False


def tagged(name: str, value: str) -> list[int]:
    """The live processes whose environment holds ``name=value``."""
    needle = f"{name}={value}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with suppress(OSError):  # gone, or a zombie
                if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") and alive(int(entry)):
                    pids.append(int(entry))
    return pids


def kill_tagged(name: str, value: str, timeout: float = 5.0) -> None:
    """SIGKILL every process whose environment holds ``name=value`` until none is left alive (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while (pids := tagged(name, value)) and time.monotonic() < deadline:
        for pid in pids:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
