"""The samplers of beam search (:mod:`olmo.model.beams`, OLMo's ``olmo.beam_search`` names): how each
hypothesis' proposals and the surviving hypotheses are chosen. :class:`DeterministicSampler` takes the top ones
(beam search; greedy decoding with one beam); :class:`MultinomialSampler`, :class:`TopKSampler` and
:class:`TopPSampler` sample at a temperature; :class:`GumbelSampler` is stochastic beam search."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = [
    "Sampler",
    "DeterministicSampler",
    "MultinomialSampler",
    "TopKSampler",
    "TopPSampler",
    "GumbelSampler",
    "lowest",
]


def lowest(t: torch.Tensor) -> float:
    """The most negative finite value of ``t``'s dtype: a log-probability that never wins, without NaNs."""
    return torch.finfo(t.dtype).min


class Sampler(ABC):
    """Picks the proposals of each hypothesis (:meth:`sample_nodes`) and the hypotheses that survive
    (:meth:`sample_beams`, the top ones unless overridden). ``state`` is the sampler's own, threaded through."""

    def init_state(
        self, start_class_log_probabilities: torch.Tensor, batch_size: int, num_classes: int
    ) -> dict[str, torch.Tensor]:
        """The state before the first choice (``start_class_log_probabilities``: (B, V))."""
        del start_class_log_probabilities, batch_size, num_classes
        return {}

    @abstractmethod
    def sample_nodes(
        self, log_probs: torch.Tensor, per_node_beam_size: int, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(N, V) log-probabilities -> the chosen (N, per_node_beam_size) log-probabilities, their token ids, and
        the new state."""

    def sample_beams(
        self, log_probs: torch.Tensor, beam_size: int, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(B, candidates) summed log-probabilities -> the (B, beam_size) survivors' values and indices, best
        first."""
        values, indices = log_probs.topk(beam_size, dim=-1)
        return values, indices, state


class DeterministicSampler(Sampler):
    """The most likely proposals: plain beam search (greedy decoding with ``beam_size=1``)."""

    def sample_nodes(
        self, log_probs: torch.Tensor, per_node_beam_size: int, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        values, indices = log_probs.topk(per_node_beam_size, dim=-1)
        return values, indices, state


def _sample(candidates: torch.Tensor, count: int, temperature: float, with_replacement: bool) -> torch.Tensor:
    """Sample ``count`` columns of ``candidates`` (N, C) log-probabilities, each with probability proportional to
    ``exp(candidates / temperature)``; masked candidates hold the dtype's lowest value."""
    weights = torch.softmax(candidates / temperature, dim=-1)
    return torch.multinomial(weights, count, replacement=with_replacement)


def _positive(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"temperature must be positive; got {temperature}.")
    return temperature


class MultinomialSampler(Sampler):
    """Proposals sampled from the whole distribution, sharpened (``temperature`` < 1) or flattened (> 1).

    :param with_replacement: Whether a hypothesis may propose the same token twice.
    """

    def __init__(self, temperature: float = 1.0, with_replacement: bool = False) -> None:
        self.temperature = _positive(temperature)
        self.with_replacement = with_replacement

    def sample_nodes(
        self, log_probs: torch.Tensor, per_node_beam_size: int, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        chosen = _sample(log_probs, per_node_beam_size, self.temperature, self.with_replacement)
        return log_probs.gather(1, chosen), chosen, state


class TopKSampler(Sampler):
    """Proposals sampled from the ``k`` most likely tokens only (at ``temperature``).

    :raises ValueError: at search time, unless ``per_node_beam_size <= k <= V``.
    """

    def __init__(self, k: int = 1, temperature: float = 1.0, with_replacement: bool = False) -> None:
        self.k = k
        self.temperature = _positive(temperature)
        self.with_replacement = with_replacement

    def sample_nodes(
        self, log_probs: torch.Tensor, per_node_beam_size: int, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        if not per_node_beam_size <= self.k <= log_probs.size(-1):
            raise ValueError(
                f"TopKSampler k={self.k} must be at least per_node_beam_size ({per_node_beam_size}) and at most the "
                f"vocabulary size ({log_probs.size(-1)})."
            )
        top_values, top_tokens = log_probs.topk(self.k, dim=-1)  # (N, k)
        picks = _sample(top_values, per_node_beam_size, self.temperature, self.with_replacement)
        chosen = top_tokens.gather(1, picks)
        return log_probs.gather(1, chosen), chosen, state


class TopPSampler(Sampler):
    """Nucleus sampling: proposals sampled from the smallest set of most likely tokens whose probability (at
    ``temperature``) reaches ``p``; the token that crosses ``p`` is kept. Without replacement, at least
    ``per_node_beam_size`` tokens are kept.

    :raises ValueError: for ``p`` outside [0, 1].
    """

    def __init__(self, p: float = 0.9, temperature: float = 1.0, with_replacement: bool = False) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"TopPSampler p={p} must be in [0, 1].")
        self.p = p
        self.temperature = _positive(temperature)
        self.with_replacement = with_replacement

    def sample_nodes(
        self, log_probs: torch.Tensor, per_node_beam_size: int, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        if not per_node_beam_size <= log_probs.size(-1):
            raise ValueError(
                f"per_node_beam_size ({per_node_beam_size}) is more than the vocabulary ({log_probs.size(-1)})."
            )
        scaled = log_probs if self.temperature == 1.0 else torch.log_softmax(log_probs / self.temperature, dim=-1)
        ordered, order = scaled.sort(dim=-1, descending=True)  # (N, V)
        reached = ordered.exp().cumsum(dim=-1) >= self.p
        # A token is dropped once the ones before it already reach p (so the one that crosses p stays).
        drop = torch.zeros_like(reached)
        drop[:, 1:] = reached[:, :-1]
        if not self.with_replacement:
            drop[:, :per_node_beam_size] = False
        ordered = ordered.masked_fill(drop, lowest(ordered))
        picks = _sample(ordered, per_node_beam_size, 1.0, self.with_replacement)
        chosen = order.gather(1, picks)
        return log_probs.gather(1, chosen), chosen, state


class GumbelSampler(Sampler):
    """Stochastic beam search (Kool, van Hoof and Welling, 2019, "Stochastic Beams and Where to Find Them"): each
    hypothesis carries a Gumbel-perturbed log-probability; its extensions' perturbations are drawn conditioned on
    their maximum being the parent's, and the largest perturbed values survive. The surviving sequences are a
    sample without replacement from the model's distribution over sequences."""

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = _positive(temperature)

    def init_state(
        self, start_class_log_probabilities: torch.Tensor, batch_size: int, num_classes: int
    ) -> dict[str, torch.Tensor]:
        zeros = start_class_log_probabilities.new_zeros((batch_size, num_classes))
        return {"G_phi_S": self.gumbel_with_max(start_class_log_probabilities, zeros)}

    def sample_nodes(
        self, log_probs: torch.Tensor, per_node_beam_size: int, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        scaled = log_probs if self.temperature == 1.0 else torch.log_softmax(log_probs / self.temperature, dim=-1)
        parent = state["phi_S"].unsqueeze(-1)  # (N, 1): the hypothesis' log-probability
        perturbed = self.gumbel_with_max(parent + scaled, state["G_phi_S"].unsqueeze(-1))  # (N, V)
        top, chosen = perturbed.topk(per_node_beam_size, dim=-1)
        return log_probs.gather(1, chosen), chosen, {"G_phi_S": top}

    def sample_beams(
        self, log_probs: torch.Tensor, beam_size: int, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        batch_size = log_probs.size(0)
        perturbed = state["G_phi_S"].reshape_as(log_probs)
        top, chosen = perturbed.topk(beam_size, dim=-1)  # (B, beam) by perturbed value
        values = log_probs.gather(1, chosen)
        values, order = values.sort(dim=-1, descending=True)  # best first by log-probability
        chosen, top = chosen.gather(1, order), top.gather(1, order)
        new_state = {
            "G_phi_S": top.reshape(batch_size * beam_size),
            "phi_S": values.reshape(batch_size * beam_size),
        }
        return values, chosen, new_state

    def gumbel(self, phi: torch.Tensor) -> torch.Tensor:
        """``phi`` plus standard Gumbel noise."""
        uniform = torch.rand_like(phi).clamp(min=torch.finfo(phi.dtype).tiny)
        return phi - torch.log(-torch.log(uniform))

    def gumbel_with_max(self, phi: torch.Tensor, maximum: torch.Tensor) -> torch.Tensor:
        """Gumbel-perturbed ``phi`` (..., V), conditioned on their maximum over the last dimension being ``maximum``
        (..., 1), in the numerically stable form of the paper's appendix B."""
        g = self.gumbel(phi)
        z = g.max(dim=-1, keepdim=True).values
        v = maximum - g + torch.log1p(-torch.exp(g - z))
        return maximum - torch.relu(v) - torch.log1p(torch.exp(-v.abs()))
