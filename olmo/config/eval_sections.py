"""The ``evaluators:`` section: each in-loop evaluation (:class:`EvaluatorConfig`), with the checks of its values,
and the check of downstream task labels against those ``olmo_eval`` knows (cheap: no task is built).

Import it from :mod:`olmo.config`, which re-exports it.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .data_sections import DataConfig
from .sections import EvaluatorType

__all__ = [
    "EvaluatorConfig",
    "DOWNSTREAM_DEFINITIONS",
    "MAX_GENERATED_TOKENS",
    "task_labels",
    "unknown_label_problems",
]

MAX_GENERATED_TOKENS = 4096
DOWNSTREAM_DEFINITIONS = ("olmo_eval", "olmo-0.6")
"""``EvaluatorConfig.definitions``: ai2-olmo-eval's metric definitions, or the original OLMo 0.6 trainer's."""


@dataclass
class EvaluatorConfig:
    label: str = "???"
    """Name of the evaluator: the metric prefix, and for ``downstream`` the ai2-olmo-eval task label."""
    type: EvaluatorType = EvaluatorType.lm
    """``lm`` (cross entropy and perplexity over token files), ``downstream`` (multiple-choice task) or
    ``generate`` (text sampled from ``prompts``, logged; see :mod:`olmo.eval.samples`)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The token files an ``lm`` evaluator scores (``paths``, or ``datasets``: label -> files)."""
    device_eval_batch_size: Optional[int] = None
    """Instances per batch on each rank; None uses the top-level ``device_eval_batch_size``."""
    subset_num_batches: Optional[int] = None
    """Batches per rank to score; None uses ``eval_subset_num_batches``."""
    definitions: str = "olmo_eval"
    """``downstream`` only: whose metric definitions. ``olmo_eval`` (the default: ai2-olmo-eval's, which OLMES and
    current AI2 evaluations use): ``len_norm`` divides by the continuation's length in characters with its leading
    space, and queries longer than ``model.max_sequence_length`` lose tokens on the left. ``olmo-0.6``: the
    original OLMo trainer's (0.6), for comparing with numbers it logged: the length without the leading space,
    and queries cut only past 2048 tokens, its default, whatever the model's length."""
    prompts: list[str] = field(default_factory=list)
    """``generate`` only: the texts to continue at every evaluation."""
    max_new_tokens: int = 32
    """``generate`` only: most tokens generated per prompt."""
    temperature: float = 0.0
    """``generate`` only: 0 is greedy decoding; above 0 (finite) samples (seeded by ``seed``: the same draw each
    time)."""
    top_k: Optional[int] = None
    """``generate`` only: sample from the ``top_k`` most likely tokens (1 to ``model.vocab_size``)."""
    top_p: Optional[float] = None
    """``generate`` only: sample from the nucleus of probability ``top_p``, in (0, 1]."""

    def batch_size(self, run_default: int) -> int:
        """Instances per forward pass: ``device_eval_batch_size``, else the run's (``run_default``)."""
        return run_default if self.device_eval_batch_size is None else self.device_eval_batch_size

    def problems(self, key: str, run_batch_size: int, vocab_size: int) -> list[str]:
        """One sentence per value of the evaluator at ``key`` (``evaluators[0]``) that cannot work; its downstream
        label is checked with the others' (:func:`unknown_label_problems`). Builds nothing.

        :param run_batch_size: the run's ``device_eval_batch_size``, for an evaluator without its own.
        :param vocab_size: ``model.vocab_size``, which a generate evaluator's ``top_k`` cannot exceed.
        """
        out: list[str] = []
        if self.batch_size(run_batch_size) < 1:
            out.append(f"{key}.device_eval_batch_size (or device_eval_batch_size) must be at least 1.")
        if self.definitions not in DOWNSTREAM_DEFINITIONS:
            out.append(
                f"{key}.definitions={self.definitions!r} is not a set of metric definitions; use "
                f"{' or '.join(DOWNSTREAM_DEFINITIONS)}."
            )
        if self.type == EvaluatorType.generate:
            out += self._generation_problems(key, vocab_size)
        elif self.type == EvaluatorType.lm:
            out += self._lm_data_problems(key)
        return out

    def _lm_data_problems(self, key: str) -> list[str]:
        """What is wrong with the token files an ``lm`` evaluator scores."""
        if self.data.mixture is not None:
            return [
                f"{key}.data.mixture: an evaluator reads its files whole, not a mixture; list them in "
                f"{key}.data.paths or, per label, in {key}.data.datasets."
            ]
        if not (self.data.paths or self.data.datasets):
            return [
                f"{key} (label {self.label!r}) is an lm evaluator without data: set {key}.data.paths to token "
                f"files or {key}.data.datasets to label -> files, or set {key}.type=downstream."
            ]
        return self.data.location_problems(f"{key}.data")

    def _generation_problems(self, key: str, vocab_size: int) -> list[str]:
        """What is wrong with a ``generate`` evaluator's settings, for a model of ``vocab_size`` tokens."""
        out: list[str] = []
        if not self.prompts or not all(isinstance(p, str) and p for p in self.prompts):
            out.append(
                f"{key} (label {self.label!r}) is a generate evaluator without prompts: set {key}.prompts to a list "
                f'of texts, e.g. ["The capital of France is"].'
            )
        if not 1 <= self.max_new_tokens <= MAX_GENERATED_TOKENS:
            out.append(f"{key}.max_new_tokens={self.max_new_tokens} must be between 1 and {MAX_GENERATED_TOKENS}.")
        if not 0 <= self.temperature < math.inf:
            out.append(f"{key}.temperature={self.temperature} must be a finite number >= 0 (0: greedy decoding).")
        if self.top_k is not None and self.top_p is not None:
            out.append(f"{key}: give top_k or top_p, not both.")
        if self.top_k is not None and not 1 <= self.top_k <= vocab_size:
            out.append(
                f"{key}.top_k={self.top_k} must be from 1 to model.vocab_size={vocab_size} (the tokens sampled from)."
            )
        if self.top_p is not None and not 0 < self.top_p <= 1:
            out.append(f"{key}.top_p={self.top_p} must be in (0, 1].")
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            out.append(f"{key}: top_k and top_p sample; set {key}.temperature above 0 (e.g. 0.8) with them.")
        return out


