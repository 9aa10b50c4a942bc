"""Reading a user-supplied file with its type and size bounded before any byte is read, and zip archives with their
directory, member names and each member's unpacked size bounded.

* :func:`open_regular` / :func:`read_bounded`: regular files only (a symlink is followed and its target must be one),
  of at most a stated size. The type is checked with ``stat`` before opening and again on the open descriptor, which
  is opened non-blocking: a FIFO, a device (``/dev/zero``), a socket or a directory is refused without waiting on it
  or reading from it, even if one is swapped in between the two checks.
* :func:`read_tail`: the last bytes of a regular file (a log), however long it has grown.
* :func:`open_zip` / :func:`read_member`: a zip archive whose end record, member count, declared unpacked total and
  every member name (no absolute path, ``..``, backslash, drive letter, control character or symlink) are checked
  before use; a member is read in chunks and refused as soon as it unpacks past its limit, whatever its header says.

Every refusal is one paragraph: ``error`` (an :class:`~olmo.exceptions.OLMoError` type the caller chooses) whose
message starts with ``what``, the caller's name for the file (its flag or key and path). Standard library only.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO, Optional, Union

from ..exceptions import OLMoDataError, OLMoError

__all__ = [
    "open_regular",
    "read_bounded",
    "read_tail",
    "open_zip",
    "read_member",
    "member_name_problem",
    "kind_of",
    "size_text",
]

PathLike = Union[str, "os.PathLike[str]"]
ErrorType = type[OLMoError]
CHUNK = 1 << 16
"""Bytes read per step from a zip member."""
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_EOCD_SIZE = 22
_DIRECTORY_ENTRY_MAX = 512
"""Bytes a central-directory entry may take on average (46 fixed, the rest name and extra fields)."""


def size_text(n: int) -> str:
    """``n`` bytes for a message: ``512 bytes``, ``4.0 KiB``, ``64.0 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def kind_of(mode: int) -> str:
    """What a ``stat`` mode is, in words ("a regular file", "a named pipe (FIFO)", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(error: ErrorType, what: str, problem: str) -> OLMoError:
    return error(f"{what} {problem}.")


def _checked(st: os.stat_result, limit: int, what: str, error: ErrorType) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = kind_of(st.st_mode)
        raise _refuse(
            error, what, f"is {kind}, not a regular file: only regular files (or symlinks to them) are read"
        )
    if st.st_size > limit:
        raise _refuse(error, what, f"is {size_text(st.st_size)}, over its limit of {size_text(limit)}")


def open_regular(path: PathLike, limit: int, what: str = "", error: ErrorType = OLMoDataError) -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file (a symlink's target must be one) of at most ``limit``
    bytes; never blocks on a FIFO or reads from a device.

    :param what: how a refusal names the file, e.g. ``"--wheels file '/x/a.whl'"`` (default: the quoted path).
    :param error: the exception type raised for a refusal.
    :raises error: for a missing, unreadable, non-regular or too large file.
    """
    what = what or f"'{path}'"
    try:
        _checked(os.stat(path), limit, what, error)  # os.stat never opens: a FIFO is refused before any open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        dangling = os.path.islink(path)
        raise _refuse(
            error, what, "is a symlink whose target does not exist" if dangling else "does not exist"
        ) from None
    except OSError as e:
        raise _refuse(error, what, f"cannot be read ({e.strerror or e})") from None
    try:
        _checked(os.fstat(fd), limit, what, error)  # the same check on what was opened, in case it was swapped
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: PathLike, limit: int, what: str = "", error: ErrorType = OLMoDataError) -> bytes:
    """The whole content of the regular file ``path`` of at most ``limit`` bytes (:func:`open_regular`); a file
    that grows past ``limit`` while it is read is refused too."""
    what = what or f"'{path}'"
    with open_regular(path, limit, what, error) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _refuse(error, what, f"grew past its limit of {size_text(limit)} while it was read")
    return data


def read_tail(path: PathLike, limit: int, what: str = "", error: ErrorType = OLMoDataError) -> bytes:
    """The last ``limit`` bytes (at most) of the regular file ``path``, of any size."""
    with open_regular(path, 1 << 62, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - limit))
        return f.read(limit)


def member_name_problem(name: str) -> Optional[str]:
    """Why an archive member's name is unsafe to unpack or list as fine, or None: it must be a relative path with
    ``/`` separators that stays inside the folder it is unpacked into."""
    if not name:
        return "is empty"
    if re.search(r"[\x00-\x1f\x7f]", name):
        return "holds a control character (NUL, newline, ...)"
    if "\\" in name:
        return "holds a backslash (a Windows path separator)"
    if name.startswith("/"):
        return "is an absolute path"
    if re.match(r"[A-Za-z]:", name):
        return "starts with a drive letter"
    if ".." in name.split("/"):
        return "has a '..' component (it leaves the folder it is unpacked into)"
    return None


