"""Uploading committed checkpoints to ``remote_save_folder``, as OLMo does.

Rank 0 hands each checkpoint to a :class:`CheckpointUploader` right after its commit (before retention
prunes anything). A background thread uploads them one at a time, in commit order, to
``{remote_save_folder}/{stepN or stepN-unsharded}/`` (subdirectories included); training waits for it only in
:meth:`CheckpointUploader.close`, at the end of the run.

* Local paths and ``file://`` URLs: the files are copied into a hidden ``.stepN.upload-*`` directory next
  to the target, fsynced and size-checked, then renamed into place (atomic, like a local commit).
* ``s3://bucket/prefix``: boto3 (credentials and ``AWS_ENDPOINT_URL`` as boto3 reads them; profile
  ``S3_PROFILE``). ``r2://bucket/prefix``: boto3 with ``R2_ENDPOINT_URL``
  (``https://ACCOUNT_ID.r2.cloudflarestorage.com``) and ``R2_ACCESS_KEY_ID``/``R2_SECRET_ACCESS_KEY`` or the
  profile ``R2_PROFILE``, the variables OLMo and cached-path read. ``gs://bucket/prefix``:
  google-cloud-storage (application-default credentials). An object store cannot rename a folder, so the
  marker commits: an earlier copy under the prefix is deleted (its marker first), every other file is
  uploaded and its size checked, and ``.olmo-checkpoint.json`` goes last. A reader that requires the marker
  never sees a partial checkpoint, and a retry replaces whatever a failed attempt left.

A failed upload is logged as an error and retried with backoff; it never changes the local checkpoint and
never stops training. Each checkpoint is hard-linked into a hidden ``.stepN.uploading-*`` snapshot first,
so retention may delete it while it uploads (the disk space is freed when the upload ends).

Retention: as in OLMo, remote checkpoints are never deleted; the ``save_num_*_to_keep`` options prune
``save_folder`` only.
"""

from __future__ import annotations

import abc
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..exceptions import OLMoCheckpointError, OLMoConfigurationError
from ..util import Backoff, call_with_retries, local_path_of, remote_save_folder_problems, split_remote
from ..util.object_store import gcs_client, s3_client
from .safe_reads import MARKER, read_marker
from .save import fsync_tree, replace_dir
from .storage import list_checkpoints

__all__ = [
    "UPLOAD_ATTEMPTS",
    "UPLOAD_BACKOFF_S",
    "CheckpointUploader",
    "UploadOutcome",
    "build_checkpoint_uploader",
    "remote_save_folder_problems",
]

log = logging.getLogger(__name__)

UPLOAD_ATTEMPTS = 3
"""Tries per checkpoint before it is left local-only."""
UPLOAD_BACKOFF_S = 30.0
"""Wait before the second try, doubled before each later one."""


@dataclass
class UploadOutcome:
    """What became of one checkpoint's upload."""

    checkpoint: str
    destination: str
    uploaded: bool
    attempts: int
    seconds: float
    error: Optional[str] = None


@dataclass
class _Job:
    checkpoint: Path
    source: Path
    """A hard-linked snapshot of ``checkpoint``, or ``checkpoint`` itself where links are not possible."""
    files: dict[str, int]
    """Every file (relative path -> size), the marker included."""
    only_if_missing: bool = False
    """Skip the upload when the remote copy already has this checkpoint's marker."""


def _marker_last(files: dict[str, int]) -> list[str]:
    # config.yaml next to last and the marker last: a reader that requires the marker (ours) or config.yaml
    # (the original OLMo's own check for remote checkpoints) never takes a partial upload for a checkpoint.
    return sorted(files, key=lambda rel: (rel == MARKER, rel == "config.yaml", rel))


def _check_size(what: str, actual: Optional[int], expected: int) -> None:
    if actual != expected:
        raise OSError(f"'{what}' has {actual} bytes, expected {expected}")


