"""Expert parallelism (``expert_parallel.degree``): each mixture-of-experts layer's experts split over ``degree``
ranks, tokens sent to the rank of their expert and back with ``all_to_all``, composed with FSDP2 over everything
else.

The layout, for ``W`` ranks and degree ``D`` (``D`` divides ``W`` and ``num_experts``):

- **Mesh** ``("ep", "ep_dp")`` of shape ``(D, W / D)`` (the layout's,
  :attr:`olmo.distributed.layout.ParallelLayout.expert_mesh`); rank ``r`` is EP rank ``r // (W / D)`` of the EP group of
  the ranks with the same ``r % (W / D)``. An EP group holds every expert once: its ranks exchange tokens.
- **Expert weights** are DTensors of their full shape ``(E, C, H)`` placed ``(Shard(0), Shard(0))``: EP rank ``j``
  owns experts ``j * E / D .. (j + 1) * E / D - 1``, and that block is sharded again over the ``W / D`` ranks of
  ``ep_dp`` (which hold the same experts), so each rank stores ``1 / W`` of them, as FSDP stores everything else.
  Checkpoints hold ordinary DTensors of the full shape: a run saved with one degree resumes with another, with
  FSDP alone, or unsharded. FSDP2 leaves these weights alone (``ignored_params``).
- **Forward**: each rank routes its own tokens, sorts them by expert, sends each EP rank the rows of its experts
  (``all_to_all``, sizes exchanged first: one host synchronization per layer), gathers its experts' weights over
  ``ep_dp``, computes, and sends the rows back. **Backward** runs the same exchanges in reverse and sums the expert
  weights' gradients over ``ep_dp`` (an all-reduce on gloo, a reduce-scatter on NCCL), divided by ``W``: the loss
  each rank backpropagates is scaled by ``W`` for FSDP's average (see :mod:`olmo.train.train_module`), which these
  gradients do not get.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .collectives import all_gather_dim0, reduce_scatter_dim0

__all__ = ["ExpertGroup", "shard_experts"]


@dataclass(frozen=True, eq=False)
class ExpertGroup:
    """What a mixture-of-experts layer needs to know of expert parallelism."""

    degree: int
    """EP ranks that share a batch's tokens."""
    rank: int
    """This rank's place among them: it holds experts ``rank * E / degree`` onwards."""
    ep: dist.ProcessGroup
    """The EP group: the ``degree`` ranks that exchange tokens."""
    replicas: dist.ProcessGroup
    """``ep_dp``: the ranks holding the same experts, over which their weights are sharded."""
    replica_count: int
    world_size: int

    def gather(self, weight: torch.Tensor) -> torch.Tensor:
        """This EP rank's experts of the DTensor ``weight``, whole, as one plain tensor ``(E / degree, ...)``."""
        assert isinstance(weight, DTensor)
        return _GatherExperts.apply(weight.to_local(), self, weight.shape[0] // self.degree)

    def exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Send ``send[j]`` consecutive rows of ``rows`` to EP rank ``j``; receive ``recv[j]`` from each."""
        return _Exchange.apply(rows, send, recv, self)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` (E,): this rank's rows per expert. Returns (degree, E / degree): the rows each EP rank will
        send for each of this rank's experts."""
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.ep)
        return out.view(self.degree, counts.numel() // self.degree)


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> list[nn.Parameter]:
    """Make every :class:`~olmo.model.moe.MoEFeedForward` of ``model`` (on the meta device) expert-parallel over
    ``mesh``: its ``w1``/``w3``/``w2`` become DTensor parameters placed ``(Shard(0), Shard(0))``. Returns those
    parameters (for FSDP's ``ignored_params``)."""
    from ..model.moe import MoEFeedForward

    degree, replicas = mesh.size(0), mesh.size(1)
    group = ExpertGroup(
        degree=degree,
        rank=mesh.get_local_rank("ep"),
        ep=mesh.get_group("ep"),
        replicas=mesh.get_group("ep_dp"),
        replica_count=replicas,
        world_size=degree * replicas,
    )
    out = []
    for layer in model.modules():
        if not isinstance(layer, MoEFeedForward):
            continue
        for name in layer.matrix_params:
            full = getattr(layer, name)
            local = torch.empty(_local_shape(full.shape, mesh), dtype=full.dtype, device=full.device)
            param = nn.Parameter(
                DTensor.from_local(local, mesh, (Shard(0), Shard(0)), shape=full.shape, stride=full.stride())
            )
            setattr(layer, name, param)
            out.append(param)
        layer.expert_group = group
    return out


def _local_shape(shape: torch.Size, mesh: DeviceMesh) -> tuple[int, ...]:
    rows = shape[0] // mesh.size(0)
    per = -(-rows // mesh.size(1))  # as torch.chunk splits: the last shards may be shorter, or empty
    mine = max(0, min(per, rows - per * mesh.get_local_rank("ep_dp")))
    return (mine, *shape[1:])


class _GatherExperts(torch.autograd.Function):
    """This EP rank's experts, whole: the local shards gathered over ``ep_dp``; backward sums the gradient over
    ``ep_dp`` and divides it by the world size, and returns this rank's shard of it."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: ExpertGroup, rows: int) -> torch.Tensor:
        ctx.group, ctx.local_rows = group, local.shape[0]
        if group.replica_count == 1:
            return local.clone()
        per = -(-rows // group.replica_count)
        padded = torch.zeros((per, *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]] = local
        out = torch.empty((per * group.replica_count, *local.shape[1:]), dtype=local.dtype, device=local.device)
        all_gather_dim0(out, padded, group=group.replicas)
        ctx.per = per
        return out[:rows]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group: ExpertGroup = ctx.group
        grad = grad / group.world_size
        if group.replica_count == 1:
            return grad, None, None
        per, rows = ctx.per, grad.shape[0]
        padded = torch.zeros((per * group.replica_count, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        padded[:rows] = grad
        mine = dist.get_rank(group.replicas)
        if dist.get_backend(group.replicas) == "nccl":
            out = torch.empty((per, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            reduce_scatter_dim0(out, padded.contiguous(), group=group.replicas)
        else:
            dist.all_reduce(padded, group=group.replicas)
            out = padded[mine * per : (mine + 1) * per]
        return out[: ctx.local_rows].contiguous(), None, None


class _Exchange(torch.autograd.Function):
    """``all_to_all`` of rows over the EP group with the given split sizes; backward sends the gradients back the
    same way with the sizes swapped."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: ExpertGroup
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group: ExpertGroup) -> torch.Tensor:
    out = torch.empty((sum(recv), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group.ep)
    return out
