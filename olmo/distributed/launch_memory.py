"""Whether a launch's model can fit its device at all, checked before anything is written or built.

A model far too large for the device (a typo in ``model.moe.hidden_size``, ``d_model``, ``n_layers``) would
otherwise fail in the allocator after the run folder exists. The check is a lower bound, so it never refuses a run
that could fit: the fp32 weights, gradients and optimizer state every step keeps (bytes per parameter as
:func:`state_bytes_per_param` says), spread over every process as if all of them sharded everything, against the
memory one process can have (a GPU's own memory; on a CPU the machine's physical memory over the processes it
runs). ``scripts/train.py --dry_run`` estimates the rest (activations, gathered weights, the loss) with the same
counts (:func:`meta_model`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from ..config import ModelConfig
from ..exceptions import OLMoConfigurationError
from ..model import OLMo
from .run_shape import RunShape

__all__ = ["meta_model", "state_bytes_per_param", "launch_memory_problem", "check_launch_memory"]

GIB = 2**30


def meta_model(model: ModelConfig) -> OLMo:
    """``OLMo(model)`` on the meta device: every shape and count, nothing allocated. The attention kernel changes
    no count; asking for flash-attn would load it (and warn where it is missing), so it is not asked for."""
    with torch.device("meta"):
        return OLMo(dataclasses.replace(model, flash_attention=False))


def state_bytes_per_param(optimizer: str) -> tuple[int, int, int]:
    """Bytes per parameter a training step keeps: fp32 weights, fp32 gradients, optimizer state (AdamW's two fp32
    moments; LionW's and Muon's one)."""
    return 4, 4, 8 if optimizer == "adamw" else 4


def launch_memory_problem(
    run: RunShape, num_params: int, world_size: int, memory_bytes: float, where: str
) -> Optional[str]:
    """The paragraph that refuses ``run`` when its model's state cannot fit ``memory_bytes`` per process even
    spread over all ``world_size`` processes; None when it might fit.

    :param where: what ``memory_bytes`` is, for the message (``"of this GPU (NVIDIA H100)"``).
    """
    sharded = run.distributed_strategy == "fsdp" and str(run.fsdp and run.fsdp.sharding_strategy) != "NO_SHARD"
    # Without FSDP, tensor and expert parallelism still split the weights: a lower bound divides the whole model by
    # both degrees (only the experts are split by the one, only the rest by the other), never refusing what could fit.
    layout = run.layout(world_size)
    split = layout.tensor * (layout.expert if layout.expert_sharded else 1)
    ranks = world_size if sharded else min(world_size, split)
    per_param = sum(state_bytes_per_param(str(run.optimizer.name)))
    need = per_param * num_params / ranks
    if need <= memory_bytes:
        return None
    over = f"sharded over {ranks} processes" if ranks > 1 else "none of it sharded"
    return (
        f"The model does not fit: its {num_params:,} parameters alone need at least {need / GIB:,.1f} GiB per "
        f"process ({per_param} bytes each: fp32 weights, gradients and {run.optimizer.name} state; {over}), more "
        f"than the {memory_bytes / GIB:,.1f} GiB {where}, before any activation. Nothing was written. "
        f"scripts/train.py CONFIG --dry_run estimates the whole run's memory; shrink the model (model.d_model, "
        f"model.n_layers, model.mlp_ratio, model.moe.hidden_size or model.moe.num_experts), shard it over more "
        f"processes (distributed_strategy=fsdp under torchrun), or use a device with more memory."
    )


def check_launch_memory(run: RunShape, world_size: int, local_world_size: int) -> None:
    """Refuse a launch whose model certainly cannot fit this process's device (:func:`launch_memory_problem`),
    before anything is written: on a GPU its own memory, on a CPU the physical memory over the
    ``local_world_size`` processes of this machine. Builds the model on the meta device only.

    :raises OLMoConfigurationError: the one paragraph, naming the model's keys and the fixes.
    """
    if torch.cuda.is_available():
        from .collectives import launch_device

        device = launch_device()
        props = torch.cuda.get_device_properties(device)
        memory, where = float(props.total_memory), f"of this GPU ({props.name})"
    else:
        physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        memory = physical / max(1, local_world_size)
        share = f", shared by its {local_world_size} processes" if local_world_size > 1 else ""
        where = f"of this machine's physical memory{share}"
    problem = launch_memory_problem(run, meta_model(run.model).num_params(), world_size, memory, where)
    if problem is not None:
        raise OLMoConfigurationError(problem)
