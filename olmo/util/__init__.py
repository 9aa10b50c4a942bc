"""The bottom of the stack: what every layer may use, none of it about models or training.

This module: logging (rank-aware), the CLI environment, path and URL helpers, machine facts. Its modules:
``launch`` (rank and world size from torchrun's or Slurm's variables, before any process group), ``rng`` (capture
and restore every RNG), ``json_lines`` (JSON-lines files), ``object_store`` (S3-API and GCS clients),
``checkpoint_dirs`` (the commit marker and checkpoint discovery without torch, for the config resolver
``${path.last_checkpoint:...}``), ``tokenizer_files`` (where a tokenizer identifier's file comes from),
``olmo_helpers`` (``clean_opt``, ``dir_is_empty``, ``flatten_dict``: names the original OLMo's scripts import),
``atomic`` (the one atomic file write: ``atomic_write``, ``atomic_file``) and ``retry`` (the one retry loop with
backoff: ``call_with_retries``, ``Backoff``), both re-exported here.
``env_rank``/``env_world_size``/``launch_env`` are re-exported here.

May import: ``olmo.exceptions`` only.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, Union

from ..exceptions import OLMoCliError, OLMoError
from .atomic import atomic_file, atomic_write
from .bounded_files import read_bounded
from .launch import LaunchEnv, env_rank, env_world_size, expand_hostlist, launch_env
from .olmo_helpers import clean_opt, dir_is_empty, flatten_dict
from .retry import Backoff, call_with_retries
from .secrets import RedactingFilter, redact_text, redact_url

__all__ = [
    "prepare_cli_environment",
    "install_excepthook",
    "setup_logging",
    "is_url",
    "redact_url",
    "error_message",
    "lost_peer",
    "resource_path",
    "LaunchEnv",
    "launch_env",
    "expand_hostlist",
    "env_rank",
    "env_world_size",
    "machine_info",
    "nearest_existing",
    "remove_path",
    "result_file_problem",
    "write_result_file",
    "atomic_file",
    "atomic_write",
    "Backoff",
    "call_with_retries",
    "default_file_mode",
    "unwritable_reason",
    "REMOTE_SDKS",
    "REMOTE_DATA_SCHEMES",
    "split_remote",
    "missing_slash_problem",
    "local_path_of",
    "remote_save_folder_problems",
    "clean_opt",
    "dir_is_empty",
    "flatten_dict",
]

log = logging.getLogger(__name__)

_URL = re.compile(r"^[A-Za-z0-9]+://")
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
_LOST_PEER_SIGNS = (
    "Connection reset by peer",  # gloo, the peer's socket closed mid-read
    "Connection closed by peer",  # gloo
    "remote worker",  # gloo's advice in both of the above
    "NCCL communicator was aborted",
    "ncclRemoteError",  # NCCL: a remote peer failed or disconnected
)


def lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another process of the job died (its connection closed);
    that process's own log holds the real cause."""
    if any(cls.__name__ == "DistNetworkError" for cls in type(e).__mro__):
        return True
    return any(sign in str(e) for sign in _LOST_PEER_SIGNS)


