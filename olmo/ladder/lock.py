"""One launch at a time per size of a ladder: ``ladder.py run`` holds a lock while it trains a size.

Two launches of one size would write into the same run (its config in ``DIR/configs/`` and its save folder), each
taking the other's checkpoints for its own. The lock is an exclusive, non-blocking ``flock`` on
``DIR/.locks/SIZE.rank{R}.lock``: every rank of a launch holds its own file (the ranks of one launch must not refuse
each other), so rank R of a second launch meets rank R of the first. Different sizes of one ladder may run at
once: they share no file. The operating system releases a lock when its process ends, however it ends, so a lock
file left behind never blocks anything and is never deleted (deleting it would let two launches lock two files).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..exceptions import OLMoCliError
from ..util import unwritable_reason

__all__ = ["run_lock"]

log = logging.getLogger(__name__)


@contextmanager
def run_lock(ladder_dir: Path, size: str, rank: int = 0) -> Iterator[Path]:
    """Hold the lock of ``size`` in the ladder folder ``ladder_dir`` for rank ``rank`` of a launch; yield its path.

    :raises OLMoCliError: when another process holds it (naming the folder and that process), or the folder cannot
        be written.
    """
    folder = ladder_dir / ".locks"
    problem = unwritable_reason(folder)
    if problem is not None:
        raise OLMoCliError(
            f"The ladder folder '{ladder_dir}' (--dir) cannot be written: {problem}. Give another --dir."
        )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{size}.rank{rank}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a file system without locks (some NFS mounts)
                log.warning("Cannot lock %s (%s): a second launch of size %s would not be refused.", path, e, size)
            else:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that has not said"
                raise OLMoCliError(
                    f"Size {size!r} of the ladder in '{ladder_dir}' is being trained by another launch right now "
                    f"({holder} holds '{path}'): a second launch would write into the same run. Wait for that one "
                    f"to end (or stop it) before launching this size again. The lock goes away with its process, so "
                    f"there is no file to delete."
                ) from None
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"PID {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock; the file stays (see the module's docstring)
