"""olmo-trainer: OLMo-style, YAML-configured LLM pretraining and fine-tuning.

As in OLMo, ``from olmo import OLMo, TrainConfig, ModelConfig, Tokenizer`` works: the package re-exports the
public names of OLMo 0.6.0's ``olmo/__init__.py`` (its ``olmo.config``, ``olmo.model`` and ``olmo.tokenizer``),
``check_install`` included. Each is imported on first use, so ``import olmo.config`` or
``import olmo.util.json_lines`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import VERSION

__version__ = VERSION

if TYPE_CHECKING:
    from .config import (
        ActivationCheckpointingStrategy,
        ActivationType,
        BlockType,
        CheckpointType,
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
    from .model import (
        GELU,
        Activation,
        LayerNorm,
        LayerNormBase,
        OLMo,
        OLMoBlock,
        OLMoGenerateOutput,
        OLMoOutput,
        OLMoSequentialBlock,
        ReLU,
        RMSLayerNorm,
        RotaryEmbedding,
        SwiGLU,
    )
    from .tokenizer import Tokenizer

__all__ = [
    "ActivationCheckpointingStrategy",
    "ActivationType",
    "BlockType",
    "CheckpointType",
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
    "LayerNormBase",
    "RMSLayerNorm",
    "RotaryEmbedding",
    "Activation",
    "GELU",
    "ReLU",
    "SwiGLU",
    "OLMo",
    "OLMoBlock",
    "OLMoSequentialBlock",
    "OLMoOutput",
    "OLMoGenerateOutput",
    "Tokenizer",
    "check_install",
]


def check_install(cuda: bool = False) -> None:
    """OLMo's smoke check: torch imports (and, with ``cuda``, sees a GPU); prints the version."""
    import torch

    if cuda and not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available to torch on this machine.")
    if cuda:
        print("CUDA available")
    print(f"olmo-trainer v{__version__} installed (torch {torch.__version__})")


# Where ``__getattr__`` looks, cheapest first: only ``model`` imports torch.
_SOURCES = ("config", "tokenizer", "model")


def __getattr__(name: str) -> Any:
    """Import a re-exported name's module on first access (PEP 562)."""
    if name in __all__:
        for source in _SOURCES:
            module = importlib.import_module(f"{__name__}.{source}")
            if hasattr(module, name):
                if source == "model":
                    importlib.import_module(f"{__name__}.checkpoint")  # provides OLMo.from_checkpoint
                value = getattr(module, name)
                globals()[name] = value  # later lookups find it without calling __getattr__
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
