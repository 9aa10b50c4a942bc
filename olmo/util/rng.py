"""Capture and restore every RNG a training step draws from, as plain values and tensors.

Checkpoints are loaded with ``weights_only=True``, so the states are stored without pickled
objects: Python's state as lists, numpy's key as a tensor.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state", "seed_all", "rng_preserved"]


def seed_all(seed: int) -> None:
    """Seed Python, numpy and torch (every device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextmanager
def rng_preserved() -> Iterator[None]:
    """Run the block, then put every RNG back as it was before it: for work between training steps (evaluation,
    samples, checkpoints) that may draw random numbers (a DataLoader draws its base seed from torch's), so that a
    run's dropout masks do not depend on when it evaluates or saves."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
