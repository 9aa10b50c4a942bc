"""Beam search over any step function, with OLMo's interface (``olmo.beam_search``: AllenNLP's design).

A search starts from one prediction per batch row and a state dict of tensors with the batch first. Each step is
``step(last_predictions, state[, timestep]) -> (log_probs, state)``: ``last_predictions`` is (B * beam,) and
``log_probs`` (B * beam, V). The search keeps ``beam_size`` hypotheses per row; each hypothesis proposes
``per_node_beam_size`` next tokens (the :class:`Sampler` picks them: the top ones, or samples), and the best
``beam_size`` of all proposals survive (again the sampler's choice). A hypothesis that has produced ``end_index``
only extends with ``end_index``, at no cost. The state's tensors follow their hypotheses (rows are gathered by
back-pointer each step), which is how :meth:`olmo.model.OLMo.generate` carries its KV cache and the linear-attention
layers' recurrent states.

The result is ``(predictions, scores)``: (B, beam, T) token ids (padded with ``end_index`` after a hypothesis
ends) and (B, beam) scores from the :class:`FinalSequenceScorer`, best first.

Samplers (:mod:`olmo.model.sampling`, re-exported here): :class:`DeterministicSampler` (the top ``k``: plain beam search; with ``beam_size=1`` greedy decoding),
:class:`MultinomialSampler` (temperature), :class:`TopKSampler`, :class:`TopPSampler` (nucleus) and
:class:`GumbelSampler` (stochastic beam search without replacement, Kool et al. 2019). Constraints change the
log-probabilities before each choice: :class:`RepeatedNGramBlockingConstraint` forbids repeating an n-gram.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import torch

from .sampling import (
    DeterministicSampler,
    GumbelSampler,
    MultinomialSampler,
    Sampler,
    TopKSampler,
    TopPSampler,
    lowest,
)

__all__ = [
    "StateType",
    "StepFunctionTypeNoTimestep",
    "StepFunctionTypeWithTimestep",
    "StepFunctionType",
    "ConstraintStateType",
    "Sampler",
    "DeterministicSampler",
    "MultinomialSampler",
    "TopKSampler",
    "TopPSampler",
    "GumbelSampler",
    "FinalSequenceScorer",
    "SequenceLogProbabilityScorer",
    "LengthNormalizedSequenceLogProbabilityScorer",
    "Constraint",
    "RepeatedNGramBlockingConstraint",
    "BeamSearch",
]

StateType = dict[str, torch.Tensor]
StepFunctionTypeWithTimestep = Callable[[torch.Tensor, StateType, int], tuple[torch.Tensor, StateType]]
StepFunctionTypeNoTimestep = Callable[[torch.Tensor, StateType], tuple[torch.Tensor, StateType]]
StepFunctionType = TypeVar("StepFunctionType", StepFunctionTypeWithTimestep, StepFunctionTypeNoTimestep)
ConstraintStateType = list[list[dict[str, Any]]]
"""Per batch row, per hypothesis: the constraint's own bookkeeping."""


class FinalSequenceScorer(ABC):
    """The score that orders the finished hypotheses."""

    @abstractmethod
    def score(self, predictions: torch.Tensor, log_probabilities: torch.Tensor, end_index: int) -> torch.Tensor:
        """(B, beam, T) predictions and (B, beam) log-probabilities -> (B, beam) scores."""


class SequenceLogProbabilityScorer(FinalSequenceScorer):
    """The sequence's log-probability."""

    def score(self, predictions: torch.Tensor, log_probabilities: torch.Tensor, end_index: int) -> torch.Tensor:
        del predictions, end_index
        return log_probabilities


class LengthNormalizedSequenceLogProbabilityScorer(FinalSequenceScorer):
    """The log-probability divided by the length to the power ``length_penalty``; the length counts the generated
    tokens and the end token once (when the sequence reached it), not the start."""

    def __init__(self, length_penalty: float = 1.0) -> None:
        self.length_penalty = length_penalty

    def score(self, predictions: torch.Tensor, log_probabilities: torch.Tensor, end_index: int) -> torch.Tensor:
        lengths = (predictions != end_index).sum(dim=-1) + (predictions[:, :, -1] == end_index)
        return log_probabilities / lengths.to(log_probabilities.dtype).pow(self.length_penalty)


