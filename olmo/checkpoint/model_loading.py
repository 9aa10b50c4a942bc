"""A model from a checkpoint directory, weights only: :func:`load_model` (``scripts/generate.py``, scripts of your own)
and ``OLMo.from_checkpoint`` (OLMo's name), which this module provides to :class:`olmo.model.OLMo` when imported."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..config import TrainConfig
from ..model import OLMo
from ..model.transformer import register_checkpoint_loader
from .restore import RestorePlan, preflight_restore
from .safe_reads import fetch
from .storage import inspect_checkpoint, load_checkpoint

__all__ = ["load_model"]


def load_model(
    checkpoint: str, device: Union[str, torch.device] = "cpu", dtype: Optional[torch.dtype] = None
) -> tuple[OLMo, TrainConfig, int]:
    """The model of ``checkpoint`` (any format :func:`inspect_checkpoint` knows: ours sharded or unsharded, the
    original OLMo's, an import from transformers) on ``device`` in eval mode, its config and its step.

    :raises OLMoCheckpointError: for a missing, damaged or mismatched checkpoint, before the weights are read.
    """
    info = inspect_checkpoint(checkpoint, flag="CHECKPOINT")
    cfg = TrainConfig.load_saved(fetch(info.path, "config.yaml"), ["compile=null"])
    preflight_restore(RestorePlan(info, load_optimizer_state=False, load_trainer_state=False), cfg.model)
    model = OLMo(cfg.model, init_params=False)
    load_checkpoint(info, model, None, load_trainer_state=False)
    return model.to(device=device, dtype=dtype).eval(), cfg, info.step


def _from_checkpoint(
    checkpoint_dir: str, device: Union[str, torch.device], checkpoint_type: Optional[str]
) -> OLMo:
    del checkpoint_type  # the directory's contents say which kind it is
    return load_model(str(checkpoint_dir), device)[0]


register_checkpoint_loader(_from_checkpoint)
