"""The part of a parameter or state tensor this rank holds."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) parameter, gradient or state tensor, else ``t`` itself; elementwise
    math on it updates the whole tensor's local part in place."""
    return t.to_local() if isinstance(t, DTensor) else t