class Constraint(ABC):
    """A rule applied to every hypothesis' next-token log-probabilities, with per-hypothesis state that follows
    the hypotheses as the beams are reordered."""

    @abstractmethod
    def init_state(self, batch_size: int) -> ConstraintStateType:
        """One state per batch row, for its single initial hypothesis."""

    @abstractmethod
    def apply(self, state: ConstraintStateType, class_log_probabilities: torch.Tensor) -> torch.Tensor:
        """Set what the rule forbids in the (B, beam, V) log-probabilities (in place) to the lowest value; return
        them."""

    def update_state(
        self,
        state: ConstraintStateType,
        last_prediction: torch.Tensor,
        last_backpointer: Optional[torch.Tensor] = None,
    ) -> ConstraintStateType:
        """The state after each hypothesis (B, beam) chose ``last_prediction``: the parent's state (by
        back-pointer; the single initial one when None), updated by :meth:`_update_state`."""
        rows = []
        for b in range(last_prediction.size(0)):
            parents = [0] * last_prediction.size(1) if last_backpointer is None else last_backpointer[b].tolist()
            rows.append([copy.deepcopy(state[b][p]) for p in parents])
        return self._update_state(rows, last_prediction)

    @abstractmethod
    def _update_state(self, state: ConstraintStateType, last_prediction: torch.Tensor) -> ConstraintStateType:
        """Record each hypothesis' new token in its (already copied) state."""


class RepeatedNGramBlockingConstraint(Constraint):
    """No hypothesis may produce an n-gram of ``ngram_size`` tokens it has produced before (a finished hypothesis
    still repeats its end token)."""

    def __init__(self, ngram_size: int, **kwargs: Any) -> None:
        del kwargs
        if ngram_size < 1:
            raise ValueError(f"ngram_size must be at least 1; got {ngram_size}.")
        self.ngram_size = ngram_size

    def init_state(self, batch_size: int) -> ConstraintStateType:
        return [[{"seen_ngrams": {}, "current_prefix": []}] for _ in range(batch_size)]

    def apply(self, state: ConstraintStateType, class_log_probabilities: torch.Tensor) -> torch.Tensor:
        forbidden = lowest(class_log_probabilities)
        for b, hypotheses in enumerate(state):
            for i, hypothesis in enumerate(hypotheses):
                for token in hypothesis["seen_ngrams"].get(tuple(hypothesis["current_prefix"]), []):
                    class_log_probabilities[b, i, token] = forbidden
        return class_log_probabilities

    def _update_state(self, state: ConstraintStateType, last_prediction: torch.Tensor) -> ConstraintStateType:
        for b, hypotheses in enumerate(state):
            for i, hypothesis in enumerate(hypotheses):
                token = int(last_prediction[b, i])
                prefix: list[int] = hypothesis["current_prefix"]
                if len(prefix) == self.ngram_size - 1:
                    hypothesis["seen_ngrams"].setdefault(tuple(prefix), []).append(token)
                prefix.append(token)
                if len(prefix) == self.ngram_size:
                    prefix.pop(0)
        return state


