"""Token files at URLs are read in place, by byte range, from real servers on 127.0.0.1: an HTTP server with and
without Range support (olmo.testing.http.FileServer), moto's S3 server for s3://, r2:// and weka://, and the GCS
emulator for gs://. Every instance read remotely is bitwise the one read locally, exactly its bytes cross the
wire, transient faults are retried and the rest stop with the URL, the byte range and the cause."""

import os
import socket
import uuid
from pathlib import Path

import boto3
import numpy as np
import pytest

from olmo.config import InstanceFilterConfig, RemoteDataConfig
from olmo.data import IterableDataset, MemMapDataset
from olmo.data.npy_files import PROBE_BYTES
from olmo.data.remote import RemoteUnreachable
from olmo.exceptions import OLMoDataError
from olmo.testing import BYTE_EOS, BYTE_VOCAB, free_port, write_byte_memmap
from olmo.testing.http import FileServer, touch_later

CHUNK = 64
FAST = RemoteDataConfig(max_concurrency=8, max_attempts=3, backoff_seconds=0.01, timeout_seconds=5.0)
"""Quick retries, so that fault tests take milliseconds."""
FILES = ("a.npy", "b.npy", "a_mask.npy", "b_mask.npy")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two token files of real text, one headerless (as dolma writes it) and one written by np.save (an npy
    header to skip), each with a label mask of the same kind; the repetition filter drops some instances."""
    root = tmp_path_factory.mktemp("corpus")
    a = write_byte_memmap(root / "a.npy", 5_000)
    b = write_byte_memmap(root / "raw_b.npy", 2_000, skip_bytes=300_000)
    b[CHUNK : 2 * CHUNK] = 7  # one instance of a single repeated token
    np.save(root / "b.npy", b)
    (np.arange(len(a)) % 3 > 0).tofile(root / "a_mask.npy")
    np.save(root / "b_mask.npy", np.arange(len(b)) % 5 > 1)
    return root


def dataset(root: str, remote: RemoteDataConfig = FAST, **kwargs) -> MemMapDataset:
    return MemMapDataset(
        f"{root}/a.npy",
        f"{root}/b.npy",
        chunk_size=CHUNK,
        label_mask_paths=[f"{root}/a_mask.npy", f"{root}/b_mask.npy"],
        generate_doc_lengths=True,
        eos_token_id=BYTE_EOS,
        instance_filter_config=InstanceFilterConfig(),
        vocab_size=BYTE_VOCAB,
        remote=remote,
        **kwargs,
    )


def assert_same_instances(local: MemMapDataset, items: list[dict]) -> None:
    """``items`` (an epoch of IterableDataset, batch 8) are every instance of ``local`` but the dropped partial
    batch, each bitwise as read locally."""
    indices = [item["index"] for item in items]
    assert len(set(indices)) == len(indices) == len(local) // 8 * 8
    for item in items:
        expected = local[item["index"]]
        for key in ("input_ids", "label_mask", "doc_lens"):
            assert np.array_equal(expected[key], item[key]), (key, item["index"])
        assert expected["instance_mask"] == item["instance_mask"]
        assert item["metadata"]["path"].endswith(Path(expected["metadata"]["path"]).name)


@pytest.fixture
def http(corpus):
    with FileServer(corpus) as server:
        yield server


def _s3_bucket(corpus: Path, endpoint: str) -> str:
    bucket = f"data-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=bucket)
    for name in FILES:
        client.upload_file(str(corpus / name), bucket, f"tokens/{name}")
    return bucket


@pytest.fixture(params=["http", "s3", "r2", "weka", "gs"])
def store(request, corpus, monkeypatch, tmp_path):
    """The corpus in a store of each kind, as the URL of its folder."""
    scheme = request.param
    if scheme == "http":
        yield request.getfixturevalue("http").url().rstrip("/")
    elif scheme == "gs":
        request.getfixturevalue("gcs_server")
        from google.cloud import storage

        bucket = storage.Client().create_bucket(f"data-{uuid.uuid4().hex[:8]}")
        for name in FILES:
            bucket.blob(f"tokens/{name}").upload_from_filename(str(corpus / name))
        yield f"gs://{bucket.name}/tokens"
    else:
        endpoint = request.getfixturevalue("s3_server")
        bucket = _s3_bucket(corpus, endpoint)
        if scheme != "s3":  # reached through their own endpoints, never AWS_ENDPOINT_URL's
            monkeypatch.setenv(f"{scheme.upper()}_ENDPOINT_URL", endpoint)
            monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
        if scheme == "r2":
            monkeypatch.setenv("R2_ACCESS_KEY_ID", "testing")
            monkeypatch.setenv("R2_SECRET_ACCESS_KEY", "testing")
        if scheme == "weka":  # a named profile, as OLMo's launch scripts set WEKA_PROFILE=WEKA
            credentials = tmp_path / "credentials"
            credentials.write_text("[WEKA]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
            monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
            monkeypatch.setenv("WEKA_PROFILE", "WEKA")
            monkeypatch.delenv("AWS_ACCESS_KEY_ID")
            monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        yield f"{scheme}://{bucket}/tokens"


def test_remote_instances_are_the_local_ones_and_cost_exactly_their_bytes(corpus, store):
    local, remote = dataset(str(corpus)), dataset(store)
    remote.validate(vocab_size=BYTE_VOCAB)
    assert len(remote) == len(local) == 5_000 // CHUNK + 2_000 // CHUNK
    probed = remote.fetch_stats.snapshot()
    assert probed["metadata_requests"] == 4 and probed["requests"] == 4  # one size + one header read per file
    assert probed["bytes"] == probed["probe_bytes"] <= 4 * PROBE_BYTES
    # Every instance of an epoch, in the training order, fetched ahead.
    items = list(IterableDataset(remote, 8, seed=3))
    assert_same_instances(local, items)
    assert sum(not item["instance_mask"] for item in items) >= 1  # the filter saw the repeated instance
    fetched = remote.fetch_stats.snapshot()
    assert fetched["bytes"] - probed["bytes"] == len(items) * CHUNK * (2 + 1)  # uint16 tokens + bool mask
    assert fetched["requests"] - probed["requests"] == 2 * len(items)
    assert fetched["retries"] == 0
    assert (
        remote[np.uint32(3)]["input_ids"].tolist() == local[3]["input_ids"].tolist()
    )  # indices as users pass them


def test_http_reads_are_range_requests_and_the_relaunch_only_checks_sizes(corpus, http, tmp_path):
    record = tmp_path / "train_data" / "remote_files.json"
    first = dataset(http.url().rstrip("/"), metadata_cache=record)
    first.validate(vocab_size=BYTE_VOCAB)
    first.save_remote_records()
    items = list(IterableDataset(first, 8, seed=3))
    gets = [r for r in http.log if r.method == "GET"]
    assert all(r.range is not None and r.status == 206 for r in gets), "no request for a whole file"
    assert http.body_bytes() == first.fetch_stats.snapshot()["bytes"]
    assert len(items) == len(first) // 8 * 8

    http.clear_log()
    relaunch = dataset(http.url().rstrip("/"), metadata_cache=record)
    assert len(relaunch) == len(first)
    assert [r.method for r in http.log] == ["HEAD"] * 4, "sizes are checked, headers come from the record"
    assert relaunch[80]["input_ids"].tolist() == first[80]["input_ids"].tolist()  # after b.npy's npy header

    touch_later(corpus / "b.npy")  # another version (ETag) of the same bytes
    try:
        with pytest.raises(
            OLMoDataError, match=r"b\.npy.*changed since this run first read it.*remote_files\.json"
        ):
            len(dataset(http.url().rstrip("/"), metadata_cache=record))
        # A new run (--save_overwrite) starts a new record instead.
        assert len(dataset(http.url().rstrip("/"), metadata_cache=record, reuse_metadata_cache=False)) == len(
            first
        )
        with pytest.raises(OLMoDataError, match=r"b\.npy' changed since this run first read it"):
            relaunch[80]  # a file replaced while the run reads it
    finally:
        touch_later(corpus / "b.npy")


def test_a_replaced_object_is_an_error_on_s3(corpus, s3_server):
    bucket = _s3_bucket(corpus, s3_server)
    remote = dataset(f"s3://{bucket}/tokens")
    first = remote[0]["input_ids"].tolist()
    boto3.client("s3").upload_file(str(corpus / "b.npy"), bucket, "tokens/a.npy")  # other bytes, new ETag
    with pytest.raises(OLMoDataError, match=r"s3://.*/a\.npy' changed since this run first read it"):
        remote[1]
    assert first == dataset(str(corpus))[0]["input_ids"].tolist()


def test_transient_faults_are_retried_and_never_give_wrong_bytes(corpus):
    faults = ["500", "503", "429", "reset", "short", "stall"]
    # The read timeout is generous (a busy CI machine once timed out healthy reads at 0.5 s, so the retry count
    # was off); the stall outlasts it.
    with FileServer(corpus, stall_seconds=6.0) as server:
        remote = dataset(
            server.url().rstrip("/"),
            # Enough tries even for a request whose retries meet every other fault too.
            RemoteDataConfig(max_attempts=len(faults) + 1, backoff_seconds=0.01, timeout_seconds=2.0),
        )
        assert len(remote) == len(dataset(str(corpus)))
        for fault in faults:  # each suffered by one of the next requests, one after the other
            server.inject(fault)
        items = list(IterableDataset(remote, 8, seed=3))
        assert_same_instances(dataset(str(corpus)), items)
        assert remote.fetch_stats.snapshot()["retries"] == len(faults)
        assert server.faults_served == dict.fromkeys(faults, 1)


@pytest.mark.parametrize(
    ("fault", "cause"), [("503", "HTTP 503"), ("reset", "Connection"), ("short", "IncompleteRead")]
)
def test_a_read_that_keeps_failing_names_the_url_the_range_and_the_cause(corpus, fault, cause):
    with FileServer(corpus) as server:
        remote = dataset(server.url().rstrip("/"))
        len(remote)
        server.inject(fault, count=-1, path="a.npy")
        start = 5 * CHUNK * 2
        with pytest.raises(RemoteUnreachable) as error:
            remote[5]
        message = str(error.value)
        assert f"bytes {start}-{start + CHUNK * 2 - 1} of '{server.url('a.npy')}' after 3 attempts" in message
        assert cause in message and "--try_load_latest_save" in message


def test_a_server_that_ignores_ranges_is_refused_before_it_sends_a_file(corpus):
    with FileServer(corpus, ranges=False) as server:
        remote = dataset(server.url().rstrip("/"))
        with pytest.raises(OLMoDataError, match=r"ignores byte ranges.*HTTP 200.*supports Range requests"):
            remote.validate(vocab_size=BYTE_VOCAB)
        assert remote.fetch_stats.snapshot()["bytes"] == 0


def test_missing_files_and_unreachable_servers(corpus, http, s3_server):
    with pytest.raises(OLMoDataError, match=r"missing\.npy' does not exist \(the server answered 404\)"):
        len(MemMapDataset(http.url("missing.npy"), chunk_size=CHUNK, remote=FAST))
    bucket = _s3_bucket(corpus, s3_server)
    with pytest.raises(OLMoDataError, match=r"s3://.*/nothing\.npy' does not exist"):
        len(MemMapDataset(f"s3://{bucket}/nothing.npy", chunk_size=CHUNK, remote=FAST))
    nobody = f"http://127.0.0.1:{free_port()}"  # connection refused
    ds = MemMapDataset(f"{nobody}/a.npy", f"{nobody}/b.npy", chunk_size=CHUNK, remote=FAST)
    with pytest.raises(RemoteUnreachable, match=r"size of 'http://.*/a\.npy' after 3 attempts.*1 later paths"):
        ds.validate(vocab_size=BYTE_VOCAB)


def test_secrets_in_urls_stay_out_of_messages(http):
    url = http.url("missing.npy").replace("http://", "http://user:hunter2@") + "?X-Amz-Signature=abc123"
    with pytest.raises(OLMoDataError) as error:
        len(MemMapDataset(url, chunk_size=CHUNK, remote=FAST))
    assert "hunter2" not in str(error.value) and "abc123" not in str(error.value)
    assert "user:***@" in str(error.value)


def test_missing_credentials_and_endpoints_name_the_variables(corpus, s3_server, monkeypatch, tmp_path):
    bucket = _s3_bucket(corpus, s3_server)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask an instance-metadata address
    with pytest.raises(RemoteUnreachable, match=r"No credentials.*AWS_ACCESS_KEY_ID.*S3_PROFILE"):
        len(MemMapDataset(f"s3://{bucket}/tokens/a.npy", chunk_size=CHUNK, remote=FAST))
    monkeypatch.delenv("R2_ENDPOINT_URL", raising=False)
    with pytest.raises(RemoteUnreachable, match=r"export R2_ENDPOINT_URL="):
        len(MemMapDataset(f"r2://{bucket}/tokens/a.npy", chunk_size=CHUNK, remote=FAST))
    for var in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # never ask the metadata server
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no gcloud login of a developer's
    with pytest.raises(RemoteUnreachable, match=r"No credentials.*GOOGLE_APPLICATION_CREDENTIALS"):
        len(MemMapDataset(f"gs://{bucket}/tokens/a.npy", chunk_size=CHUNK, remote=FAST))


def test_ids_over_the_vocabulary_are_named_when_read(corpus, tmp_path):
    tokens = np.fromfile(corpus / "a.npy", dtype=np.uint16)
    tokens[5 * CHUNK + 9] = 999
    tokens.tofile(tmp_path / "bad.npy")
    with FileServer(tmp_path) as server:
        remote = MemMapDataset(server.url("bad.npy"), chunk_size=CHUNK, vocab_size=BYTE_VOCAB, remote=FAST)
        remote.validate(vocab_size=BYTE_VOCAB)  # a remote corpus is not scanned up front
        assert server.body_bytes() <= PROBE_BYTES
        remote[4]
        with pytest.raises(OLMoDataError, match=rf"bad\.npy' holds token id 999 at token offset {5 * CHUNK + 9}"):
            remote[5]


def test_the_http_server_sends_nothing_it_was_not_asked_for():
    """The test server itself: a fault of the kind `short` really cuts the body (so the tests above prove what
    they claim)."""
    root = Path(os.environ.get("TMPDIR", "/tmp"))
    name = f"olmo-test-{uuid.uuid4().hex[:8]}.bin"
    (root / name).write_bytes(bytes(range(256)) * 4)
    try:
        with FileServer(root) as server:
            server.inject("short")
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.sendall(f"GET /{name} HTTP/1.1\r\nHost: x\r\nRange: bytes=0-99\r\n\r\n".encode())
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            assert b"206" in head.split(b"\r\n")[0] and b"Content-Length: 100" in head and len(body) == 50
    finally:
        (root / name).unlink()


def test_hostile_npy_headers_on_a_server_are_refused_after_one_small_read(tmp_path):
    huge = b"\x93NUMPY\x02\x00" + (2**30).to_bytes(4, "little") + b"{" * 500  # claims a 1 GiB header
    (tmp_path / "huge.npy").write_bytes(huge)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with FileServer(tmp_path) as server:
        remote = MemMapDataset(server.url("huge.npy"), chunk_size=CHUNK, remote=FAST)
        with pytest.raises(OLMoDataError, match=r"huge\.npy.*header cannot be read: it claims 1073741836 bytes"):
            len(remote)
        assert remote.fetch_stats.snapshot()["bytes"] == len(huge)  # the probe: the whole small file
        with pytest.raises(OLMoDataError, match=r"objects\.npy.*dtype object.*never loaded"):
            len(MemMapDataset(server.url("objects.npy"), chunk_size=CHUNK, remote=FAST))
