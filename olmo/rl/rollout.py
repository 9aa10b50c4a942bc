"""Sampling completions for RL (issue 53): the built-in rollout engine, on the model being trained.

Each prompt's ``group_size`` completions are sampled together, as one batch of copies of the prompt (no padding),
with the KV cache, dropout off and compiled blocks run eagerly. Completion ``j`` of prompt ``i`` at step ``s`` draws
its tokens from its own random stream, seeded by ``(seed, s, i, j)`` alone: what it samples does not depend on the
other prompts, on how prompts are dealt to ranks, or on anything a checkpoint would have to hold (a resumed step
samples what the uninterrupted one did). A token is drawn from the distribution of the logits of the vocabulary's
real tokens (``vocab_size``: the embedding's padding rows are never sampled) divided by ``temperature``, cut to its
nucleus of probability ``top_p``; its recorded log-probability is that of the tempered distribution before the
nucleus cut, the quantity the training step recomputes (TRL's ``old_per_token_logps``), so that their difference,
``train/rl/logprob_drift``, is the engine's disagreement with the trainer alone.

Another engine (vLLM, ...) may come later: :class:`RolloutEngine` is what the step needs of one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..model import OLMo

__all__ = ["BuiltinRolloutEngine", "Group", "RolloutEngine", "sample_token", "stream_seed"]


@dataclass
class Group:
    """The completions of one prompt."""

    prompt_index: int
    tokens: list[list[int]]
    """Each completion's tokens, its end-of-sequence token included when it ended."""
    logps: list[torch.Tensor]
    """Each completion's per-token sampling log-probabilities (float32, on the CPU)."""
    truncated: list[bool]
    """The completions that reached ``max_new_tokens`` without ending."""


class RolloutEngine(Protocol):
    """What the RL step needs of a rollout engine."""

    def sample(self, prompt: torch.Tensor, prompt_index: int, step: int) -> Group:
        """The completions of ``prompt`` (1-D token ids), index ``prompt_index`` of the prompt set, at ``step``."""
        ...


def stream_seed(seed: int, step: int, prompt_index: int, completion: int) -> int:
    """The seed of completion ``completion`` of prompt ``prompt_index`` at ``step`` (a 63-bit hash of the four)."""
    key = f"olmo-rl/{seed}/{step}/{prompt_index}/{completion}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def sample_token(logps: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    """One token drawn from the distribution ``logps`` (1-D log-probabilities) cut to its nucleus: the most likely
    tokens whose probabilities, before the last one, sum to less than ``top_p`` (the most likely token always). One
    uniform number of ``generator`` picks it by inverse CDF over the kept tokens, most likely first (ties by index);
    with ``top_p`` 1, over every token in id order (no sort)."""
    probs = logps.double().exp()
    u = torch.rand((), generator=generator, dtype=torch.float64)
    if top_p >= 1.0:  # the whole distribution, in token order: no sort
        cumulative = torch.cumsum(probs, 0)
        return int(torch.searchsorted(cumulative, u * cumulative[-1], right=True).clamp(max=len(probs) - 1))
    order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(order.values, 0) - order.values
    cumulative = torch.cumsum(order.values[before < top_p], 0)
    pick = int(torch.searchsorted(cumulative, u * cumulative[-1], right=True).clamp(max=len(cumulative) - 1))
    return int(order.indices[pick])


class BuiltinRolloutEngine:
    """Samples with :class:`~olmo.model.OLMo` itself (see the module's docstring).

    :param eos: the token that ends a completion.
    """

    def __init__(
        self,
        model: OLMo,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        eos: int,
        seed: int,
        vocab_size: int,
        use_cache: bool = True,
    ):
        if not (temperature > 0 and 0 < top_p <= 1 and group_size >= 1 and max_new_tokens >= 1):
            raise ValueError("temperature > 0, 0 < top_p <= 1, group_size >= 1 and max_new_tokens >= 1")
        self.model, self.group_size, self.max_new_tokens = model, group_size, max_new_tokens
        self.temperature, self.top_p, self.eos, self.seed, self.vocab_size = (
            temperature,
            top_p,
            eos,
            seed,
            vocab_size,
        )
        self.use_cache = use_cache
        """False: each token from a forward over the whole sequence so far (``scripts/benchmark_rl.py`` measures
        what the KV cache buys)."""

    def _logps(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) float32 log-probabilities of the tempered distribution over the real tokens."""
        return F.log_softmax(logits[:, -1, : self.vocab_size].float() / self.temperature, dim=-1)

    @torch.no_grad()
    def sample(self, prompt: torch.Tensor, prompt_index: int, step: int) -> Group:
        model, G = self.model, self.group_size
        device = next(model.parameters()).device
        generators = []
        for j in range(G):
            generator = torch.Generator()  # on the CPU: the same stream on every device
            generator.manual_seed(stream_seed(self.seed, step, prompt_index, j))
            generators.append(generator)
        was_training = model.training
        model.eval()  # no dropout while sampling
        tokens: list[list[int]] = [[] for _ in range(G)]
        logps: list[list[float]] = [[] for _ in range(G)]
        done = [False] * G
        try:
            with torch.compiler.set_stance("force_eager"):
                ids = prompt.to(device=device, dtype=torch.long).unsqueeze(0).expand(G, -1).contiguous()
                out = model(ids, use_cache=True, last_logits_only=True)
                for _ in range(self.max_new_tokens):
                    assert out.logits is not None
                    step_logps = self._logps(out.logits).cpu()
                    chosen = []
                    for j in range(G):
                        if done[j]:
                            chosen.append(self.eos)
                            continue
                        token = sample_token(step_logps[j], self.top_p, generators[j])
                        tokens[j].append(token)
                        logps[j].append(float(step_logps[j, token]))
                        done[j] = token == self.eos
                        chosen.append(token)
                    if all(done):
                        break
                    next_ids = torch.tensor(chosen, device=device).unsqueeze(1)
                    if self.use_cache:
                        out = model(
                            next_ids, past_key_values=out.attn_key_values, use_cache=True, last_logits_only=True
                        )
                    else:
                        ids = torch.cat([ids, next_ids], dim=1)
                        out = model(ids, last_logits_only=True)
        finally:
            model.train(was_training)
        truncated = [not d for d in done]
        return Group(prompt_index, tokens, [torch.tensor(lp, dtype=torch.float32) for lp in logps], truncated)
