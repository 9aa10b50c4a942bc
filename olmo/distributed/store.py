"""A key namespace of the rendezvous store that only the workers of this launch share.

torchrun's c10d rendezvous hands its workers a TCP store that its agent hosts (``TORCHELASTIC_USE_AGENT_STORE``)
and that outlives the workers: after a restart, the keys of the dead attempt are still there. torch scopes its own
keys by ``TORCHELASTIC_RESTART_COUNT``, but each agent counts only its own restarts: when one node's worker dies,
that node's agent counts a restart while the other node's agent restarts its healthy workers for the membership
change and does not (pytorch/pytorch#135712). Workers of one attempt can then disagree on the scope, or meet the
dead attempt's keys: gloo reads a dead peer's address ("Connection refused") and the restart fails.

:func:`fresh_namespace` needs no counter. Rank 0 picks a random name; every other rank asks for it under a random
token of its own and waits for the answer at a key named by that token. No process of an earlier attempt can have
written that key (the token is new, and torchrun stops every worker of an attempt before it starts the next), so
the answer is the name of this attempt's rank 0. Rank 0 answers every token it sees until every rank has confirmed
under the new name. Cost: a few store operations per rank, and on rank 0 a sweep over the ranks still missing
every 5 ms until all have arrived.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import torch.distributed as dist

from ..exceptions import OLMoCliError

__all__ = ["fresh_namespace"]

_POLL_S = 0.005


def fresh_namespace(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A prefix (``olmo/<hex>/``) the same on every rank of this launch and used by no earlier launch on ``store``.

    :param store: the rendezvous store every rank reaches (possibly holding keys of dead attempts).
    :param timeout: how long rank 0 waits for the others; they wait as long as the store's own timeout.
    :raises OLMoCliError: on rank 0, when some ranks never arrive within ``timeout``.
    """
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"olmo/ask/{rank}", token)
        name = store.get(f"olmo/answer/{token}").decode(errors="replace")
        store.set(f"olmo/{name}/joined/{rank}", "1")
        return f"olmo/{name}/"
    name = uuid.uuid4().hex
    answered: dict[int, str] = {}
    waiting = set(range(1, world_size))
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        for other in sorted(waiting):
            ask = f"olmo/ask/{other}"
            if store.check([ask]):
                token = store.get(ask).decode(errors="replace")
                if answered.get(other) != token:  # a new token, or the first one seen (maybe a dead attempt's)
                    store.set(f"olmo/answer/{token}", name)
                    answered[other] = token
            if store.check([f"olmo/{name}/joined/{other}"]):
                waiting.discard(other)
        if waiting:
            if time.monotonic() > deadline:
                raise OLMoCliError(
                    f"Rank(s) {sorted(waiting)[:16]} of {world_size} did not reach the rendezvous within "
                    f"{timeout.total_seconds():.0f} s. Check that every node started (its launcher's log), or "
                    f"raise distributed_timeout_minutes for slow starts."
                )
            time.sleep(_POLL_S)
    return f"olmo/{name}/"