def _check_end_record(f: BinaryIO, max_members: int, what: str, error: ErrorType) -> None:
    """Refuse an archive whose end record announces more than ``max_members`` members or a central directory larger
    than they need, before :mod:`zipfile` reads that directory into memory (it parses it by its size, not its count).
    Without an end record the archive is left to :mod:`zipfile` to refuse."""
    size = f.seek(0, os.SEEK_END)
    tail_start = max(0, size - (1 << 16) - _EOCD_SIZE)
    f.seek(tail_start)
    tail = f.read()
    last = tail[-_EOCD_SIZE:]
    # Where zipfile looks: the record at the very end when it has no comment, else the last signature in the tail.
    at = len(tail) - _EOCD_SIZE if last[:4] == _EOCD and last[-2:] == b"\0\0" else tail.rfind(_EOCD)
    record = tail[at : at + _EOCD_SIZE] if at >= 0 else b""
    if len(record) < _EOCD_SIZE:
        return
    count, directory_size = struct.unpack("<10xHL6x", record)
    f.seek(max(0, tail_start + at - 20))
    if f.read(4) == _ZIP64_LOCATOR or count == 0xFFFF or directory_size == 0xFFFFFFFF:
        raise _refuse(
            error, what, "is a ZIP64 archive (for more than 65,535 members or 4 GiB); those are not read"
        )
    if count > max_members or directory_size > max_members * _DIRECTORY_ENTRY_MAX:
        raise _refuse(
            error,
            what,
            f"is a zip archive of {count:,} members ({size_text(directory_size)} of directory); at most "
            f"{max_members:,} are read",
        )


@contextmanager
def open_zip(
    path: PathLike,
    limit: int,
    what: str = "",
    error: ErrorType = OLMoDataError,
    max_members: int = 20_000,
    max_unpacked: Optional[int] = None,
    kind: str = "zip archive",
) -> Iterator[zipfile.ZipFile]:
    """The zip archive ``path`` (a regular file of at most ``limit`` bytes, :func:`open_regular`), open for the
    ``with`` block, once its member count, declared unpacked total and every member name have been checked.

    :param max_members: the most members it may have.
    :param kind: what the archive is, for a refusal ("wheel").
    :param max_unpacked: the most bytes its members may declare together (what unpacking it writes; unpacking with
        :mod:`zipfile` never yields more than a member declares), or None for no limit.
    :raises error: for a file :func:`open_regular` refuses, one that is not a readable zip archive, too many members,
        too large a total, a member that is a symlink, or an unsafe member name (:func:`member_name_problem`).
    """
    what = what or f"'{path}'"
    with open_regular(path, limit, what, error) as f:
        try:
            _check_end_record(f, max_members, what, error)
            archive = zipfile.ZipFile(f)
            archive.filename = str(path)  # it was given the open file, whose name is its descriptor
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise _refuse(error, what, f"is not a readable {kind} ({e})") from None
        with archive:
            members = archive.infolist()
            if len(members) > max_members:
                raise _refuse(error, what, f"has {len(members):,} members; at most {max_members:,} are read")
            for info in members:
                problem = member_name_problem(info.orig_filename)
                if problem is None and stat.S_ISLNK(info.external_attr >> 16):
                    problem = "is a symlink"
                if problem:
                    raise _refuse(
                        error, what, f"holds a member {info.orig_filename!r} that {problem}; it is refused"
                    )
            total = sum(info.file_size for info in members)
            if max_unpacked is not None and total > max_unpacked:
                raise _refuse(
                    error, what, f"unpacks to {size_text(total)}, over its limit of {size_text(max_unpacked)}"
                )
            yield archive


def read_member(
    archive: zipfile.ZipFile, name: str, limit: int, what: str = "", error: ErrorType = OLMoDataError
) -> bytes:
    """Member ``name`` of ``archive`` unpacked, read in chunks and refused as soon as it passes ``limit`` bytes (the
    size its header declares is not trusted)."""
    what = what or f"'{archive.filename}'"
    data = bytearray()
    try:
        with archive.open(name) as member:
            while chunk := member.read(CHUNK):
                data += chunk
                if len(data) > limit:
                    past = f"has a member '{name}' that unpacks past its limit of {size_text(limit)}"
                    raise _refuse(error, what, past)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, NotImplementedError, KeyError) as e:
        # RuntimeError: an encrypted member; NotImplementedError: a compression method zipfile lacks.
        raise _refuse(error, what, f"has a member '{name}' that cannot be unpacked ({e})") from None
    return bytes(data)
