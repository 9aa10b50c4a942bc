"""olmo-trainer: OLMo-style, YAML-configured LLM pretraining and fine-tuning.

As in OLMo, ``from olmo import OLMo, TrainConfig, ModelConfig, Tokenizer`` works: the package re-exports the
public names of OLMo 0.6.0's ``olmo.config``, ``olmo.model`` and ``olmo.tokenizer`` that this project has
(not OLMo's ``CheckpointType``, nor its model building blocks other than ``LayerNorm`` and ``OLMoBlock``).
Each is imported on first use, so ``import olmo.config`` or ``import olmo.util.json_lines`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import (
        ActivationCheckpointingStrategy,
        ActivationType,
        BlockType,
        CompilerConfig,
        DataConfig,
        DDPConfig,
        DDPGradSyncMode,
        DistributedStrategy,
        EvaluatorConfig,
        FSDPConfig,
        FSDPPrecision,
        FSDPWrapStrategy,
        InitFnType,
        InstanceFilterConfig,
        LayerNormType,
        ModelConfig,
        OptimizerConfig,
        OptimizerType,
        PaddingDirection,
        RemoteDataConfig,
        SchedulerConfig,
        SchedulerType,
        SpeedMonitorConfig,
        TokenizerConfig,
        TrainConfig,
        TruncationDirection,
        WandbConfig,
    )
    from .model import LayerNorm, OLMo, OLMoBlock, OLMoOutput
    from .tokenizer import Tokenizer

__all__ = [
    "ActivationCheckpointingStrategy",
    "ActivationType",
    "BlockType",
    "CompilerConfig",
    "DataConfig",
    "DDPConfig",
    "DDPGradSyncMode",
    "DistributedStrategy",
    "EvaluatorConfig",
    "FSDPConfig",
    "FSDPPrecision",
    "FSDPWrapStrategy",
    "InitFnType",
    "InstanceFilterConfig",
    "RemoteDataConfig",
    "LayerNormType",
    "ModelConfig",
    "OptimizerConfig",
    "OptimizerType",
    "PaddingDirection",
    "SchedulerConfig",
    "SchedulerType",
    "SpeedMonitorConfig",
    "TokenizerConfig",
    "TrainConfig",
    "TruncationDirection",
    "WandbConfig",
    "LayerNorm",
    "OLMo",
    "OLMoBlock",
    "OLMoOutput",
    "Tokenizer",
]


# Where ``__getattr__`` looks, cheapest first: only ``model`` imports torch.
_SOURCES = ("config", "tokenizer", "model")


def __getattr__(name: str) -> Any:
    """Import a re-exported name's module on first access (PEP 562)."""
    if name in __all__:
        for source in _SOURCES:
            module = importlib.import_module(f"{__name__}.{source}")
            if hasattr(module, name):
                value = getattr(module, name)
                globals()[name] = value  # later lookups find it without calling __getattr__
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
