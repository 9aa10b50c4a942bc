"""OLMo's ``data.custom_dataset`` in Python: a dataset class (or function) named by its import path, built with
``args``, and the collator of its items (:func:`olmo.data.build_collator`).

What is supported: :func:`build_custom_dataset` and :func:`olmo.data.build_collator` (field names mapped by
``collate_config``, or a ``collate_fn`` by import path), for scripts that build their own loop. What is not:
training from ``scripts/train.py`` with a custom dataset, which validation refuses with its fix. The trainer reads
token memmaps because that is what makes its promises hold: the exact data order written to
``global_indices.npy``, resume at any step on any number of ranks, the index of every instance of a batch. An
arbitrary ``Dataset`` class promises none of that. Importing code named by a config file is also why the trainer
will not do it unattended.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from ..config import DataConfig, TrainConfig
from ..exceptions import OLMoConfigurationError

__all__ = ["extract_module_and_class", "import_by_name", "build_custom_dataset"]


def extract_module_and_class(name: str) -> tuple[Optional[str], str]:
    """``"a.b.C"`` -> ``("a.b", "C")``; a bare name has no module: ``"C"`` -> ``(None, "C")``."""
    module, _, attribute = name.rpartition(".")
    return (module or None), attribute


def import_by_name(name: str, module: Optional[str] = None, key: str = "data.custom_dataset.name") -> Any:
    """The object ``module.name`` (``name`` may carry its module: ``"collections.Counter"``).

    :raises OLMoConfigurationError: naming ``key``, when the module or the name is not there.
    """
    if module is None:
        module, name = extract_module_and_class(name)
    if module is None:
        raise OLMoConfigurationError(
            f"{key}={name!r} names no module: give its import path (package.module.Class) or set the module."
        )
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise OLMoConfigurationError(f"{key}: cannot import {name!r} from {module!r} ({e}).") from None


def build_custom_dataset(cfg: DataConfig | TrainConfig) -> Any:
    """The dataset ``data.custom_dataset`` names, called with its ``args`` as keyword arguments.

    :param cfg: the data config, or (OLMo's signature) the whole config, whose ``data`` is used.
    :raises OLMoConfigurationError: when there is no custom dataset, or it cannot be imported.
    """
    spec = (cfg.data if isinstance(cfg, TrainConfig) else cfg).custom_dataset
    if spec is None:
        raise OLMoConfigurationError("data.custom_dataset is not set: there is no custom dataset to build.")
    cls = import_by_name(spec.name, spec.module)
    return cls(**(spec.args or {}))
