"""The per-launch store namespace (:func:`olmo.distributed.store.fresh_namespace`) on a real TCP store that still
holds the keys of earlier attempts, as torchrun's agent store does after a restart."""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from olmo.distributed.store import fresh_namespace
from olmo.exceptions import OLMoCliError
from olmo.testing import free_port


def _attempt(port: int, world_size: int, late: dict[int, float]) -> list[str]:
    """Every rank of one attempt in a thread with its own client; ``late`` delays some ranks' start (seconds)."""
    names: list = [None] * world_size
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            time.sleep(late.get(r, 0.0))
            client = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=20))
            names[r] = fresh_namespace(client, r, world_size, timedelta(seconds=20))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return names


def test_every_attempt_gets_one_new_namespace_whatever_the_order_of_arrival():
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False
    )
    seen: set[str] = set()
    # rank 0 first; rank 0 last (the others find only the dead attempts' keys at first); mixed
    for late in ({}, {0: 0.3}, {0: 0.3}, {1: 0.2, 0: 0.1}, {2: 0.3}):
        names = _attempt(port, 4, late)
        assert len(set(names)) == 1, names
        assert names[0] not in seen
        assert names[0].startswith("olmo/") and names[0].endswith("/")
        seen.add(names[0])
    del server


def test_rank_zero_names_the_ranks_that_never_came():
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    with pytest.raises(OLMoCliError, match=r"Rank\(s\) \[2, 3\] of 4 did not reach the rendezvous within 1 s"):
        _attempt_partial(port)
    del server


def _attempt_partial(port: int) -> None:
    client = dist.TCPStore("127.0.0.1", port, 4, is_master=False, timeout=timedelta(seconds=5))
    helper = threading.Thread(
        target=lambda: fresh_namespace(
            dist.TCPStore("127.0.0.1", port, 4, is_master=False, timeout=timedelta(seconds=5)),
            1,
            4,
            timedelta(seconds=5),
        )
    )
    helper.start()
    try:
        fresh_namespace(client, 0, 4, timedelta(seconds=1))
    finally:
        helper.join(10)
