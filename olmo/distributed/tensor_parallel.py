"""Tensor parallelism (``tensor_parallel.degree``): each block's matrices split over a group of consecutive ranks
with torch's DTensor parallel styles, composed with FSDP2 over the data-parallel ranks on one device mesh.

The split, for degree ``t`` (Megatron's; torchtitan's and OLMo-core's styles):

- ``att_proj`` and ``ff_proj`` column-wise (``ColwiseParallel``: rank ``r`` computes output rows ``r`` of ``t``; the
  input is replicated and its gradient summed over the group), ``attn_out`` and ``ff_out`` row-wise
  (``RowwiseParallel``: each rank multiplies its share of the input, the outputs are summed over the group). Each
  rank attends with its ``n_heads / t`` query heads and ``n_kv_heads / t`` key/value heads, and applies the
  activation to its ``1 / t`` of the MLP's hidden units.
- **Fused rows.** ``att_proj`` stacks q, k and v, and SwiGLU's ``ff_proj`` stacks up and gate; a column-wise split
  must give rank ``r`` its own share of each part. So under tensor parallelism these weights hold their rows in a
  rank-major order (:func:`fused_row_orders`: q, k, v of rank 0, then of rank 1, ...). Checkpoints always hold the
  canonical order: :func:`canonical_rows` converts a state dict on the way out, :func:`order_fused_rows` the live
  parameters and optimizer state after a load or the initialization (one parameter at a time, through its full
  tensor). A checkpoint therefore resumes under any degree, or without tensor parallelism.
- **QK-norm** (OLMo 2's ``attention_layer_norm``) normalizes over all heads: its weights are split with the heads
  and its statistics summed over the group (:class:`TensorParallelGroup`).
- Embeddings, the other norms and the output layer are replicated within the group (their inputs are); every rank
  of a group computes the same logits and loss. The group's ranks read the same instances
  (``ParallelLayout.data_parallel_rank``), so the loss normalization (``sum(CE) * W / n_labels``, labels counted on
  every rank) comes to ``dp / n_labels`` per rank and FSDP's average over the ``dp`` data-parallel ranks gives the
  full gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..config import ActivationType, LayerNormType
from ..model import OLMo
from ..model.compile_guards import eager_in_compiled
from ..model.layers import LayerNorm

__all__ = [
    "GroupLayerNorm",
    "TensorParallelGroup",
    "apply_tensor_parallel",
    "canonical_rows",
    "fused_row_orders",
    "order_fused_rows",
    "quiet_exact_redistributions",
    "sharded_layer_norm",
    "tensor_parallel_degree",
]


@dataclass(eq=False)
class TensorParallelGroup:
    """A tensor-parallel group: its size and the sum over it that :class:`GroupLayerNorm` takes."""

    degree: int
    group: dist.ProcessGroup

    @eager_in_compiled  # a collective: left to eager mode inside a compiled block
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group; its gradient is summed over the group too."""
        return _SumOverGroup.apply(x, self.group)


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group's ranks. Backward: each rank's input feeds every rank's sum, so its gradient
    is the sum of theirs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ConsistentSequentialCollectives(logging.Filter):
    """Drops DTensor's warning that a redistribution over two mesh dimensions takes sequential collectives which
    "may give inconsistent results between ranks due to different reduction orders", where that cannot happen. With
    FSDP over TP it comes from every rank, once per kind: gathering a full parameter (``full_tensor()``: all-gathers)
    and the gradient norm (``clip_grad_norm_``: all-reduces of partial norms into replicas). An all-gather copies and
    never adds, so it is exact. A reduction from partial values on both dimensions into replicas on both reduces over
    one dimension, after which the groups of the other dimension hold identical inputs in the same rank order, so
    every rank computes the same sum; it differs only from a single flattened reduction (which flattening the mesh
    would use instead, changing the numbers of existing runs). Anything else (reduce-scatters, mixed targets) is
    still shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # torch's format: (source placements, target placements, count, collective, advice).
        if not (isinstance(record.msg, str) and "sequential %s operations" in record.msg):
            return True
        if not (isinstance(args, tuple) and len(args) == 5 and isinstance(args[1], tuple)):
            return True
        target, collective = args[1], args[3]
        replicas = all(isinstance(p, Replicate) for p in target)
        return not (collective == "all_gather" or (collective == "all_reduce" and replicas))


_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


def quiet_exact_redistributions() -> None:
    """Silence DTensor's "sequential collectives ... inconsistent results between ranks" warning where it does not
    apply (:class:`_ConsistentSequentialCollectives`); called by :func:`apply_tensor_parallel`, once is enough."""
    if not any(isinstance(f, _ConsistentSequentialCollectives) for f in _REDISTRIBUTE_LOG.filters):
        _REDISTRIBUTE_LOG.addFilter(_ConsistentSequentialCollectives())


def apply_tensor_parallel(model: OLMo, mesh: DeviceMesh) -> None:
    """Split every block of ``model`` (on the meta device, before FSDP) over the 1-D tensor-parallel ``mesh``: its
    matrices as the styles say, its mixer's head counts to this rank's share, and its QK-norms over the group
    (:class:`GroupLayerNorm`)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    quiet_exact_redistributions()

    group = TensorParallelGroup(mesh.size(), mesh.get_group())
    plan: dict[str, Any] = {
        "att_proj": ColwiseParallel(),
        "attn_out": RowwiseParallel(),
        "ff_proj": ColwiseParallel(),
        "ff_out": RowwiseParallel(),
    }
    for block in model.transformer.typed_blocks():
        parallelize_module(block, mesh, {k: v for k, v in plan.items() if getattr(block, k) is not None})
        block.n_heads //= group.degree  # this rank's heads: att_proj's rows and attn_out's columns hold them
        block.n_kv_heads //= group.degree
        for name in ("q_norm", "k_norm"):
            norm = getattr(block, name)
            if norm is not None and group.degree > 1:
                setattr(block, name, GroupLayerNorm(norm, mesh, group))


