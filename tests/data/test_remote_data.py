"""Token files given as URLs are fetched through cached-path (here from a server on 127.0.0.1)."""

import functools
import http.server
import threading

import cached_path
import numpy as np
import pytest

from olmo.data import MemMapDataset
from olmo.exceptions import OLMoDataError
from olmo.testing import write_byte_memmap


@pytest.fixture
def server(tmp_path):
    cached_path.set_cache_dir(tmp_path / "cache")
    (tmp_path / "www").mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield tmp_path / "www", f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_http_token_files_read_like_local_ones(server):
    www, url = server
    tokens = write_byte_memmap(www / "part-0.npy", 4_000)
    remote = MemMapDataset(f"{url}/part-0.npy", chunk_size=64)
    remote.validate(vocab_size=257)
    assert len(remote) == 4_000 // 64
    for i in (0, 7, len(remote) - 1):
        assert remote[i]["input_ids"].tolist() == tokens[i * 64 : (i + 1) * 64].tolist()
    assert np.uint32(3) in range(len(remote)) and remote[np.uint32(3)]["input_ids"].numel() == 64


def test_a_missing_url_names_the_entry(server):
    _, url = server
    with pytest.raises(OLMoDataError, match=r"missing\.npy"):
        MemMapDataset(f"{url}/missing.npy", chunk_size=64).validate(vocab_size=257)