class _LocalFolder:
    def __init__(self, root: Path):
        self.root = root
        self.url = str(root)

    def remote_marker(self, name: str) -> Optional[bytes]:
        marker = self.root / name / MARKER
        return marker.read_bytes() if marker.is_file() else None

    def upload(self, job: _Job) -> None:
        name = job.checkpoint.name
        target = self.root / name
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f".{name}.upload-*"):  # left by an interrupted attempt
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".{name}.upload-{uuid.uuid4().hex[:8]}"
        try:
            for rel in _marker_last(job.files):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(job.source / rel, tmp / rel)
            sizes = fsync_tree(tmp)
            for rel, size in job.files.items():
                _check_size(str(tmp / rel), sizes.get(rel), size)
            # An existing target is an earlier upload of this step (a run relaunched with --save_overwrite).
            replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class _ObjectStore(abc.ABC):
    def __init__(self, url: str, bucket: str, prefix: str):
        self.url, self.bucket = url, bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""

    @abc.abstractmethod
    def put(self, path: Path, key: str) -> None: ...

    @abc.abstractmethod
    def size(self, key: str) -> Optional[int]: ...

    @abc.abstractmethod
    def read(self, key: str) -> Optional[bytes]: ...

    @abc.abstractmethod
    def keys(self, prefix: str) -> list[str]: ...

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None: ...

    def remote_marker(self, name: str) -> Optional[bytes]:
        return self.read(f"{self.prefix}{name}/{MARKER}")

    def upload(self, job: _Job) -> None:
        prefix = f"{self.prefix}{job.checkpoint.name}/"
        marker = prefix + MARKER
        # Un-commit any earlier copy first, so that a marker is never paired with files of another save.
        existing = self.keys(prefix)
        if marker in existing:
            self.delete([marker])
        self.delete([k for k in existing if k != marker])
        for rel in _marker_last(job.files):
            self.put(job.source / rel, prefix + rel)
            _check_size(f"{self.url}/{prefix}{rel} (uploaded)", self.size(prefix + rel), job.files[rel])


class _S3(_ObjectStore):
    """``s3://`` and ``r2://`` through boto3 (its clients may be used from another thread)."""

    def __init__(self, url: str, scheme: str, bucket: str, prefix: str):
        super().__init__(url, bucket, prefix)
        # Few quick retries inside boto3: a failed attempt is retried whole, after a longer wait.
        self.client = s3_client(scheme, max_attempts=3)

    def put(self, path: Path, key: str) -> None:
        self.client.upload_file(str(path), self.bucket, key)  # multipart and parallel for large files

    def size(self, key: str) -> Optional[int]:
        return self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]

    def read(self, key: str) -> Optional[bytes]:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # the most one request may delete
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            response = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if response.get("Errors"):
                raise OSError(f"could not delete stale objects: {response['Errors'][:3]}")


class _GCS(_ObjectStore):
    """``gs://`` through google-cloud-storage."""

    def __init__(self, url: str, bucket: str, prefix: str):
        super().__init__(url, bucket, prefix)
        self.gcs_bucket = gcs_client().bucket(bucket)

    def put(self, path: Path, key: str) -> None:
        self.gcs_bucket.blob(key).upload_from_filename(str(path))  # resumable for large files

    def size(self, key: str) -> Optional[int]:
        blob = self.gcs_bucket.get_blob(key)
        return None if blob is None else blob.size

    def read(self, key: str) -> Optional[bytes]:
        blob = self.gcs_bucket.get_blob(key)
        return None if blob is None else blob.download_as_bytes()

    def keys(self, prefix: str) -> list[str]:
        return [blob.name for blob in self.gcs_bucket.list_blobs(prefix=prefix)]

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self.gcs_bucket.blob(key).delete()


def _destination(remote: str) -> _LocalFolder | _ObjectStore:
    scheme, bucket, prefix = split_remote(remote)
    if scheme in ("", "file"):
        return _LocalFolder(local_path_of(remote))
    if scheme == "gs":
        return _GCS(remote.rstrip("/"), bucket, prefix)
    return _S3(remote.rstrip("/"), scheme, bucket, prefix)


