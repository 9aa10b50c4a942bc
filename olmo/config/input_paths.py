"""Every file or folder a run reads, named by its config key, in one place.

:func:`run_inputs` lists them for a :class:`~olmo.config.TrainConfig`, so that what a launch may delete
(``--save_overwrite``, checkpoint retention, rewinds: :mod:`olmo.checkpoint.kept_inputs`) is checked against all of
them, whatever key names them. A new config key that names a file must be added here (or to
:data:`NOT_INPUT_KEYS`): ``tests/checkpoint/test_round4_inputs_kept.py`` fails for a path-like key in neither list.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..exceptions import OLMoConfigurationError
from .stage_sections import stage_data_config

if TYPE_CHECKING:
    from .data_sections import DataConfig
    from .train_config import TrainConfig

__all__ = ["RunInput", "run_inputs", "INPUT_KEYS", "NOT_INPUT_KEYS", "PATH_LIKE_NAME"]


@dataclass(frozen=True)
class RunInput:
    """One path a run reads."""

    key: str
    """The config key that names it, with indices (``evaluators[1].data.paths[0]``)."""
    path: str
    """As the config gives it (a glob pattern or a URL stays one)."""
    read_later: bool
    """Whether the run (or a later launch of it) reads it again after the launch has started: the references and the
    data. ``load_path`` is read once, when the launch restores it."""


INPUT_KEYS = (
    "load_path",
    "dpo.reference_path",
    "kl_reference.load_path",
    "rl.prompts",
    "rl.reference_path",
    "tokenizer.identifier",
    "data.paths",
    "data.label_mask_paths",
    "data.datasets",
    "data.mixture.sources[].paths",
    "data.mixture.sources[].label_mask_paths",
    "stages[].data",
    "evaluators[].data.paths",
    "evaluators[].data.label_mask_paths",
    "evaluators[].data.datasets",
    "evaluators[].data.mixture.sources[].paths",
    "evaluators[].data.mixture.sources[].label_mask_paths",
)
"""The keys :func:`run_inputs` reads, in the generic form (``[]`` for any index) the guard test compares with."""

NOT_INPUT_KEYS = {
    "save_folder": "where the run writes",
    "remote_save_folder": "where the run uploads its checkpoints",
    "load_path_sharded_checkpointer": "a layout hint, not a path",
    "hf_datasets_cache_dir": "a no-op kept so old configs load",
}
"""Path-like keys that name nothing a run reads, with the reason."""

PATH_LIKE_NAME = re.compile(r"(^|_)(paths?|folders?|files?|dirs?|identifier|templates?|checkpoints?)(_|$)")
"""A string field named like this is taken for a path: it must be in :data:`INPUT_KEYS` or :data:`NOT_INPUT_KEYS`."""


def run_inputs(cfg: TrainConfig) -> list[RunInput]:
    """Every path ``cfg`` reads: ``load_path``, the references it uses (``dpo.reference_path`` with ``dpo.enabled``,
    ``kl_reference.load_path`` with a stage whose ``kl_beta`` is above 0, ``rl.reference_path`` with ``rl.beta`` above
    0), RL's prompts (``rl.prompts``), the tokenizer file, and the files of the
    training data, of every stage's own data and of every evaluator. Each path once, under its first key (one that is read later, if any)."""
    found: list[RunInput] = []
    if cfg.load_path is not None:
        found.append(RunInput("load_path", str(cfg.load_path), False))
    if cfg.dpo.enabled and cfg.dpo.reference_path is not None:
        found.append(RunInput("dpo.reference_path", str(cfg.dpo.reference_path), True))
    if cfg.kl_reference.load_path is not None and any(stage.kl_beta > 0 for stage in cfg.stages or []):
        found.append(RunInput("kl_reference.load_path", str(cfg.kl_reference.load_path), True))
    if cfg.rl.enabled and cfg.rl.prompts is not None:
        found.append(RunInput("rl.prompts", str(cfg.rl.prompts), True))
    if cfg.rl.enabled and cfg.rl.beta > 0 and cfg.rl.reference_path is not None:
        found.append(RunInput("rl.reference_path", str(cfg.rl.reference_path), True))
    tokenizer = Path(str(cfg.tokenizer.identifier)).expanduser()
    if tokenizer.is_file():  # otherwise the name of a shipped file or of a hub tokenizer
        found.append(RunInput("tokenizer.identifier", str(tokenizer), True))
    found += _data_inputs("data", cfg.data)
    for i, stage in enumerate(cfg.stages or []):
        if stage.data:
            try:
                found += _data_inputs(
                    f"stages[{i}].data", stage_data_config(cfg.data, stage.data, f"stages[{i}].data")
                )
            except OLMoConfigurationError:
                continue  # validation reports it
    for i, evaluator in enumerate(cfg.evaluators):
        found += _data_inputs(f"evaluators[{i}].data", evaluator.data)
    unique: dict[str, RunInput] = {}
    for entry in found:  # a path read later too (DPO's reference, by default load_path) counts as read later
        if entry.path not in unique or (entry.read_later and not unique[entry.path].read_later):
            unique[entry.path] = entry
    return list(unique.values())


def _data_inputs(key: str, data: Optional[DataConfig]) -> Iterator[RunInput]:
    """The token and label-mask files of the data config at ``key``."""
    if data is None:
        return
    for list_key, paths in data.path_lists(key).items():
        for i, path in enumerate(paths or []):
            yield RunInput(f"{list_key}[{i}]", str(path), True)