class GroupLayerNorm(LayerNorm):
    """A norm over a last dimension split over a tensor-parallel group (QK-norm over this rank's heads): its weight
    and bias split the same way (DTensors), its statistics summed over the group (:func:`sharded_layer_norm`).

    :param norm: The norm over the whole dimension, whose parameters this one takes, split.
    """

    def __init__(self, norm: LayerNorm, mesh: DeviceMesh, group: TensorParallelGroup):
        super().__init__(norm.size, norm.norm_type, norm.eps, elementwise_affine=False, bias=False)
        self.group = group
        for name, p in list(norm.named_parameters(recurse=False)):
            sharded = distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None)
            setattr(self, name, nn.Parameter(sharded, requires_grad=p.requires_grad))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sharded_layer_norm(self, x, self.group)


def sharded_layer_norm(norm: LayerNorm, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """``norm`` over a last dimension split over ``tp``'s ranks (``x`` this rank's share, the norm's weight and bias
    split the same way, as DTensors): ``rms`` and the layer norms, in fp32, their sums taken over the group."""
    weight, bias = (w.to_local() if isinstance(w, DTensor) else w for w in (norm.weight, norm.bias))
    dtype = x.dtype
    with torch.autocast(x.device.type, enabled=False):
        xf = x.float()
        if norm.norm_type == LayerNormType.rms:
            mean_square = tp.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / norm.size
            y = (xf * torch.rsqrt(mean_square + norm.eps)).to(dtype)
        else:
            mean = tp.all_reduce(xf.sum(-1, keepdim=True)) / norm.size
            centred = xf - mean
            variance = tp.all_reduce(centred.pow(2).sum(-1, keepdim=True)) / norm.size
            y = (centred * torch.rsqrt(variance + norm.eps)).to(dtype)
    if weight is not None:
        y = weight * y
        if bias is not None:
            y = y + bias
    return y


def _blocks(model: nn.Module) -> Optional[tuple[Any, list[Any]]]:
    """``model``'s config and blocks: an OLMo's, or a pipeline stage's part of one (its ``transformer.blocks`` keyed
    by layer); None for another module."""
    if isinstance(model, OLMo):
        return model.config, model.transformer.typed_blocks()
    blocks = getattr(getattr(model, "transformer", None), "blocks", None)
    if isinstance(blocks, nn.ModuleDict) and hasattr(model, "config"):
        return model.config, list(blocks.values())
    return None


def tensor_parallel_degree(model: nn.Module) -> int:
    """How many ranks share each block of ``model`` (1 for a model :func:`apply_tensor_parallel` did not split):
    the model's heads over the heads its first attention computes (linear-attention layers are never split)."""
    found = _blocks(model)
    if found is None:
        return 1
    attention = [block for block in found[1] if not block.is_recurrent]
    return found[0].n_heads // attention[0].n_heads if attention else 1


def _rank_major(parts: list[int], degree: int) -> torch.Tensor:
    """Row order of a weight stacking ``parts`` (row counts) so that chunk ``r`` of ``degree`` holds share ``r`` of
    every part: entry ``i`` is the canonical row placed at row ``i``."""
    starts = [sum(parts[:i]) for i in range(len(parts))]
    pieces = []
    for r in range(degree):
        for start, size in zip(starts, parts):
            share = size // degree
            pieces.append(torch.arange(start + r * share, start + (r + 1) * share))
    return torch.cat(pieces)


def fused_row_orders(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: row order}`` of the weights stored rank-major under tensor parallelism (none without it):
    ``att_proj`` (q, k, v) and SwiGLU's ``ff_proj`` (up, gate), weights and biases."""
    degree = tensor_parallel_degree(model)
    if degree == 1:
        return {}
    found = _blocks(model)
    assert found is not None
    cfg, blocks = found
    kv = cfg.effective_n_kv_heads * (cfg.d_model // cfg.n_heads)
    orders = {"att_proj": _rank_major([cfg.d_model, kv, kv], degree)}
    if blocks[0].ff_proj is not None and cfg.activation_type == ActivationType.swiglu:
        half = blocks[0].ff_proj.out_features // 2
        orders["ff_proj"] = _rank_major([half, half], degree)
    out: dict[str, torch.Tensor] = {}
    for block in blocks:
        for module, order in orders.items():
            for kind in ("weight", "bias"):
                if getattr(getattr(block, module), kind) is not None:
                    out[f"transformer.blocks.{block.layer_id}.{module}.{kind}"] = order
    return out


def _reorder(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``t`` with its rows taken in ``order``; a DTensor keeps its mesh and placements (every rank gathers the full
    tensor once: a collective)."""
    if isinstance(t, DTensor):
        full = t.full_tensor()[order.to(t.device)]
        return distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
    return t[order.to(t.device)]


def canonical_rows(model: nn.Module, state: dict[str, Any]) -> None:
    """Put the fused weights of a ``{"model": ..., "optim": ...}`` state dict (sharded or full, as
    ``olmo.checkpoint.save.model_and_optim_state`` builds it) into the canonical row order, in place. A full state
    dict's tensors are plain (rank 0 only holds them); a sharded one's are DTensors, and every rank must call."""
    orders = fused_row_orders(model)
    if not orders:
        return
    inverse = {name: torch.argsort(order) for name, order in orders.items()}
    model_sd = state["model"]
    optim_state = state.get("optim", {}).get("state", {})
    for name, order in inverse.items():
        if name in model_sd:
            model_sd[name] = _reorder(model_sd[name], order)
        if name in optim_state:  # a new dict: the optimizer's own may be the one in the state dict
            optim_state[name] = {
                key: _reorder(value, order)
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == order.numel()
                else value
                for key, value in optim_state[name].items()
            }


@torch.no_grad()
def order_fused_rows(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Put the fused weights of ``model`` (and their state in ``optimizer``), which hold canonical rows after an
    initialization or a load, into the rank-major order tensor parallelism computes with, in place."""
    orders = fused_row_orders(model)
    params = dict(model.named_parameters()) if orders else {}
    for name, order in orders.items():
        p = params[name]
        p.copy_(_reorder(p, order))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == p.shape:
                state[key] = _reorder(value, order)
