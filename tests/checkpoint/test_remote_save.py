"""remote_save_folder: committed checkpoints of a real tiny run, uploaded to a local folder, a file:// URL,
real S3/R2 and GCS servers on 127.0.0.1 (moto, gcp-storage-emulator), and loaded back through cached-path."""

import functools
import hashlib
import logging
import shutil
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from olmo.checkpoint import MARKER, find_latest_checkpoint, inspect_checkpoint, list_checkpoints, load_checkpoint
from olmo.checkpoint.upload import CheckpointUploader, build_checkpoint_uploader, remote_save_folder_problems
from olmo.config import TrainConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.model import OLMo
from olmo.testing import free_port, run_train, tiny_config_dict, write_byte_memmap, write_config


def _hashes(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _remote_hashes(client, bucket: str, prefix: str) -> dict[str, str]:
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {
        k[len(prefix) :]: hashlib.sha256(client.get_object(Bucket=bucket, Key=k)["Body"].read()).hexdigest()
        for k in keys
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 4-step run: step2-unsharded, step4-unsharded and the sharded step4."""
    root = tmp_path_factory.mktemp("run")
    write_byte_memmap(root / "data.npy", 20_000)
    cfg = tiny_config_dict(
        root / "run", [str(root / "data.npy")], max_duration=4, save_interval=4, save_interval_unsharded=2
    )
    config = write_config(root / "config.yaml", cfg)
    assert run_train(config) == 0
    assert [(c.step, c.sharded) for c in list_checkpoints(root / "run")] == [(2, False), (4, False), (4, True)]
    return root


@pytest.fixture
def s3(s3_server):
    """A client of the test server and a fresh bucket name (not created)."""
    return boto3.client("s3"), f"ckpt-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["s3", "r2", "gs"])
def store(request, monkeypatch):
    """The URL of a fresh bucket of each kind of object store, and a function that lists what a prefix of
    it holds (relative name -> sha256)."""
    scheme, bucket = request.param, f"ckpt-{request.param}-{uuid.uuid4().hex[:8]}"
    if scheme == "gs":
        request.getfixturevalue("gcs_server")
        from google.cloud import storage

        gcs_bucket = storage.Client().create_bucket(bucket)

        def listing(prefix):
            blobs = gcs_bucket.list_blobs(prefix=prefix)
            return {b.name[len(prefix) :]: hashlib.sha256(b.download_as_bytes()).hexdigest() for b in blobs}

        return f"gs://{bucket}", listing
    endpoint = request.getfixturevalue("s3_server")
    if scheme == "r2":  # R2 is reached through its own endpoint and keys, never AWS_ENDPOINT_URL's
        monkeypatch.setenv("R2_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("R2_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("R2_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=bucket)
    return f"{scheme}://{bucket}", functools.partial(_remote_hashes, client, bucket)


@pytest.fixture
def fresh_cached_path(tmp_path):
    """cached-path with an empty cache and clients made anew (each keeps the endpoint it was made with)."""
    import cached_path
    from cached_path.schemes import gs, r2, s3

    clients = (s3._get_s3_resource_client, r2._get_s3_resource_client, gs._get_gcs_client)
    cache_dir = cached_path.get_cache_dir()
    cached_path.set_cache_dir(tmp_path / "cache")
    for client in clients:
        client.cache_clear()
    yield
    cached_path.set_cache_dir(cache_dir)
    for client in clients:
        client.cache_clear()


def _uploader(remote: str, **kwargs) -> CheckpointUploader:
    return CheckpointUploader(remote, **{"backoff_s": 0.0, **kwargs})


@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_local_uploads_are_exact_committed_copies(run, tmp_path, as_url):
    remote = tmp_path / "remote"
    uploader = _uploader(f"file://{remote}" if as_url else str(remote))
    for name in ("step4-unsharded", "step4"):
        uploader.submit(run / "run" / name)
    outcomes = uploader.close()
    assert [(Path(o.checkpoint).name, o.uploaded, o.attempts) for o in outcomes] == [
        ("step4-unsharded", True, 1),
        ("step4", True, 1),
    ]
    for name in ("step4-unsharded", "step4"):
        assert _hashes(remote / name) == _hashes(run / "run" / name)
    assert (remote / "step4" / "model_and_optim" / ".metadata").is_file()
    assert inspect_checkpoint(str(remote / "step4-unsharded")).marked  # sizes checked against the marker
    assert find_latest_checkpoint(remote) == remote / "step4"
    hidden = [p.name for p in [*remote.iterdir(), *(run / "run").iterdir()] if p.name.startswith(".step")]
    assert hidden == [], "no temporary copy or snapshot may remain"


def test_object_store_upload_is_complete_with_the_marker_and_loads_back(run, store, fresh_cached_path):
    url, listing = store
    uploader = _uploader(f"{url}/runs/tiny")
    for name in ("step2-unsharded", "step4"):
        uploader.submit(run / "run" / name)
    assert all(o.uploaded for o in uploader.close())
    for name in ("step2-unsharded", "step4"):
        remote = listing(f"runs/tiny/{name}/")
        assert remote == _hashes(run / "run" / name) and MARKER in remote
    assert "model_and_optim/.metadata" in listing("runs/tiny/step4/")

    info = inspect_checkpoint(f"{url}/runs/tiny/step2-unsharded")  # read through cached-path
    assert (info.step, info.sharded, info.marked) == (2, False, True)
    cfg = TrainConfig.load(run / "run" / "step2-unsharded" / "config.yaml")
    model = OLMo(cfg.model)
    assert load_checkpoint(info, model, None)["global_step"] == 2
    original = torch.load(run / "run" / "step2-unsharded" / "model.pt", weights_only=True)
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


def test_a_run_resumes_exactly_from_its_checkpoint_on_s3(run, s3, tmp_path, fresh_cached_path):
    client, bucket = s3
    client.create_bucket(Bucket=bucket)
    uploader = _uploader(f"s3://{bucket}/runs/tiny")
    uploader.submit(run / "run" / "step2-unsharded")
    assert uploader.close()[0].uploaded
    cfg = tiny_config_dict(
        tmp_path / "resumed", [str(run / "data.npy")], max_duration=4, save_interval_unsharded=2
    )
    config = write_config(tmp_path / "config.yaml", cfg)
    assert run_train(config, f"--load_path=s3://{bucket}/runs/tiny/step2-unsharded") == 0
    resumed = torch.load(tmp_path / "resumed/step4-unsharded/model.pt", weights_only=True)
    original = torch.load(run / "run/step4-unsharded/model.pt", weights_only=True)
    assert all(torch.equal(resumed[k], original[k]) for k in original)


def test_failed_upload_is_logged_retried_and_leaves_training_and_the_checkpoint_alone(run, s3, caplog):
    _, bucket = s3  # never created: every attempt fails
    checkpoint = run / "run" / "step4"
    before = _hashes(checkpoint)
    uploader = _uploader(f"s3://{bucket}/x", attempts=3, backoff_s=0.01)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="olmo.checkpoint.upload"):
        uploader.submit(checkpoint)
        assert time.monotonic() - start < 1.0, "training must not wait for the upload"
        [outcome] = uploader.close()
    assert (outcome.uploaded, outcome.attempts) == (False, 3) and "NoSuchBucket" in outcome.error
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for attempt in (1, 2, 3):
        assert any(f"s3://{bucket}/x/step4 failed (attempt {attempt} of 3)" in m for m in errors), errors
    assert "Retrying the whole checkpoint" in errors[0] and "exists only locally" in errors[2]
    assert "1 of 1 checkpoint upload(s)" in errors[-1]
    assert _hashes(checkpoint) == before
    assert not list(checkpoint.parent.glob(".step*")), "the snapshot is removed"


def test_unreachable_server_fails_the_same_way(run, s3_server, monkeypatch, caplog):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # a stopped server
    uploader = _uploader("s3://ckpt-unreachable/x", attempts=2)
    with caplog.at_level(logging.ERROR, logger="olmo.checkpoint.upload"):
        uploader.submit(run / "run" / "step2-unsharded")
        [outcome] = uploader.close()
    assert not outcome.uploaded and outcome.attempts == 2 and "Could not connect" in outcome.error
    assert "exists only locally" in caplog.records[1].getMessage()


def test_retry_succeeds_from_a_snapshot_after_retention_deleted_the_checkpoint(run, s3, tmp_path, caplog):
    client, bucket = s3
    local = tmp_path / "save"
    shutil.copytree(run / "run" / "step4", local / "step4")
    expected = _hashes(local / "step4")
    uploader = _uploader(f"s3://{bucket}", attempts=3, backoff_s=1.0)
    with caplog.at_level(logging.ERROR, logger="olmo.checkpoint.upload"):
        uploader.submit(local / "step4")
        deadline = time.monotonic() + 20
        while not caplog.records and time.monotonic() < deadline:  # the first attempt fails: no bucket
            time.sleep(0.01)
        shutil.rmtree(local / "step4")  # what retention does to an old checkpoint
        client.create_bucket(Bucket=bucket)
        [outcome] = uploader.close()
    assert outcome.uploaded and outcome.attempts >= 2
    assert _remote_hashes(client, bucket, "step4/") == expected
    assert list(local.iterdir()) == []


def test_partial_remote_is_replaced_and_a_relaunch_uploads_only_what_is_missing(run, s3):
    client, bucket = s3
    client.create_bucket(Bucket=bucket)
    first = _uploader(f"s3://{bucket}/")
    first.submit(run / "run" / "step2-unsharded")
    assert first.close()[0].uploaded
    # What a killed upload of step4 leaves behind: some files, one of them from another save, no marker.
    client.put_object(Bucket=bucket, Key="step4/model_and_optim/.metadata", Body=b"trunc")
    client.put_object(Bucket=bucket, Key="step4/model_and_optim/__7_0.distcp", Body=b"from another save")
    relaunch = _uploader(f"s3://{bucket}")
    relaunch.submit_missing(run / "run")
    assert sorted(Path(o.checkpoint).name for o in relaunch.close() if o.uploaded) == ["step4", "step4-unsharded"]
    for name in ("step2-unsharded", "step4-unsharded", "step4"):
        assert _remote_hashes(client, bucket, f"{name}/") == _hashes(run / "run" / name)


def test_close_with_a_timeout_abandons_retries(run, s3, caplog):
    _, bucket = s3  # never created
    uploader = _uploader(f"s3://{bucket}", attempts=3, backoff_s=60.0)
    with caplog.at_level(logging.ERROR, logger="olmo.checkpoint.upload"):
        uploader.submit(run / "run" / "step4")
        deadline = time.monotonic() + 20
        while not caplog.records and time.monotonic() < deadline:  # attempt 1 failed; 60 s until attempt 2
            time.sleep(0.01)
        start = time.monotonic()
        assert uploader.close(timeout=0.1) == []
        assert time.monotonic() - start < 1.0
        # The abandoned retry ends at once, with a last error, and drops its snapshot.
        while time.monotonic() < deadline and (
            "Giving up" not in caplog.records[-1].getMessage() or list((run / "run").glob(".step4.uploading-*"))
        ):
            time.sleep(0.01)
    messages = [r.getMessage() for r in caplog.records]
    assert any("Stopped waiting" in m and "exists only locally" in m for m in messages)
    assert "Giving up" in messages[-1] and "attempt 1 of 3" in messages[-1]


def test_an_unknown_profile_stops_the_launch(s3_server, monkeypatch):
    monkeypatch.setenv("S3_PROFILE", "no-such-profile")
    with pytest.raises(OLMoConfigurationError, match="remote_save_folder='s3://bucket/run'.*no-such-profile"):
        CheckpointUploader("s3://bucket/run")


def test_an_incomplete_local_checkpoint_is_refused_without_raising(tmp_path, caplog):
    (tmp_path / "step3").mkdir()
    uploader = _uploader(str(tmp_path / "remote"))
    with caplog.at_level(logging.ERROR, logger="olmo.checkpoint.upload"):
        uploader.submit(tmp_path / "step3")
    [outcome] = uploader.close()
    assert not outcome.uploaded and "not a complete committed checkpoint" in caplog.records[0].getMessage()
    assert not (tmp_path / "remote" / "step3").exists()


def test_only_rank_0_uploads(tmp_path):
    assert build_checkpoint_uploader(None, 0) is None
    assert build_checkpoint_uploader(str(tmp_path), 1) is None
    uploader = build_checkpoint_uploader(str(tmp_path), 0)
    assert isinstance(uploader, CheckpointUploader)
    assert uploader.close() == []


def test_validation_names_remote_save_folder_and_the_fix(tmp_path, monkeypatch):
    for var in ("R2_ENDPOINT_URL", "R2_PROFILE", "R2_ACCESS_KEY_ID", "R2_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert remote_save_folder_problems(None) == []
    assert remote_save_folder_problems("s3://bucket/prefix") == []
    assert remote_save_folder_problems(str(tmp_path / "new" / "folder")) == []
    (tmp_path / "file").write_text("")
    cases = {
        "": "is empty",
        "hf://org/repo": "cannot be uploaded to hf:// URLs",
        "s3:///prefix": "names no bucket",
        "r2://bucket": "R2_ENDPOINT_URL",
        str(tmp_path): "is save_folder itself",
        f"file://{tmp_path}/file/sub": "is a file, not a folder",
    }
    for remote, expected in cases.items():
        problems = remote_save_folder_problems(remote, save_folder=str(tmp_path))
        assert problems and expected in " ".join(problems), (remote, problems)
        assert all("remote_save_folder=" in p for p in problems)
    assert len(remote_save_folder_problems("r2://bucket")) == 2  # the endpoint and the credentials
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "boto3", None)
    assert "pip install google-cloud-storage" in remote_save_folder_problems("gs://bucket/run")[0]
    assert "pip install boto3" in remote_save_folder_problems("s3://bucket/run")[0]
