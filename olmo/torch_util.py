"""OLMo's ``olmo.torch_util`` helpers, for user scripts written against OLMo's API.

Same names, arguments and results as in OLMo 0.6.0, over this project's own modules: seeding is
:mod:`olmo.util.rng`'s, and local ranks come from :func:`olmo.util.launch.launch_env`, so they also work under
Slurm's ``srun`` without torchrun. The trainer itself uses :mod:`olmo.distributed` and :mod:`olmo.util`.
"""

from __future__ import annotations

import gc
import os
from typing import TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .distributed.collectives import barrier
from .util import rng
from .util.launch import launch_env

__all__ = [
    "seed_all",
    "is_distributed",
    "get_node_rank",
    "get_world_size",
    "get_local_world_size",
    "get_global_rank",
    "get_local_rank",
    "get_fs_local_rank",
    "move_to_device",
    "ensure_finite_",
    "get_default_device",
    "barrier",
    "peak_gpu_memory",
    "synchronize_value",
    "synchronize_flag",
    "gc_cuda",
    "get_cumulative_document_lengths",
]

T = TypeVar("T")
V = TypeVar("V", bool, int, float)


def seed_all(seed: int) -> None:
    """Seed Python, numpy and torch (every device) with ``seed``.

    :raises ValueError: when ``seed`` is outside ``[0, 2**32 - 1]`` (numpy's range), before seeding anything.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"Seed {seed} is invalid. It must be on [0; 2^32 - 1]")
    rng.seed_all(seed)


def is_distributed() -> bool:
    """Whether a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    """The process group's size; 1 when no process group is initialized."""
    return dist.get_world_size() if is_distributed() else 1


def get_global_rank() -> int:
    """This process's rank in the process group; 0 when no process group is initialized."""
    return dist.get_rank() if is_distributed() else 0


def get_local_rank() -> int:
    """This process's rank on its node: torchrun's ``LOCAL_RANK``, srun's ``SLURM_LOCALID``, else 0."""
    return launch_env().local_rank


def get_local_world_size() -> int:
    """Processes on this node: torchrun's ``LOCAL_WORLD_SIZE``, srun's tasks on this node, else 1."""
    return launch_env().local_world_size


def get_node_rank() -> int:
    """This node's index: ``NODE_RANK`` when set, else computed from the launcher's rank and local rank."""
    if os.environ.get("NODE_RANK"):
        return int(os.environ["NODE_RANK"])
    launch = launch_env()
    return (launch.rank - launch.local_rank) // launch.local_world_size


def get_fs_local_rank() -> int:
    """This process's rank among those sharing its file system: ``FS_LOCAL_RANK`` when set; otherwise the
    global rank when ``OLMO_SHARED_FS`` is set (all nodes share one file system), else the local rank."""
    if os.environ.get("FS_LOCAL_RANK"):
        return int(os.environ["FS_LOCAL_RANK"])
    return get_global_rank() if os.environ.get("OLMO_SHARED_FS") else get_local_rank()


def move_to_device(o: T, device: torch.device) -> T:
    """``o`` with every tensor in it (also inside dicts, lists and tuples) moved to ``device``; other values
    are returned as they are."""
    if isinstance(o, torch.Tensor):
        return cast(T, o.to(device))
    if isinstance(o, dict):
        return cast(T, {key: move_to_device(value, device) for key, value in o.items()})
    if isinstance(o, list):
        return cast(T, [move_to_device(item, device) for item in o])
    if isinstance(o, tuple):
        return cast(T, tuple(move_to_device(item, device) for item in o))
    return o


def ensure_finite_(x: torch.Tensor, check_neg_inf: bool = True, check_pos_inf: bool = False) -> None:
    """Replace infinities in the floating-point tensor ``x`` in place by its dtype's extremes.

    :param check_neg_inf: Replace ``-inf`` by the dtype's lowest finite value.
    :param check_pos_inf: Replace ``+inf`` by the dtype's highest finite value.
    """
    info = torch.finfo(x.dtype)
    if check_neg_inf:
        x.masked_fill_(x == float("-inf"), info.min)
    if check_pos_inf:
        x.masked_fill_(x == float("inf"), info.max)


def get_default_device() -> torch.device:
    """CUDA when it is available and already initialized in this process, else the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda")
    return torch.device("cpu")


def peak_gpu_memory(reset: bool = False) -> float | None:
    """Peak GPU memory allocated, in MB (10**6 bytes), the maximum over all ranks on rank 0 (other ranks get
    an intermediate value); None without CUDA. Collective: with a process group, every rank must call it.

    :param reset: Then reset the peak statistics of this process.
    """
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda")
    peak_mb = torch.cuda.max_memory_allocated(device) / 1e6
    if is_distributed():
        peak = torch.tensor(peak_mb, device=device)
        dist.reduce(peak, 0, dist.ReduceOp.MAX)
        peak_mb = peak.item()
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak_mb


def synchronize_value(value: V, device: torch.device) -> V:
    """Rank 0's ``value`` on every rank (broadcast through a tensor on ``device``; a float travels as fp32).
    Collective: with a process group, every rank must call it."""
    if not is_distributed():
        return value
    tensor = torch.tensor(value, device=device)
    dist.broadcast(tensor, 0)
    return cast(V, tensor.item())


def synchronize_flag(flag: bool, device: torch.device) -> bool:
    """Rank 0's ``flag`` on every rank; see :func:`synchronize_value`."""
    return synchronize_value(flag, device)


def gc_cuda() -> None:
    """Run Python's garbage collector, then return cached CUDA memory to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def get_cumulative_document_lengths(doc_lens: torch.Tensor) -> torch.Tensor:
    """The document boundaries of a packed batch, as flash-attn's varlen kernels take them (``cu_seqlens``).

    :param doc_lens: (B, max_docs) each instance's document lengths, padded with zeros.
    :returns: (n_docs + 1,) int32: 0, then the running total of the nonzero lengths in row-major order.
    """
    lengths = doc_lens[doc_lens != 0]
    return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