class BeamSearch:
    """Beam search (or sampling, with a :class:`Sampler`) over a step function; see the module's docs.

    :param end_index: The token that ends a sequence (OLMo: ``eos_token_id``).
    :param max_steps: Most tokens generated per sequence.
    :param beam_size: Hypotheses kept per batch row (1: greedy decoding, or plain sampling with a sampler).
    :param per_node_beam_size: Proposals per hypothesis and step (default ``beam_size``).
    :param sampler: How proposals and survivors are chosen (default :class:`DeterministicSampler`).
    :param min_steps: Fewest tokens before ``end_index`` may be chosen (default 0).
    :param final_sequence_scorer: Orders the results (default :class:`SequenceLogProbabilityScorer`).
    :param constraints: Applied to the log-probabilities before every choice.
    """

    def __init__(
        self,
        end_index: int,
        *,
        max_steps: int = 50,
        beam_size: int = 10,
        per_node_beam_size: Optional[int] = None,
        sampler: Optional[Sampler] = None,
        min_steps: Optional[int] = None,
        final_sequence_scorer: Optional[FinalSequenceScorer] = None,
        constraints: Optional[list[Constraint]] = None,
    ) -> None:
        if not max_steps > 0:
            raise ValueError(f"max_steps must be positive; got {max_steps}.")
        if not beam_size > 0:
            raise ValueError(f"beam_size must be positive; got {beam_size}.")
        if per_node_beam_size is not None and not per_node_beam_size > 0:
            raise ValueError(f"per_node_beam_size must be positive; got {per_node_beam_size}.")
        if min_steps is not None and not 0 <= min_steps <= max_steps:
            raise ValueError(f"min_steps must be between 0 and max_steps ({max_steps}); got {min_steps}.")
        self._end_index = end_index
        self.max_steps = max_steps
        self.beam_size = beam_size
        self.per_node_beam_size = per_node_beam_size or beam_size
        self.sampler = sampler or DeterministicSampler()
        self.min_steps = min_steps or 0
        self.final_sequence_scorer = final_sequence_scorer or SequenceLogProbabilityScorer()
        self.constraints = constraints or []

    @staticmethod
    def _reconstruct_sequences(predictions: list[torch.Tensor], backpointers: list[torch.Tensor]) -> torch.Tensor:
        """(B, beam, T) token ids: each final hypothesis traced back through the back-pointers."""
        tokens = [predictions[-1]]
        pointer = backpointers[-1] if backpointers else None
        for t in range(len(predictions) - 2, -1, -1):
            assert pointer is not None
            tokens.append(predictions[t].gather(1, pointer))
            if t > 0:
                pointer = backpointers[t - 1].gather(1, pointer)
        return torch.stack(tokens[::-1], dim=-1)

    @torch.no_grad()
    def search(
        self, start_predictions: torch.Tensor, start_state: StateType, step: StepFunctionType
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Search from (B,) ``start_predictions`` and ``start_state`` (tensors with the batch first; updated in
        place to the hypotheses' final rows). ``step`` takes ``(last_predictions, state)`` or ``(last_predictions,
        state, timestep)``.

        :returns: (B, beam, T) predictions and (B, beam) scores, best first.
        :raises ValueError: when ``per_node_beam_size`` is more than the vocabulary.
        """
        takes_timestep = len(inspect.signature(step).parameters) >= 3

        def take_step(last: torch.Tensor, state: StateType, timestep: int) -> tuple[torch.Tensor, StateType]:
            return step(last, state, timestep) if takes_timestep else step(last, state)  # type: ignore[call-arg]

        return self._search(start_predictions, start_state, take_step)

    def _search(
        self,
        start_predictions: torch.Tensor,
        start_state: StateType,
        take_step: Callable[[torch.Tensor, StateType, int], tuple[torch.Tensor, StateType]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, beam, end = start_predictions.size(0), self.beam_size, self._end_index
        constraint_states = [c.init_state(batch_size) for c in self.constraints]
        log_probs, state = take_step(start_predictions, start_state, 0)  # (B, V)
        num_classes = log_probs.size(1)
        if self.per_node_beam_size > num_classes:
            raise ValueError(
                f"per_node_beam_size ({self.per_node_beam_size}, which is beam_size unless set) is more than the "
                f"{num_classes} classes the step function scores; lower beam_size or per_node_beam_size."
            )
        sampler_state = self.sampler.init_state(log_probs, batch_size, num_classes)
        if self.constraints:
            per_beam = log_probs.unsqueeze(1)  # (B, 1, V): one hypothesis per row so far
            for constraint, cstate in zip(self.constraints, constraint_states):
                per_beam = constraint.apply(cstate, per_beam)
            log_probs = per_beam.squeeze(1)
        if self.min_steps >= 1:
            log_probs[:, end] = lowest(log_probs)
        scores, tokens, sampler_state = self.sampler.sample_beams(log_probs, beam, sampler_state)  # (B, beam)
        if beam == 1 and bool((tokens == end).all()):
            warnings.warn(
                "Empty sequences predicted: every row chose the end token first. You may want to raise beam_size "
                "or min_steps, or check the step function.",
                RuntimeWarning,
                stacklevel=3,
            )
            return tokens.unsqueeze(-1), scores

        predictions, backpointers = [tokens], []
        after_end = log_probs.new_full((batch_size * beam, num_classes), lowest(log_probs))
        after_end[:, end] = 0.0  # a finished hypothesis only repeats the end token, at no cost
        self._expand_state(state, batch_size)
        for i, constraint in enumerate(self.constraints):
            constraint_states[i] = constraint.update_state(constraint_states[i], tokens)

        for timestep in range(1, self.max_steps):
            last = predictions[-1].reshape(batch_size * beam)
            if bool((last == end).all()):
                break
            class_log_probs, state = take_step(last, state, timestep)  # (B * beam, V)
            if self.constraints:
                per_beam = class_log_probs.view(batch_size, beam, -1)
                for constraint, cstate in zip(self.constraints, constraint_states):
                    per_beam = constraint.apply(cstate, per_beam)
                class_log_probs = per_beam.view(batch_size * beam, -1)
            if timestep + 1 <= self.min_steps:  # this step chooses token number timestep + 1
                class_log_probs[:, end] = lowest(class_log_probs)
            class_log_probs = torch.where((last == end).unsqueeze(-1), after_end, class_log_probs)
            node_scores, node_tokens, sampler_state = self.sampler.sample_nodes(
                class_log_probs, self.per_node_beam_size, sampler_state
            )  # (B * beam, per_node)
            totals = (node_scores + scores.reshape(batch_size * beam, 1)).reshape(batch_size, -1)
            scores, picked, sampler_state = self.sampler.sample_beams(totals, beam, sampler_state)  # (B, beam)
            tokens = node_tokens.reshape(batch_size, -1).gather(1, picked)
            parents = torch.div(picked, self.per_node_beam_size, rounding_mode="floor")  # (B, beam)
            predictions.append(tokens)
            backpointers.append(parents)
            self._reorder_state(state, parents)
            for i, constraint in enumerate(self.constraints):
                constraint_states[i] = constraint.update_state(constraint_states[i], tokens, parents)

        # Constraints forbid with the lowest value on purpose; without them, a survivor that low is a dead end.
        if not self.constraints and not (torch.isfinite(scores) & (scores > lowest(scores))).all():
            warnings.warn(
                "Negligible log probabilities encountered ('-inf' or equivalent): some final sequences may not make "
                "sense. This happens when beam_size is more than the number of tokens the step function gives a "
                "non-zero probability.",
                RuntimeWarning,
                stacklevel=3,
            )
        sequences = self._reconstruct_sequences(predictions, backpointers)  # (B, beam, T)
        final = self.final_sequence_scorer.score(sequences, scores, end)
        final, order = final.sort(dim=-1, descending=True)
        sequences = sequences.gather(1, order.unsqueeze(-1).expand_as(sequences))
        return sequences, final

    def _expand_state(self, state: StateType, batch_size: int) -> None:
        """Repeat every (B, ...) state tensor for each hypothesis: (B * beam, ...), in place."""
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                rest = value.shape[1:]
                state[key] = value.unsqueeze(1).expand(batch_size, self.beam_size, *rest).reshape(-1, *rest)

    def _reorder_state(self, state: StateType, parents: torch.Tensor) -> None:
        """Give every hypothesis its parent's rows of the (B * beam, ...) state tensors, in place."""
        batch_size = parents.size(0)
        offsets = torch.arange(batch_size, device=parents.device).unsqueeze(1) * self.beam_size
        rows = (parents + offsets).reshape(-1)  # (B * beam,) flat row of each hypothesis' parent
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.index_select(0, rows.to(value.device))