class _RankFilter(logging.Filter):
    """Let INFO and below through on rank 0 only; warnings and errors come from every rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.rank == 0 or record.levelno > logging.INFO


def setup_logging(level: int = logging.INFO) -> None:
    """Configure the root logger once: rank-aware, plain when not on a TTY, rich otherwise."""
    rank = env_rank()
    handler: logging.Handler
    if sys.stderr.isatty() and os.environ.get("OLMo_NONINTERACTIVE") is None:
        from rich.logging import RichHandler

        handler = RichHandler(show_path=False, markup=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_RankFilter(rank))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)
    for noisy in ("urllib3", "filelock", "cached_path", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _excepthook(exctype: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
    if issubclass(exctype, KeyboardInterrupt):
        # One line, with where it stopped (what someone pressing Ctrl-C on a command that seems stuck wants to know);
        # the training loop handles its own Ctrl-C and says how to resume.
        where = traceback.extract_tb(tb)[-1] if tb is not None else None
        at = f" in {where.name} ({where.filename}:{where.lineno})" if where is not None else ""
        print(f"\nKeyboardInterrupt: interrupted (Ctrl-C){at}; stopped.", file=sys.stderr)
    elif issubclass(exctype, OLMoError):
        # A problem the user can fix: one paragraph, no traceback.
        print(f"\n{exctype.__name__}: {redact_text(error_message(value))}\n", file=sys.stderr)
    elif issubclass(exctype, OSError) and getattr(value, "errno", None) in _DISK_ERRNOS:
        # A full disk or read-only file system met outside a checkpoint save (metrics, logs, data order).
        reason = getattr(value, "strerror", None) or value
        message = (
            f"could not write '{getattr(value, 'filename', None)}': {reason}. Free some space (or fix the "
            f"permissions) and relaunch with --try_load_latest_save; committed checkpoints are never modified after "
            f"their commit."
        )
        print(f"\n{exctype.__name__}: {redact_text(message)}\n", file=sys.stderr)
    elif lost_peer(value):
        # Not this rank's fault: the traceback would only point at the collective that noticed.
        first_line = str(value).strip().splitlines()[0] if str(value).strip() else exctype.__name__
        message = (
            f"this rank lost its connection to another process of the job ({first_line[:300]}). That process stopped "
            f"first: its log says why. Relaunch the job with --try_load_latest_save (or let torchrun --max-restarts or "
            f"the scheduler do it): it continues from the newest committed checkpoint."
        )
        print(f"\n{exctype.__name__}: {redact_text(message)}\n", file=sys.stderr)
    else:
        log.critical("Uncaught %s: %s", exctype.__name__, value, exc_info=(exctype, value, tb))


def install_excepthook() -> None:
    sys.excepthook = _excepthook


def exit_process(code: int) -> None:
    """End a command with ``code``. In a process of a multi-process launch (``WORLD_SIZE`` > 1), after flushing
    the logs and streams, without the interpreter's finalization: there, gloo's threads are now and then torn down
    while still joinable, and the C++ runtime aborts a rank whose run had finished ("terminate called without an
    active exception", exit -6; RESEARCH_LOG 2026-11-23 and 2026-11-25), which torchrun reports as a failure."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def prepare_cli_environment() -> None:
    """Everything a script does before parsing its arguments."""
    install_excepthook()  # first: a launch environment that cannot work is reported by the next line
    setup_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Share the node's cores among the processes on it (all of them without a launcher).
    local_processes = launch_env().local_world_size
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local_processes)))
    warnings.filterwarnings("ignore", message=".*register_new_resolver.*")
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    # DCP warns when it saves without a process group; one process is a supported setup here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def is_url(path: Union[str, Path]) -> bool:
    return bool(_URL.match(str(path)))


def error_message(error: BaseException) -> str:
    """The message of ``error`` as its raiser wrote it. An exception raised in a DataLoader worker reaches the
    training process re-created by torch with the worker's traceback in its message; this returns just the
    original message that follows it."""
    text = str(error)
    if "\nOriginal Traceback" not in text:
        return text
    cls = type(error)
    marker = f"\n{cls.__module__}.{cls.__qualname__}: "
    return text.rpartition(marker)[2].rstrip("\n") if marker in text else text


def resource_path(path: Union[str, Path]) -> Path:
    """A local path for ``path``: itself when local, otherwise downloaded through cached-path."""
    if not is_url(path):
        return Path(path)
    from cached_path import cached_path

    from .remote_files import (
        REMOTE_TIMEOUT_ENV,
        RemoteAccessDenied,
        RemoteTimeoutError,
        denied_status,
        install_timed_http_client,
        is_timeout,
        remote_timeout,
    )

    install_timed_http_client()  # cached-path's own HTTP client would wait forever for a silent server
    shown = redact_url(str(path))
    try:
        # quiet: cached-path's progress line would show the URL unmasked; the log line is masked.
        log.info("Fetching %s (or reading it from cached-path's cache).", shown)
        return Path(cached_path(str(path), quiet=True))
    except Exception as e:  # cached-path raises many types (HTTP, boto, FileNotFound)
        if is_timeout(e):
            raise RemoteTimeoutError(
                f"Could not fetch '{shown}': the server did not answer within {remote_timeout():g} s "
                f"(to connect, or between two pieces of its answer). Check that the URL's server is up and reachable "
                f"from this machine; set {REMOTE_TIMEOUT_ENV}=SECONDS to wait longer."
            ) from None
        status = denied_status(e)
        if status is not None:
            raise RemoteAccessDenied(
                f"Access to '{shown}' was denied (HTTP {status}). Check the credentials: a user:password@ in the URL "
                f"or, better, a ~/.netrc entry for its host (machine HOST login USER password PASSWORD), both sent "
                f"as HTTP Basic; for s3:// and gs://, the environment's credentials."
            ) from None
        raise OLMoCliError(f"Could not fetch '{shown}': {e}. Check the URL and your network access.") from None


