"""Credentials and waits of remote token files, against real servers on 127.0.0.1: a URL's ``user:password@`` and
a netrc entry are sent as HTTP Basic (and never appear in a message or the run's record), a server that accepts
connections and never answers is given up after two timeouts, a host that does not resolve is not retried, and a
server that sends no version (no ETag, no Last-Modified) is warned about."""

import json
import logging
import socket
import threading
from pathlib import Path

import pytest

from olmo.config import RemoteDataConfig
from olmo.data import MemMapDataset
from olmo.data.remote import HostUnresolved, RemoteUnreachable
from olmo.exceptions import OLMoDataError
from olmo.testing import BYTE_VOCAB, write_byte_memmap
from olmo.testing.http import FileServer

CHUNK = 64
FAST = RemoteDataConfig(max_concurrency=4, max_attempts=5, backoff_seconds=0.01, timeout_seconds=0.5)
SECRET = "pw-5ecret-7"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_byte_memmap(root / "a.npy", 2_000)
    return root


def _with_userinfo(url: str, userinfo: str) -> str:
    return url.replace("http://", f"http://{userinfo}@")


def test_a_urls_credentials_are_sent_as_basic_auth_and_recorded_masked(corpus, tmp_path):
    record = tmp_path / "remote_files.json"
    with FileServer(corpus, auth=("user", SECRET)) as server:
        url = _with_userinfo(server.url("a.npy"), f"user:{SECRET}")
        ds = MemMapDataset(url, chunk_size=CHUNK, remote=FAST, metadata_cache=record)
        assert len(ds) == 2_000 // CHUNK
        assert ds[3]["input_ids"].numel() == CHUNK
        ds.save_remote_records()
        saved = json.loads(record.read_text())
        assert list(saved["files"]) == [_with_userinfo(server.url("a.npy"), "user:***")]
        assert SECRET not in record.read_text()
        # A relaunch finds its record under the masked URL: one metadata request, no header read.
        server.clear_log()
        assert len(MemMapDataset(url, chunk_size=CHUNK, remote=FAST, metadata_cache=record)) == len(ds)
        assert [r.method for r in server.log] == ["HEAD"]

        wrong = _with_userinfo(server.url("a.npy"), "user:wrong-pass-9")
        with pytest.raises(OLMoDataError, match=r"denied \(HTTP 401\).*sent: the URL's user:password@ part") as e:
            len(MemMapDataset(wrong, chunk_size=CHUNK, remote=FAST))
        assert "wrong-pass-9" not in str(e.value) and "user:***@" in str(e.value)
        with pytest.raises(OLMoDataError, match=r"Credentials sent: none.*~/\.netrc.*machine 127\.0\.0\.1 login"):
            len(MemMapDataset(server.url("a.npy"), chunk_size=CHUNK, remote=FAST))


def test_a_token_alone_before_the_host_is_sent_and_masked(corpus):
    with FileServer(corpus, auth=("tok-5ecret-8", "")) as server:
        url = _with_userinfo(server.url("a.npy"), "tok-5ecret-8")
        assert len(MemMapDataset(url, chunk_size=CHUNK, remote=FAST)) == 2_000 // CHUNK
        with pytest.raises(OLMoDataError) as e:
            len(MemMapDataset(url.replace("a.npy", "gone.npy"), chunk_size=CHUNK, remote=FAST))
        assert "tok-5ecret-8" not in str(e.value) and "http://***@127.0.0.1" in str(e.value)


def test_credentials_come_from_netrc(corpus, tmp_path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login reader password {SECRET}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    with FileServer(corpus, auth=("reader", SECRET)) as server:
        assert len(MemMapDataset(server.url("a.npy"), chunk_size=CHUNK, remote=FAST)) == 2_000 // CHUNK
        netrc.write_text("machine 127.0.0.1 login reader password not-it\n")
        with pytest.raises(OLMoDataError, match=r"denied.*Credentials sent: the netrc entry for 127\.0\.0\.1"):
            len(MemMapDataset(server.url("a.npy"), chunk_size=CHUNK, remote=FAST))
        netrc.write_text("hostname 127.0.0.1\n")  # damaged
        with pytest.raises(OLMoDataError, match=r"netrc file '.*netrc' cannot be read.*NETRC"):
            len(MemMapDataset(server.url("a.npy"), chunk_size=CHUNK, remote=FAST))


def test_a_server_that_never_answers_is_given_up_after_two_timeouts(caplog):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        try:
            while True:
                accepted.append(listener.accept()[0])
        except OSError:  # closed at the end of the test
            pass

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/a.npy"
    try:
        with pytest.raises(RemoteUnreachable, match=r"did not answer 2 requests in a row.*timeout_seconds=0\.5"):
            len(MemMapDataset(url, chunk_size=CHUNK, remote=FAST))
        assert len(accepted) == 2  # of max_attempts=5
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


def test_a_host_that_does_not_resolve_is_not_retried(caplog):
    url = "http://no-such-host.invalid/data/a.npy"
    with caplog.at_level(logging.WARNING):
        with pytest.raises(
            HostUnresolved, match=r"Cannot resolve the host name 'no-such-host\.invalid'.*--evaluators"
        ):
            len(MemMapDataset(url, url.replace("a.npy", "b.npy"), chunk_size=CHUNK, remote=FAST))
    assert "retrying" not in caplog.text


def test_a_server_without_versions_is_warned_about_on_relaunch(corpus, tmp_path, caplog):
    record = tmp_path / "remote_files.json"
    with FileServer(corpus, validators=False) as server:
        first = MemMapDataset(server.url("a.npy"), chunk_size=CHUNK, remote=FAST, metadata_cache=record)
        first.validate(vocab_size=BYTE_VOCAB)
        first.save_remote_records()
        import olmo.data.memmap_remote as memmap_remote

        memmap_remote._unversioned_warned = False
        with caplog.at_level(logging.WARNING):
            assert len(
                MemMapDataset(server.url("a.npy"), chunk_size=CHUNK, remote=FAST, metadata_cache=record)
            ) == len(first)
    assert "sends neither ETag nor Last-Modified" in caplog.text