def _snapshot(checkpoint: Path, files: dict[str, int]) -> Path:
    """Hard-link every file into a hidden sibling directory; ``checkpoint`` itself if that fails."""
    snapshot = checkpoint.parent / f".{checkpoint.name}.uploading-{uuid.uuid4().hex[:8]}"
    try:
        for rel in files:
            (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(checkpoint / rel, snapshot / rel)
        return snapshot
    except OSError as e:
        shutil.rmtree(snapshot, ignore_errors=True)
        log.warning(
            f"Could not hard-link {checkpoint} for its upload ({e}); uploading it in place, so if retention "
            f"deletes it before the upload ends, the upload fails."
        )
        return checkpoint


class CheckpointUploader:
    """Uploads committed checkpoints to ``remote_save_folder`` in a background thread (see the module doc).

    Only rank 0 has one (:func:`build_checkpoint_uploader`): it sees every file of a sharded checkpoint,
    because sharded checkpoints are committed on a ``save_folder`` that all ranks share.

    :param remote_save_folder: a local folder or an ``s3://``, ``r2://``, ``gs://`` or ``file://`` URL.
    :param attempts: tries per checkpoint before it is left local-only.
    :param backoff_s: wait before the second try, doubled before each later one.
    :raises OLMoConfigurationError: if :func:`remote_save_folder_problems` finds a problem or no client can
        be made (an unknown profile, no credentials).
    """

    def __init__(
        self, remote_save_folder: str, attempts: int = UPLOAD_ATTEMPTS, backoff_s: float = UPLOAD_BACKOFF_S
    ):
        problems = remote_save_folder_problems(remote_save_folder)
        if problems:
            raise OLMoConfigurationError(" ".join(problems))
        try:  # made here, not in the upload thread, so that a bad profile or credentials stop the launch
            self.destination = _destination(remote_save_folder)
        except Exception as e:
            raise OLMoConfigurationError(
                f"remote_save_folder={remote_save_folder!r}: cannot make a client for it ({type(e).__name__}: {e}). "
                f"Fix the credentials (profile, keys or application-default login) or set remote_save_folder=null."
            ) from None
        self.attempts, self.backoff_s = attempts, backoff_s
        self.outcomes: list[UploadOutcome] = []
        self._jobs: queue.Queue[Optional[_Job]] = queue.Queue()
        self._unfinished: list[Path] = []
        self._changed = threading.Condition()
        self._abort = threading.Event()
        self._closed = False
        self._cleaned: set[Path] = set()
        self._thread = threading.Thread(target=self._work, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def url(self, checkpoint: Path) -> str:
        return f"{self.destination.url.rstrip('/')}/{checkpoint.name}"

    def submit(self, checkpoint: os.PathLike | str, only_if_missing: bool = False) -> None:
        """Queue a committed checkpoint for upload and return at once. Call it after the commit and before
        retention runs. A bad checkpoint is logged and recorded as a failed outcome, never raised.

        :param only_if_missing: skip it if the remote copy already has its marker.
        """
        assert not self._closed, "submit() after close()"
        path = Path(checkpoint)
        self._remove_stale_snapshots(path.parent)
        try:
            files = {**read_marker(path / MARKER)["files"], MARKER: (path / MARKER).stat().st_size}
            for rel, size in files.items():
                _check_size(str(path / rel), (path / rel).stat().st_size, size)
        except (OLMoCheckpointError, OSError) as e:
            log.error(
                f"Not uploading {path} to {self.url(path)}: it is not a complete committed checkpoint ({e})."
            )
            with self._changed:
                self.outcomes.append(UploadOutcome(str(path), self.url(path), False, 0, 0.0, str(e)))
            return
        with self._changed:
            self._unfinished.append(path)
        self._jobs.put(_Job(path, _snapshot(path, files), files, only_if_missing))

    def submit_missing(self, save_folder: os.PathLike | str) -> None:
        """Queue every committed checkpoint in ``save_folder`` whose remote copy lacks its marker (one that an
        earlier launch did not finish uploading). Call it once at start-up; the remote is checked in the
        background."""
        for info in list_checkpoints(save_folder):
            self.submit(info.path, only_if_missing=True)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every queued upload has finished (or failed for good); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._unfinished, timeout)

    def close(self, timeout: Optional[float] = None) -> list[UploadOutcome]:
        """Wait for the queued uploads (at most ``timeout`` seconds), log how they ended, stop the thread and
        return every outcome. Uploads still running after ``timeout`` are abandoned (no further tries)."""
        if self._closed:
            return self.outcomes
        self._closed = True
        if self._unfinished:
            log.info(f"Waiting for {len(self._unfinished)} checkpoint upload(s) to {self.destination.url} to end.")
        finished = self.wait(timeout)
        self._jobs.put(None)
        if finished:
            self._thread.join()
        else:
            self._abort.set()
            for path in list(self._unfinished):
                log.error(
                    f"Stopped waiting for the upload of {path} to {self.url(path)} after {timeout} s: it exists "
                    f"only locally (a partial remote copy has no marker, so it is never loaded)."
                )
        failed = [o.checkpoint for o in self.outcomes if not o.uploaded]
        if failed:
            log.error(
                f"{len(failed)} of {len(self.outcomes)} checkpoint upload(s) to {self.destination.url} failed; "
                f"these exist only locally: {', '.join(failed)}"
            )
        elif self.outcomes:
            log.info(f"All {len(self.outcomes)} checkpoint upload(s) to {self.destination.url} succeeded.")
        return self.outcomes

    def _remove_stale_snapshots(self, folder: Path) -> None:
        """Snapshots left by an earlier process (killed while uploading) hold disk space; drop them once."""
        if folder not in self._cleaned:
            self._cleaned.add(folder)
            for stale in folder.glob(".step*.uploading-*"):
                shutil.rmtree(stale, ignore_errors=True)

    def _work(self) -> None:
        # After close() gave up waiting, queued uploads are dropped: the process is about to exit.
        while (job := self._jobs.get()) is not None and not self._abort.is_set():
            outcome = self._upload(job)
            if job.source != job.checkpoint:
                shutil.rmtree(job.source, ignore_errors=True)
            with self._changed:
                if outcome is not None:
                    self.outcomes.append(outcome)
                self._unfinished.remove(job.checkpoint)
                self._changed.notify_all()

    def _upload(self, job: _Job) -> Optional[UploadOutcome]:
        """Upload one checkpoint, retrying after a failure; None if it was already there."""
        name, url, start, tries = job.checkpoint.name, self.url(job.checkpoint), time.monotonic(), 0

        def attempt() -> bool:
            nonlocal tries
            tries += 1
            if job.only_if_missing and self.destination.remote_marker(name) == (job.source / MARKER).read_bytes():
                return False
            self.destination.upload(job)
            return True

        def failed(n: int, e: Exception) -> str:
            return (
                f"Uploading checkpoint {name} to {url} failed (attempt {n} of {self.attempts}): {_described(e)}."
            )

        def before_retry(n: int, e: Exception, delay: float) -> None:
            log.error(
                f"{failed(n, e)} Retrying the whole checkpoint in {delay:.0f} s; until then the remote copy has "
                f"no marker and is never loaded."
            )

        try:
            # Any failure of the store or the network is retried, never raised. The wait ends when close() stops
            # waiting (self._abort).
            uploaded = call_with_retries(
                attempt,
                attempts=self.attempts,
                backoff=Backoff(self.backoff_s),
                retry_on=Exception,
                on_retry=before_retry,
                stop=self._abort,
            )
        except Exception as e:
            log.error(
                f"{failed(tries, e)} Giving up: the checkpoint exists only locally, in {job.checkpoint}. Training "
                f"goes on; copy it there yourself (every file, the {MARKER} marker last)."
            )
            return UploadOutcome(str(job.checkpoint), url, False, tries, time.monotonic() - start, _described(e))
        if not uploaded:
            log.info(f"Checkpoint {name} is already at {url}.")
            return None
        seconds, megabytes = time.monotonic() - start, sum(job.files.values()) / 1e6
        log.info(f"Uploaded checkpoint {name} to {url} ({megabytes:.1f} MB in {seconds:.1f} s, attempt {tries}).")
        return UploadOutcome(str(job.checkpoint), url, True, tries, seconds)


def _described(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def build_checkpoint_uploader(remote_save_folder: Optional[str], rank: int) -> Optional[CheckpointUploader]:
    """The uploader for ``remote_save_folder`` on rank 0; None on every other rank or when it is unset."""
    if remote_save_folder is None or rank != 0:
        return None
    return CheckpointUploader(remote_save_folder)
