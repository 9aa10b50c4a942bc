"""Process groups, rank helpers and collectives: the distributed code that knows nothing of the model.

One code path serves ``python scripts/train.py`` (one process, no process group),
``torchrun --nproc_per_node=N scripts/train.py`` and ``srun python scripts/train.py`` (one Slurm task per
process, no torchrun): gloo on CPU, nccl on GPU, picked automatically. Rank, world size and rendezvous address
come from :func:`olmo.util.launch.launch_env`, which every earlier reader of the rank uses too.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..exceptions import OLMoCliError
from ..util.launch import LaunchEnv, launch_env
from .store import fresh_namespace

__all__ = [
    "DistEnv",
    "init_distributed",
    "launch_device",
    "teardown_distributed",
    "all_reduce",
    "barrier",
    "all_gather_dim0",
    "reduce_scatter_dim0",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its device, rank and world size.

    :param local_world_size: processes on this node; None means all of them (one node).
    """

    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    local_world_size: Optional[int] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_minutes: float = 30.0) -> DistEnv:
    """Initialize the default process group when torchrun or srun started several processes; otherwise run
    standalone. Logs which launcher's variables were used."""
    launch = launch_env()
    log.info("%s", launch.describe())
    if launch.warning:
        log.warning("%s", launch.warning)
    if torch.cuda.is_available():
        device = torch.device("cuda", _cuda_index(launch))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launch.world_size > 1 and not dist.is_initialized():
        # On GPU, a gloo backend for CPU tensors too: background checkpoint writes need one.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        dist.init_process_group(
            store=_rendezvous_store(launch, timeout),
            rank=launch.rank,
            world_size=launch.world_size,
            backend=backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        log.info("Initialized %s process group with %d ranks.", backend, launch.world_size)
    return DistEnv(device, launch.rank, launch.local_rank, launch.world_size, launch.local_world_size)


def launch_device() -> torch.device:
    """The device :func:`init_distributed` will give this process, known before it runs (for checks of what the
    device can do, made before anything expensive starts)."""
    return torch.device("cuda", _cuda_index(launch_env())) if torch.cuda.is_available() else torch.device("cpu")


def _cuda_index(launch: LaunchEnv) -> int:
    """The GPU of this process: its local rank, or the only visible GPU when the launcher gave each process its
    own (``srun --gpus-per-task=1`` sets ``CUDA_VISIBLE_DEVICES`` per task)."""
    visible = torch.cuda.device_count()
    if launch.local_rank < visible:
        return launch.local_rank
    if visible == 1:
        return 0
    raise OLMoCliError(
        f"This process has local rank {launch.local_rank} but sees only {visible} GPUs "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Start at most one process per GPU on "
        f"each node (torchrun --nproc_per_node, srun --ntasks-per-node), or give each task one GPU "
        f"(srun --gpus-per-task=1)."
    )


def _rendezvous_store(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The store ``env://`` would give, under a prefix that only this launch's workers share
    (:func:`olmo.distributed.store.fresh_namespace`): after a torchrun restart the agent's store still holds the
    dead attempt's keys, which a new rank would otherwise read (a dead peer's address: gloo "Connection refused")."""
    assert launch.master_addr is not None and launch.master_port is not None
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host_name=launch.master_addr,
        port=launch.master_port,
        world_size=launch.world_size,
        is_master=launch.rank == 0 and not agent_hosts_store,
        timeout=timeout,
        multi_tenant=not agent_hosts_store,
    )
    return dist.PrefixStore(fresh_namespace(store, launch.rank, launch.world_size, timeout), store)


def teardown_distributed() -> None:
    """Destroy the process groups, then collect garbage: a model, optimizer or loader built on them holds them in
    reference cycles, and a group left for interpreter exit has its gloo threads torn down mid-finalization, which
    now and then aborts a rank after a finished run ("terminate called without an active exception"). Call it once
    the objects built on the groups are out of scope (e.g. from the caller of the function that built them)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce in place when a process group exists; a no-op for one process."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor


def all_gather_dim0(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's ``input`` into ``output``, concatenated along dimension 0 in rank order (torch's
    ``all_gather_single``; ``all_gather_into_tensor`` in older releases)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def reduce_scatter_dim0(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """This rank's part (along dimension 0) of ``input`` summed over the ranks, into ``output`` (torch's
    ``reduce_scatter_single``; ``reduce_scatter_tensor`` in older releases). Not on gloo."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, input, group=group)
