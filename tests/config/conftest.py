"""Fixtures of the config tests."""

import socket

import pytest


@pytest.fixture
def offline(monkeypatch):
    """No host name resolves but this machine's, as on a machine without network (the official configs' data is
    remote: their tests never reach olmo-data.org)."""
    resolve = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host in ("localhost", "127.0.0.1", "::1"):
            return resolve(host, *args, **kwargs)
        raise socket.gaierror(socket.EAI_NONAME, f"{host}: resolution refused in this test")

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
