"""OLMo's checkpointer objects, for scripts written against the original's ``olmo.checkpoint``: :class:`FullCheckpointer`
(``stepN-unsharded``), and the sharded one :func:`build_sharded_checkpointer` returns (``stepN``, the
``torch.distributed.checkpoint`` layout, which is the original's ``torch_new``). Both save and restore through this
project's checkpoint code, so what they write is atomic, committed by a marker, and loadable with ``--load_path``.

| method | what it does |
|---|---|
| ``save_checkpoint(dir, model, optim, trainer_state)`` | writes the checkpoint at ``dir`` (every rank calls it) |
| ``restore_checkpoint(load_path, model, optim, load_optimizer_state=True)`` | loads it in place; returns the trainer state |
| ``unshard_checkpoint(load_path, device=...)`` | ``(model state, optim state or None, trainer state or None)``, whole tensors |
| ``FullCheckpointer.load_checkpoint(load_path, device=...)`` | ``(model state, optim state or None)`` of an unsharded checkpoint |

The original's ``local`` and ``olmo_core`` writers have no counterpart: every ``sharded_checkpointer`` name
gives the ``torch.distributed.checkpoint`` layout (the trainer does the same), and ``LocalShardedCheckpointer`` is
that checkpointer under the original's name. ``upload_to`` is refused: set ``remote_save_folder`` (uploads in the
background, marker last).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from ..config import TrainConfig
from ..distributed import DistEnv, ParallelizeOptions, ParallelLayout, build_model
from ..exceptions import OLMoCheckpointError
from ..optim import build_optimizer
from .safe_reads import fetch, load_state_file
from .save import begin_checkpoint, commit_checkpoint, model_and_optim_state
from .storage import inspect_checkpoint, load_checkpoint, trainer_state

__all__ = [
    "Checkpointer",
    "FullCheckpointer",
    "TorchNewStyleShardedCheckpointer",
    "LocalShardedCheckpointer",
    "build_sharded_checkpointer",
]

log = logging.getLogger(__name__)

PathOrStr = Union[str, Path]


class Checkpointer:
    """What both checkpointers share; :attr:`sharded` says which layout :meth:`save_checkpoint` writes.

    :param cfg: the run's config, written into every checkpoint as ``config.yaml`` (``save_overwrite`` lets a save
        replace a committed checkpoint at the same place).
    """

    sharded = False

    def __init__(self, cfg: TrainConfig, thread_count: Optional[int] = None):
        del thread_count  # OLMo's I/O threads: torch.distributed.checkpoint schedules its own
        self.cfg = cfg

    def save_checkpoint(
        self,
        dir: PathOrStr,
        dist_model: nn.Module,
        optim: Optional[torch.optim.Optimizer],
        trainer_state: dict[str, Any],
        *,
        upload_to: Optional[str] = None,
    ) -> None:
        """Write the checkpoint at ``dir`` (its step is ``trainer_state["global_step"]``); every rank calls it."""
        if upload_to is not None:
            raise OLMoCheckpointError(
                f"upload_to={upload_to!r} is not supported here: set remote_save_folder in the config, which uploads "
                f"committed checkpoints in the background, marker last."
            )
        target = Path(dir)
        step = int(trainer_state.get("global_step", 0))
        state = model_and_optim_state(dist_model, optim, full=not self.sharded)
        pending = begin_checkpoint(
            target.parent,
            step,
            state,
            trainer_state,
            self.cfg,
            self.sharded,
            self.cfg.save_overwrite,
            name=target.name,
        )
        commit_checkpoint(pending)

    def restore_checkpoint(
        self,
        load_path: PathOrStr,
        dist_model: nn.Module,
        optim: Optional[torch.optim.Optimizer],
        *,
        local_cache: Optional[PathOrStr] = None,
        load_optimizer_state: bool = True,
    ) -> dict[str, Any]:
        """Load the checkpoint at ``load_path`` (any layout ``--load_path`` takes) into ``dist_model`` and, with
        ``load_optimizer_state``, ``optim``, in place; return this rank's trainer state."""
        del local_cache  # remote checkpoints are read in place (``--load_path=s3://...``)
        info = inspect_checkpoint(str(load_path))
        state = load_checkpoint(info, dist_model, optim if load_optimizer_state else None, load_trainer_state=True)
        return state or {}

    def unshard_checkpoint(
        self,
        load_path: PathOrStr,
        *,
        local_cache: Optional[PathOrStr] = None,
        load_optimizer_state: bool = True,
        load_trainer_state: bool = True,
        device: Optional[torch.device] = None,
    ) -> tuple[dict[str, Any], Optional[dict[str, Any]], Optional[dict[str, Any]]]:
        """The checkpoint's whole model and optimizer state (and trainer state) on ``device`` (CPU by default),
        whatever its layout: a sharded one is loaded into the model its ``config.yaml`` describes, in this process."""
        del local_cache
        info = inspect_checkpoint(str(load_path))
        device = device or torch.device("cpu")
        if not info.sharded:
            model_state = load_state_file(info.path, "model")
            optim_state = load_state_file(info.path, "optim") if load_optimizer_state else None
        else:
            cfg = TrainConfig.load_saved(fetch(info.path, "config.yaml"), ["compile=null"])
            cpu = DistEnv(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)
            model = build_model(
                cfg.model, ParallelLayout.of_run(cfg, cpu), ParallelizeOptions.from_train_config(cfg)
            )
            optimizer = build_optimizer(cfg.optimizer, model) if load_optimizer_state else None
            load_checkpoint(info, model, optimizer, load_trainer_state=False)
            full = model_and_optim_state(model, optimizer, full=True)
            model_state, optim_state = full["model"], full.get("optim")
        state = trainer_state(info) if load_trainer_state else None
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model_state.items()}
        return moved, optim_state, state


class FullCheckpointer(Checkpointer):
    """Unsharded checkpoints: whole tensors gathered to rank 0 (``model.pt``, ``optim.pt``, ``train.pt``)."""

    sharded = False

    def load_checkpoint(
        self,
        load_path: PathOrStr,
        *,
        local_cache: Optional[PathOrStr] = None,
        load_optimizer_state: bool = True,
        device: Optional[torch.device] = None,
    ) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
        """``(model state, optimizer state or None)`` of the checkpoint at ``load_path``, whole tensors."""
        model_state, optim_state, _ = self.unshard_checkpoint(
            load_path,
            local_cache=local_cache,
            load_optimizer_state=load_optimizer_state,
            load_trainer_state=False,
            device=device,
        )
        return model_state, optim_state


class TorchNewStyleShardedCheckpointer(Checkpointer):
    """Sharded checkpoints in ``torch.distributed.checkpoint``'s layout (``model_and_optim/``), each rank writing
    its shards; they load on any number of ranks."""

    sharded = True


LocalShardedCheckpointer = TorchNewStyleShardedCheckpointer
"""The original's name; here it writes the same ``torch.distributed.checkpoint`` layout as every sharded writer."""


def build_sharded_checkpointer(
    cfg: TrainConfig, *, name: Optional[Any] = None, use_shared_mem_impl: bool = False
) -> Checkpointer:
    """The sharded checkpointer (OLMo's factory): whatever ``name`` or ``cfg.sharded_checkpointer`` says, the
    ``torch.distributed.checkpoint`` layout (the trainer maps every name onto it too)."""
    del name, use_shared_mem_impl
    return TorchNewStyleShardedCheckpointer(cfg)
