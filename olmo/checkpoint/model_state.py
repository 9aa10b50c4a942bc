"""What a checkpoint holds of a model and its optimizer (:func:`model_and_optim_state`): full tensors for an
unsharded checkpoint, this rank's shards for a sharded one, in the canonical form every layout loads (tensor
parallelism's rows canonical, float8 weights plain, a pipeline stage's part completed into the whole model's), and a
fresh optimizer's state as the state a first step creates."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)
from torch.distributed.tensor import DTensor

from ..distributed.tensor_parallel import canonical_rows

__all__ = ["FULL_STATE", "STAGE_FULL_STATE", "model_and_optim_state", "plain_tensors"]

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""The options of an unsharded save and load: full state dicts, gathered on the CPU."""
STAGE_FULL_STATE = StateDictOptions(full_state_dict=True)
"""A pipeline stage's unsharded save: full tensors on every rank of the stage (moved to the CPU to be gathered)."""


def model_and_optim_state(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], full: bool
) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (no ``"optim"`` when ``optimizer`` is None) as checkpoints hold them:
    with ``full``, whole tensors gathered on the CPU (``stepN-unsharded/model.pt`` and ``optim.pt``; complete on
    rank 0); otherwise this rank's shards (DTensors under FSDP), what ``stepN/model_and_optim`` is written from."""
    if optimizer is None:
        options = STAGE_FULL_STATE if getattr(model, "holds_part", False) else FULL_STATE
        model_only: dict[str, Any] = {"model": get_model_state_dict(model, options=options if full else None)}
        canonical_rows(model, model_only)
        if getattr(model, "holds_part", False):
            model.complete_state(model_only, full, model.pipeline_group)  # type: ignore[operator]
        return plain_tensors(model_only)
    fresh = not optimizer.state  # no step taken yet (a step-0 checkpoint)
    if full:
        # A pipeline stage's part is gathered on each stage's ranks (torch's CPU offload keeps global rank 0's
        # alone), then sent to rank 0 by complete_state.
        options = STAGE_FULL_STATE if getattr(model, "holds_part", False) else FULL_STATE
        state: dict[str, Any] = {"model": get_model_state_dict(model, options=options)}
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    if fresh:
        _as_fresh_optimizer_state(optimizer, state["optim"])
    canonical_rows(model, state)  # tensor parallelism's rank-major fused rows, stored canonical
    if getattr(model, "holds_part", False):  # a pipeline stage's: the whole model's groups (and tensors, full)
        model.complete_state(state, full, model.pipeline_group)  # type: ignore[operator]
    return plain_tensors(state)


def plain_tensors(state: Any) -> Any:
    """``state`` (nested dicts and lists of tensors, in place) with every tensor subclass that wraps one plain
    tensor replaced by that tensor, sharing its memory; a DTensor keeps its layout around the unwrapped shard.

    Float8 training under FSDP holds its weights as torchao's ``WeightWithDynamicFloat8CastTensor``; a sharded
    checkpoint written from them would pickle that class into its metadata, which a run without torchao (or
    ``torch.load(weights_only=True)``) cannot read. Plain tensors keep checkpoints the same with or without
    float8, and loading in place into the shared memory loads the float8 run's weights too."""
    if isinstance(state, dict):
        for key, value in state.items():
            state[key] = plain_tensors(value)
    elif isinstance(state, list):
        state[:] = [plain_tensors(value) for value in state]
    elif isinstance(state, DTensor):
        local = state.to_local()
        inner = _unwrapped(local)
        if inner is not local:
            with torch.no_grad():
                return DTensor.from_local(
                    inner,
                    state.device_mesh,
                    state.placements,
                    run_check=False,
                    shape=state.shape,
                    stride=state.stride(),
                )
    elif isinstance(state, torch.Tensor):
        return _unwrapped(state)
    return state


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor a wrapper subclass holds the values of (torchao's float8 weights: their ``_tensor``, beside a
    precomputed scale once FSDP has gathered them), found as the inner tensor of the wrapper's own shape and dtype;
    ``tensor`` itself when it is plain or no inner tensor is that."""
    while type(tensor) not in (torch.Tensor, nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, n) for n in names]
        same = [t for t in inner if t.shape == tensor.shape and t.dtype == tensor.dtype]
        if len(same) != 1:
            break
        tensor = same[0]
    return tensor


def _as_fresh_optimizer_state(optimizer: torch.optim.Optimizer, optim_sd: dict[str, Any]) -> None:
    """Undo what torch's state-dict functions do to an optimizer that has taken no step yet.

    They create its state by running ``step()`` once with zero gradients and a zero learning rate: the weights and
    the moments stay zero, but each ``step`` count becomes 1, so the run's first real update would use the second
    step's bias correction (a run that saved at step 0 would train differently from one that did not). The live
    optimizer gets back its empty state, exactly as it was; the checkpoint records the step counts as 0, which is
    the state a first step creates, so a run resumed from it continues bitwise as the uninterrupted one.
    """
    optimizer.state.clear()
    for entry in optim_sd.get("state", {}).values():  # a full state is complete on rank 0 only, empty elsewhere
        if isinstance(entry, dict) and "step" in entry:
            entry["step"] = torch.zeros_like(entry["step"])
