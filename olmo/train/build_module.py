"""Which :class:`~olmo.train.train_module.TrainModule` a run builds, from ``train_module`` and the run's stages."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from ..config import StageConfig, TrainConfig
from ..distributed.collectives import DistEnv
from ..exceptions import OLMoConfigurationError
from . import train_module as _train_module
from .stages import no_kl_penalty_error
from .train_module import TrainModule, TransformerTrainModule

__all__ = [
    "build_train_module",
    "train_module_class",
    "resolve_train_module_class",
    "STAGED_TRAIN_MODULE",
    "DPO_TRAIN_MODULE",
    "RL_TRAIN_MODULE",
    "PIPELINE_TRAIN_MODULE",
]


DPO_TRAIN_MODULE = "olmo.train.dpo.DPOTrainModule"
"""The train module of a run with ``dpo.enabled`` when ``train_module`` is unset."""

RL_TRAIN_MODULE = "olmo.rl.rl_train_module.RLTrainModule"
PIPELINE_TRAIN_MODULE = "olmo.train.pipeline_module.PipelineTrainModule"
"""The train module of a run with ``pipeline_parallel.degree > 1``."""
"""The train module of a run with ``rl.enabled`` (named, not imported: ``olmo.rl`` sits above ``olmo.train``)."""

STAGED_TRAIN_MODULE = "olmo.train.kl.KLTrainModule"
"""The train module of a run with ``stages`` when ``train_module`` is unset (named, not imported: it subclasses
:class:`TransformerTrainModule`)."""


def build_train_module(
    cfg: TrainConfig,
    env: DistEnv,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    train_module: Optional[Union[str, type[TrainModule]]] = None,
) -> TrainModule:
    """The run's train module: :class:`TransformerTrainModule` (:class:`olmo.train.kl.KLTrainModule` for a run with
    ``stages``), or ``train_module`` (a class, or its dotted path ``package.module.ClassName``, or a class name of
    :mod:`olmo.train.train_module`) built by its :meth:`TrainModule.from_config`."""
    pipeline = cfg.pipeline_parallel.degree > 1
    cls = train_module_class(train_module, cfg.stages, cfg.dpo.enabled, cfg.rl.enabled, pipeline)
    return cls.from_config(cfg, env, model, optimizer, scheduler)


def train_module_class(
    train_module: Optional[Union[str, type[TrainModule]]],
    stages: Optional[Sequence[StageConfig]],
    dpo: bool,
    rl: bool = False,
    pipeline: bool = False,
) -> type[TrainModule]:
    """The class :func:`build_train_module` builds for the run's ``stages`` (``dpo``: ``dpo.enabled``); an
    :class:`OLMoConfigurationError` when it cannot be imported, or when a stage has ``kl_beta > 0`` and the class
    does not train a KL penalty (call it before any work)."""
    if train_module is None:
        train_module = STAGED_TRAIN_MODULE if stages else TransformerTrainModule
        if dpo:
            train_module = DPO_TRAIN_MODULE
        if rl:
            train_module = RL_TRAIN_MODULE
        if pipeline:
            train_module = PIPELINE_TRAIN_MODULE
    cls = resolve_train_module_class(train_module)
    if rl and not getattr(cls, "trains_rl", False):
        raise OLMoConfigurationError(
            f"rl.enabled=true, but train_module={train_module!r} does not train the RL step. Leave train_module unset "
            f"(olmo.rl.rl_train_module.RLTrainModule), or use a subclass of it."
        )
    if dpo and not getattr(cls, "trains_dpo", False):
        raise OLMoConfigurationError(
            f"dpo.enabled=true, but train_module={train_module!r} does not train the DPO loss (it would train the "
            f"pairs' cross entropy). Leave train_module unset (olmo.train.dpo.DPOTrainModule), or use a subclass of it."
        )
    kl_stages = [i for i, stage in enumerate(stages or []) if stage.kl_beta > 0]
    if kl_stages and not cls.trains_kl_penalty:
        raise no_kl_penalty_error(repr(train_module), kl_stages[0])
    return cls


def resolve_train_module_class(name: Union[str, type[TrainModule]]) -> type[TrainModule]:
    """The :class:`TrainModule` subclass ``name`` names (a dotted path, or a class name of :mod:`olmo.train.train_module`);
    an :class:`OLMoConfigurationError` when it does not import or is not a TrainModule subclass."""
    if isinstance(name, str):
        module_name, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name or _train_module.__name__), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise OLMoConfigurationError(
                f"train_module: cannot import {name!r} ({e}). Give the dotted path of a TrainModule subclass, "
                f"e.g. 'my_package.modules.MyTrainModule', importable from this environment."
            ) from e
    else:
        found = name
    if not (isinstance(found, type) and issubclass(found, TrainModule)):
        raise OLMoConfigurationError(
            f"train_module: {name!r} is {found!r}, not a subclass of olmo.train.train_module.TrainModule."
        )
    return found