def default_file_mode(path: Union[str, Path]) -> None:
    """Give a file the permissions a plain ``open(path, "w")`` would (``0o666`` less the umask): files written
    through ``tempfile.mkstemp`` or by libraries that do (safetensors) are otherwise readable by their owner only."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (setting it to read it back races with
    other threads that create files)."""
    shown = _proc_field("/proc/self/status", "Umask")
    if shown is not None and shown.isdigit():
        return int(shown, 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


RESULT_FILE_LIMIT = 64 << 20
"""The largest earlier result a command reads to decide whether it may write over it."""


def result_file_problem(path: Path, keys: tuple[str, ...]) -> Optional[str]:
    """Why a command must not write its JSON result to ``path``, or None: a link, a folder, a folder that cannot be
    written, or an existing file that is not an earlier result of the same command (a JSON object with ``keys``).
    Writing over an earlier result is allowed; over anything else (a config, a system file) it is not."""
    if path.is_symlink():
        return f"it is a symlink (to '{os.readlink(path)}'); give the file itself"
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        try:  # a FIFO or a device is no earlier result, and is never read (it would block or never end)
            existing = json.loads(read_bounded(path, RESULT_FILE_LIMIT))
        except (OLMoError, ValueError, RecursionError):
            existing = None
        if not isinstance(existing, dict) or not all(k in existing for k in keys):
            return "it exists and is not an earlier result of this command, so it is never written over"
    return unwritable_reason(path.parent)


def write_result_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (:func:`~olmo.util.atomic.atomic_write`): a
    crash never leaves half a file, and a reader (another process, another rank on this machine) sees the old file
    or the new one. A failed write removes its temporary file and raises the ``OSError``."""
    atomic_write(path, text)


def remove_path(path: Union[str, Path]) -> None:
    """Delete ``path`` without ever following a symlink: a link (even one to a directory) or a file is unlinked,
    a real directory is removed with its contents (``shutil.rmtree`` unlinks the links inside it). What a link points
    to is never touched: it may belong to another run."""
    import shutil

    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its closest ancestor that does."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable_reason(folder: Path) -> Optional[str]:
    """Why ``folder`` cannot be created or written into, or None when it can: the folder (or, if it does
    not exist yet, its closest existing ancestor) must be a folder this user may write to."""
    anchor = nearest_existing(folder)
    if not anchor.is_dir():
        return f"'{anchor}' is a file, not a folder"
    if not os.access(anchor, os.W_OK | os.X_OK):
        return f"'{anchor}' is read-only for this user (or on a read-only file system)"
    return None


def _proc_field(path: str, field: str) -> Optional[str]:
    """The value of the first ``field: value`` line of a /proc file, or None."""
    if not Path(path).is_file():
        return None
    for line in Path(path).read_text().splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def machine_info() -> dict[str, Any]:
    """Facts about this machine that benchmark results record next to their numbers."""
    import platform

    import torch

    mem_total = _proc_field("/proc/meminfo", "MemTotal")  # "24684924 kB"
    return {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name"),
        "platform": platform.platform(),
        "mem_total_gb": round(int(mem_total.split()[0]) * 1024 / 1e9, 1) if mem_total else None,
        # Taken as the benchmark starts: other processes competing for the CPUs and the disk slow every number.
        "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


_REMOTE = re.compile(r"^([A-Za-z0-9]+)://([^/]*)/?(.*)$")
REMOTE_DATA_SCHEMES = ("http", "https", "s3", "r2", "weka", "gs")
"""URL schemes that token files, label masks and evaluator data may use: read in place, by byte range."""
REMOTE_SDKS = {"s3": "boto3", "r2": "boto3", "gs": "google.cloud.storage"}  # pip names: "." -> "-"


_SCHEME_MISSING_A_SLASH = re.compile(r"^(s3|r2|gs|weka|https?|file|hf):/?(?!/)(.*)$", re.IGNORECASE)


def missing_slash_problem(value: Optional[str], key: str) -> Optional[str]:
    """The problem with a path that is a URL with a slash missing (``s3:/bucket/x``, ``https:host/x``), which would
    otherwise name a local folder ``s3:`` in the working directory; None for anything else."""
    match = _SCHEME_MISSING_A_SLASH.match(value or "")
    if match is None:
        return None
    scheme, rest = match.group(1).lower(), match.group(2).lstrip("/")
    return (
        f"{key}={redact_url(str(value))!r} is a {scheme}:// URL with a slash missing; as written it would name a local "
        f"folder '{scheme}:' in the working directory. Write it as {scheme}://{redact_url(rest)}."
    )


def split_remote(remote: str) -> tuple[str, str, str]:
    """(scheme, bucket, prefix) of a URL; ("", "", remote) for a plain path."""
    match = _REMOTE.match(remote)
    return (match.group(1).lower(), match.group(2), match.group(3)) if match else ("", "", remote)


def local_path_of(remote: str) -> Path:
    """The local folder a plain path or ``file://`` URL names."""
    return Path(remote[len("file://") :] if remote.startswith("file://") else remote).expanduser()


def remote_save_folder_problems(remote: Optional[str], save_folder: Optional[str] = None) -> list[str]:
    """What stops checkpoints from being uploaded to ``remote`` (``remote_save_folder``), for config validation.

    Checks the scheme, the bucket, the client library and (for ``r2://``) the environment; nothing is
    contacted. Credentials are only checked by the first upload.

    :param save_folder: the local ``save_folder``, which a local ``remote`` must differ from.
    """
    if remote is None:
        return []
    problem = missing_slash_problem(remote, "remote_save_folder")
    if problem is not None:
        return [problem]
    where = f"remote_save_folder={remote!r}"
    if not remote.strip():
        return [f"{where} is empty. Set it to s3://BUCKET/PREFIX, r2://, gs://, file://, a folder, or null."]
    scheme, bucket, _ = split_remote(remote)
    if scheme in ("", "file"):
        path = local_path_of(remote)
        if save_folder is not None and path.resolve() == Path(save_folder).expanduser().resolve():
            return [f"{where} is save_folder itself; uploads must go elsewhere. Set another folder or null."]
        reason = unwritable_reason(path)
        return [f"{where} cannot receive checkpoints: {reason}. Set a writable folder or null."] if reason else []
    if scheme not in REMOTE_SDKS:
        return [
            f"{where}: checkpoints cannot be uploaded to {scheme}:// URLs. Use s3://BUCKET/PREFIX, "
            f"r2://BUCKET/PREFIX, gs://BUCKET/PREFIX, a file:// URL or a local folder (or null to upload nothing)."
        ]
    problems = []
    if not bucket:
        problems.append(f"{where} names no bucket. Write it as {scheme}://BUCKET/PREFIX.")
    module, package = REMOTE_SDKS[scheme], REMOTE_SDKS[scheme].replace(".", "-")
    try:
        __import__(module)
    except ImportError:
        problems.append(f"{where} needs the {package} package, which is not installed: pip install {package}")
    if scheme == "r2":
        if not os.environ.get("R2_ENDPOINT_URL"):
            problems.append(
                f"{where} needs the R2 endpoint: export R2_ENDPOINT_URL=https://ACCOUNT_ID.r2.cloudflarestorage.com"
            )
        keys = os.environ.get("R2_ACCESS_KEY_ID") and os.environ.get("R2_SECRET_ACCESS_KEY")
        if not keys and not os.environ.get("R2_PROFILE"):
            problems.append(
                f"{where} needs R2 credentials: export R2_PROFILE=NAME (a profile in ~/.aws/credentials) or "
                f"both R2_ACCESS_KEY_ID and R2_SECRET_ACCESS_KEY."
            )
    return problems
