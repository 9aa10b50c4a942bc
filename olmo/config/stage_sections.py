"""Config sections for staged training (``stages:``, ``kl_reference:``), each with the checks of its values, and
durations (``max_duration``, a stage's length) with their parsing.

A run with ``stages`` trains its stages one after another in one launch (and across resumes): each stage has
its own length (``max_duration``), optionally its own data and learning-rate schedule, and a KL penalty to a
frozen reference model (``kl_beta``, ``kl_estimator``). :mod:`olmo.train.stages` turns these sections into step
boundaries; :class:`olmo.train.kl.KLTrainModule` trains the penalty.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from omegaconf import OmegaConf as om
from omegaconf.errors import OmegaConfBaseException

from ..exceptions import OLMoConfigurationError
from ..util import missing_slash_problem
from .data_sections import DataConfig
from .optim_sections import SchedulerConfig
from .sections import StrEnum

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = [
    "KLEstimator",
    "StageConfig",
    "KLReferenceConfig",
    "stage_data_config",
    "segment_lengths",
    "stage_name_problems",
    "stage_sum_problem",
    "parse_duration_steps",
    "DATA_SOURCES",
    "DEFAULT_MAX_DURATION",
]

DATA_SOURCES = ("paths", "datasets", "label_mask_paths", "mixture", "custom_dataset")
"""The fields of ``data`` that say *what* is trained on. A stage that gives any of them replaces all of them;
its other ``data`` fields override the run's one by one."""


class KLEstimator(StrEnum):
    nll_diff = "nll_diff"
    """Per token, the policy's cross entropy minus the reference's (the reference's as a constant): one extra
    forward pass of the reference and no (tokens x vocab) tensor beyond what the loss already makes. Its
    gradient is ``kl_beta`` times the cross entropy's, so it pulls toward the data rather than toward the
    reference; the logged value is an unbiased estimate of KL only where the labels are samples of the policy."""
    full = "full"
    """The exact ``KL(p_policy || p_reference)`` over the whole vocabulary at every labelled position, computed
    with the loss chunk by chunk (as ``fused_loss`` does) from both models' final hidden states, so the logits
    of both models never exist at once. Costs one gathered copy of the reference's output weight and two
    more (chunk x vocab) matmuls per chunk; its gradient pulls toward the reference's distribution."""


@dataclass
class StageConfig:
    """One stage of a staged run (see ``TrainConfig.stages``)."""

    name: Optional[str] = None
    """Shown in the console and logs, and part of file names (``mixture-{name}.json``): up to 64 letters, digits,
    '.', '_' or '-', not starting with '.', different from every other stage's. Default ``stage{i}``."""
    max_duration: Optional[Union[int, str]] = None
    """The stage's length: steps (``1000``), tokens (``"2e9T"``) or epochs of its data (``"1ep"``). Required."""
    data: Optional[dict[str, Any]] = None
    """Any ``data`` fields for this stage, applied over the run's ``data``; giving ``paths`` (or ``datasets``,
    ``label_mask_paths``) replaces the run's files. The stage then gets its own data order, written to
    ``save_folder/train_data/stage{i}/``. Null: continue the previous stage's data where it stopped."""
    kl_beta: float = 0.0
    """Weight of the KL penalty to the frozen reference; 0 trains on the cross entropy alone."""
    kl_estimator: str = "nll_diff"
    """``nll_diff`` (cheap estimate) or ``full`` (exact over the vocabulary); see :class:`KLEstimator`."""
    scheduler: Optional[SchedulerConfig] = None
    """This stage's own learning-rate schedule over its own steps (warmup from its first step); null keeps the
    one schedule of the run, which spans every stage."""

    def problems(self, index: int, global_batch: int, tokens_per_batch: int, run_data: DataConfig) -> list[str]:
        """One sentence per value of ``stages[index]`` that cannot work (checks that need no data files; its
        schedule is checked with the run's, and its name with the other stages').

        :param global_batch: ``global_train_batch_size``.
        :param tokens_per_batch: the tokens of one optimizer step, which turn a length in tokens into steps.
        :param run_data: the run's ``data``, which the stage's ``data`` is applied over.
        """
        where = f"stages[{index}]" + (f" ({self.name})" if self.name else "")
        out: list[str] = []
        if self.max_duration is None:
            out.append(
                f"{where}.max_duration is missing: every stage needs a length, in steps (1000), tokens ('2e9T') "
                f"or epochs of its data ('1ep')."
            )
        else:
            try:
                parse_duration_steps(self.max_duration, global_batch, tokens_per_batch, 0)
            except OLMoConfigurationError as e:
                out.append(f"{where}.{e}")
        if not (math.isfinite(self.kl_beta) and self.kl_beta >= 0):
            out.append(
                f"{where}.kl_beta={self.kl_beta} must be a finite number >= 0 (0 turns the KL penalty off); "
                f"e.g. --stages=[...] with kl_beta: 0.1."
            )
        if self.kl_estimator not in KLEstimator.__members__:
            out.append(
                f"{where}.kl_estimator={self.kl_estimator!r} is not an estimator; use nll_diff (the per-token "
                f"difference of the two models' cross entropies) or full (the exact KL over the vocabulary)."
            )
        if self.data is not None:
            try:
                stage_data_config(run_data, self.data, f"{where}.data")
            except OLMoConfigurationError as e:
                out.append(str(e))
        return out