@functools.lru_cache(maxsize=1)
def task_labels() -> list[str]:
    """Every downstream label ``olmo_eval`` knows (``olmo_eval.tasks.LABEL_TO_TASK_MAP``), sorted.

    Read from the source of ``olmo_eval/tasks.py`` when its map is made of literal dictionaries (it is, in every
    release so far): importing the module imports torch and ``datasets``, seconds that a config error should not wait
    for. Anything else in that map falls back to the import.
    """
    labels = _literal_task_labels()
    if labels is None:
        from olmo_eval.tasks import LABEL_TO_TASK_MAP

        labels = list(LABEL_TO_TASK_MAP)
    return sorted(labels)


def _literal_task_labels() -> Optional[list[str]]:
    """The keys of ``LABEL_TO_TASK_MAP`` in ``olmo_eval/tasks.py``'s source, following ``**NAME`` entries to the
    dictionaries the module assigns to those names; None where the source says something else."""
    spec = importlib.util.find_spec("olmo_eval")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    try:
        tree = ast.parse((Path(folders[0]) / "tasks.py").read_text(encoding="utf-8"))
    except (IndexError, OSError, SyntaxError, ValueError):
        return None
    if _maps_changed_after_assignment(tree):
        return None
    dicts = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Dict)
    }

    def keys(name: str, depth: int = 0) -> Optional[list[str]]:
        value = dicts.get(name)
        if value is None or depth > 8:
            return None
        out: list[str] = []
        for key, item in zip(value.keys, value.values):
            if key is None and isinstance(item, ast.Name):  # **OTHER_MAP
                more = keys(item.id, depth + 1)
                if more is None:
                    return None
                out.extend(more)
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                out.append(key.value)
            else:
                return None
        return out

    return keys("LABEL_TO_TASK_MAP")


_MUTATING = frozenset({"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__", "__ior__"})


def _maps_changed_after_assignment(tree: ast.Module) -> bool:
    """Whether ``olmo_eval/tasks.py`` changes a ``LABEL_TO_TASK_MAP*`` dictionary other than by its one literal
    assignment (assigned twice, an item set or deleted, a method called on it), which reading the literals would
    miss."""

    def is_map(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id.startswith("LABEL_TO_TASK_MAP")

    stores: dict[str, int] = {}
    for node in ast.walk(tree):
        if is_map(node) and isinstance(node.ctx, ast.Store):  # type: ignore[attr-defined]
            stores[node.id] = stores.get(node.id, 0) + 1  # type: ignore[attr-defined]
        elif isinstance(node, ast.Subscript) and is_map(node.value) and not isinstance(node.ctx, ast.Load):
            return True  # MAP[k] = v, del MAP[k]
        elif isinstance(node, ast.Attribute) and is_map(node.value) and node.attr in _MUTATING:
            return True  # MAP.update(...), MAP.setdefault(...)
    return any(n > 1 for n in stores.values())


def unknown_label_problems(labels: Mapping[str, str]) -> list[str]:
    """Problems with downstream labels (``{config key: label}``): a line for each label that ``olmo_eval``
    does not know, with close matches, then one listing every known label, closest first. Empty when
    every label is known. Cheap (no task is built), so config validation can call it first.
    """
    known = task_labels()
    unknown = {key: label for key, label in labels.items() if label not in known}
    if not unknown:
        return []
    problems = []
    for key, label in unknown.items():
        close = difflib.get_close_matches(label, known, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        problems.append(f"{key}={label!r} is not a downstream task in ai2-olmo-eval.{hint}")
    close_first = {
        c: None for label in unknown.values() for c in difflib.get_close_matches(label, known, n=10, cutoff=0.4)
    }
    available = [*close_first, *(label for label in known if label not in close_first)]
    problems.append(
        f"Available downstream labels ({len(known)}, closest first): {', '.join(available)}. "
        "Fix the label, or make the evaluator type: lm with data."
    )
    return problems
