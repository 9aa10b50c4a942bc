"""Writing a file so that a reader finds the old content or the whole new one, never a part: the new content goes
into a hidden temporary sibling, which is fsynced and then renamed over the file (a rename within one directory is
atomic on POSIX). A crash, a full disk or an exception in the writer leaves the old file as it was and no temporary
file behind.

This is the one place where the package renames a file into place; ``tests/test_layering.py`` checks that.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Union

__all__ = ["atomic_file", "atomic_write"]


@contextmanager
def atomic_file(path: Union[str, Path]) -> Iterator[BinaryIO]:
    """A binary file to write the new content of ``path`` into; when the block ends, it is flushed, fsynced and
    renamed over ``path``. If the block (or the rename) raises, the temporary file is removed and the exception
    propagates: ``path`` is untouched.

    The temporary file is ``.{name}.tmp-XXXXXXXX`` in the same directory, made with the permissions a plain
    ``open(path, "wb")`` gives a new file (``0o666`` less the umask); so is ``path`` afterwards, whatever the
    permissions of the file it replaces.

    :param path: the file to write; its folder is created if missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    # O_EXCL: never write into someone else's file, even one that happens to have this name.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Union[str, Path], data: Union[bytes, str]) -> None:
    """Write ``data`` (a ``str`` as UTF-8) to ``path`` through :func:`atomic_file`.

    :raises OSError: if it cannot be written; ``path`` is then as it was.
    """
    with atomic_file(path) as out:
        out.write(data.encode() if isinstance(data, str) else data)