@dataclass
class KLReferenceConfig:
    """Where the reference of a KL stage comes from."""

    load_path: Optional[str] = None
    """A checkpoint whose model is the frozen reference of every stage with ``kl_beta > 0`` (e.g. to train only
    the KL stage, from an existing model). Null: a snapshot of the model at the first step of the stage, which
    is also saved as ``save_folder/stage{i}-step{N}`` so that a resume rebuilds the same reference."""

    def problems(self) -> list[str]:
        """A line when ``kl_reference.load_path`` is a URL with a slash missing (whether any stage uses the reference
        is a check of the run's)."""
        problem = missing_slash_problem(self.load_path, "kl_reference.load_path")
        return [] if problem is None else [problem]


DEFAULT_MAX_DURATION = 10000
"""Steps a run without ``max_duration`` (and without ``stages``) trains for, as in OLMo."""

MAX_STEPS = 10**12
"""The longest run :func:`parse_duration_steps` accepts: a million times OLMo-2's longest."""


def parse_duration_steps(
    duration: Union[int, str], global_batch: int, tokens_per_batch: int, instances_per_epoch: int
) -> int:
    """Turn ``max_duration`` (``1000``, ``"2e12T"``, ``"3ep"``) into a number of optimizer steps."""
    text = str(duration).strip().replace("_", "")
    unit = "T" if text.endswith("T") else "ep" if text.endswith("ep") else ""
    try:
        amount = float(text[: len(text) - len(unit)])
    except ValueError:
        raise OLMoConfigurationError(
            f"max_duration={duration!r} is not a duration. Use an int number of steps (1000), tokens "
            f"with a T suffix ('2e12T'), or epochs with an ep suffix ('1ep')."
        ) from None
    if not amount > 0 or math.isinf(amount) or (not unit and amount < 1):
        raise OLMoConfigurationError(
            f"max_duration={duration!r} must be a positive, finite duration (steps, tokens with a T suffix, or "
            f"epochs with an ep suffix); a run of no steps would only write a checkpoint. Set --max_duration."
        )
    if unit == "T":
        steps = amount / tokens_per_batch
    elif unit == "ep":
        steps = amount * (instances_per_epoch // global_batch)
    else:
        steps = amount
    if steps > MAX_STEPS:
        raise OLMoConfigurationError(
            f"max_duration={duration!r} is {steps:.3g} steps of {tokens_per_batch:,} tokens; more than {MAX_STEPS:.0e} "
            f"steps is taken for a typo (OLMo-2 13B trained 5e12 tokens in ~600k steps). Set --max_duration to the "
            f"run's real length."
        )
    return math.ceil(steps) if unit == "T" else int(steps)


def segment_lengths(cfg: TrainConfig, first: Optional[int]) -> list[Union[int, str]]:
    """The lengths (``max_duration``) trained on one data config: the run's ``data`` (``first`` None) or
    ``stages[first].data`` (a stage without its own data continues the one before it). Without stages, the run's
    ``max_duration`` (none when null: the default length)."""
    if not cfg.stages:
        return [] if cfg.max_duration is None else [cfg.max_duration]
    start, out = 0 if first is None else first, list[Union[int, str]]()
    for i in range(start, len(cfg.stages)):
        stage = cfg.stages[i]
        if stage.data is not None and (i > start or first is None):
            break  # the next data segment
        if stage.max_duration is not None:
            out.append(stage.max_duration)
    return out


def stage_data_config(run_data: DataConfig, stage_data: Optional[dict[str, Any]], where: str) -> DataConfig:
    """The data of a stage: ``stage_data`` over ``run_data`` (see :data:`DATA_SOURCES`).

    :param where: how to name the stage's data in an error (``stages[1].data``).
    """
    if not stage_data:
        return run_data
    base = om.structured(run_data)
    if any(key in stage_data for key in DATA_SOURCES):
        for key in DATA_SOURCES:
            base[key] = None
    try:
        return om.to_object(om.merge(base, om.create(dict(stage_data))))  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(getattr(e, "msg", None) or e).splitlines()[0].rstrip(".")
        raise OLMoConfigurationError(
            f"{where}.{key}: {msg}. A stage's data takes the fields of the run's data section (paths, datasets, "
            f"label_mask_paths, num_workers, seed, ...; see DataConfig in olmo/config/data_sections.py)."
        ) from None


_STAGE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
"""A stage name becomes part of file names (``mixture-{name}.json``): one safe component, never ``.`` or ``..``."""


def stage_name_problems(stages: list[StageConfig]) -> list[str]:
    """A line for each stage whose name (given, or ``stage{i}``) is not one safe file-name part, or is another's."""
    out, seen = list[str](), dict[str, int]()
    for i, stage in enumerate(stages):
        name = f"stage{i}" if stage.name is None else stage.name
        if not _STAGE_NAME.fullmatch(name):
            out.append(
                f"stages[{i}].name={name!r} must be 1 to 64 letters, digits, '.', '_' or '-', not starting with '.': "
                f"it becomes part of file names (mixture-NAME.json) and log lines. E.g. name: anneal."
            )
        elif name in seen:
            default = (
                " (the name of a stage without one is stage{index})"
                if None in (stage.name, stages[seen[name]].name)
                else ""
            )
            out.append(
                f"stages[{i}].name={name!r} is also the name of stages[{seen[name]}]{default}; stage names are unique, "
                f"as they name the stages' files and log lines. Rename one of them."
            )
        seen.setdefault(name, i)
    return out


def stage_sum_problem(cfg: TrainConfig, total: int, given: int) -> str:
    """The message for stages whose lengths do not add up to ``max_duration``."""
    return (
        f"max_duration={cfg.max_duration!r} is {given} steps, but the stages add up to {total} steps "
        f"(" + " + ".join(str(s.max_duration) for s in cfg.stages or []) + "). With stages the run's length is "
        "their sum: remove max_duration (or set --max_duration=null), or make the two agree."
    )
