"""The pieces of one RL step between sampling and the loss (issue 53): the config's rewards built by name
(:func:`build_rewards`), a group's completions scored (:func:`score_group`), laid out for the training forward
(:func:`group_batch`: the prompt once per completion, the completions right-padded, so the group needs no attention
mask), and the policy's per-token log-probabilities and entropies of the completions recomputed through the model's
output head (:func:`completion_logps`, at the sampling temperature over the real vocabulary, as the rollout engine
recorded them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..config.rl_sections import RLRewardConfig
from ..exceptions import OLMoConfigurationError, OLMoDataError
from .rewards import Completion, RewardFn, exact_answer, format_reward, length_reward, registered_rewards
from .rollout import Group

if TYPE_CHECKING:
    from ..model.loss import OutputHead

__all__ = [
    "GroupBatch",
    "NamedReward",
    "ScoredGroup",
    "build_rewards",
    "completion_logps",
    "group_batch",
    "score_group",
]


@dataclass(frozen=True)
class NamedReward:
    """One entry of ``rl.rewards``, built."""

    name: str
    weight: float
    fn: RewardFn


def build_rewards(entries: Sequence[RLRewardConfig]) -> list[NamedReward]:
    """The rewards ``rl.rewards`` names: the built-in ones with their options, the others from the registry
    (:func:`olmo.rl.register_reward`); a name found nowhere is refused naming its key and what is registered."""
    built = []
    for i, entry in enumerate(entries):
        key = f"rl.rewards[{i}]"
        if entry.name == "exact_answer":
            fn: RewardFn = exact_answer
        elif entry.name == "format":
            fn = format_reward(str(entry.pattern), f"{key}.pattern")
        elif entry.name == "length":
            fn = length_reward(entry.max_tokens, entry.buffer, key)  # type: ignore[arg-type]
        elif entry.name in registered_rewards():
            fn = registered_rewards()[entry.name]
        else:
            known = ", ".join(sorted(registered_rewards())) or "none"
            raise OLMoConfigurationError(
                f"{key}.name={entry.name!r} is not a built-in reward (exact_answer, format, length) nor a registered "
                f"one (registered now: {known}). Register it with olmo.rl.register_reward({entry.name!r}, fn) in "
                f"your script before the run starts, or fix the name."
            )
        built.append(NamedReward(entry.name, float(entry.weight), fn))
    return built


@dataclass
class ScoredGroup:
    """A group's completions with their rewards."""

    group: Group
    per_reward: torch.Tensor
    """(G, R) float32: each reward's value for each completion, in the order of ``rl.rewards``."""
    rewards: torch.Tensor
    """(G,) float32: the weighted sum, each completion's reward."""


def score_group(
    group: Group,
    prompt: str,
    ground_truth: str,
    decode: Callable[[list[int]], str],
    rewards: Sequence[NamedReward],
    eos: int,
    where: str = "",
) -> ScoredGroup:
    """Score each completion of ``group`` (decoded without its end token) with every reward.

    :param where: the prompt's source (``FILE:LINE``), for the error of a reward that fails or returns a non-number.
    :raises OLMoDataError: naming the reward and the prompt, when a reward raises or returns something other than a
        finite number.
    """
    values = torch.zeros(len(group.tokens), len(rewards), dtype=torch.float32)
    for j, (tokens, truncated) in enumerate(zip(group.tokens, group.truncated)):
        text = decode(tokens[:-1] if tokens and tokens[-1] == eos and not truncated else tokens)
        completion = Completion(prompt, text, ground_truth, len(tokens), truncated)
        for r, reward in enumerate(rewards):
            try:
                value = reward.fn(completion)
            except Exception as e:  # a user's reward: whatever it raised, named with where it happened
                raise OLMoDataError(
                    f"The reward {reward.name!r} failed on a completion of prompt {where or group.prompt_index} "
                    f"({type(e).__name__}: {e}). Fix the reward (it must return a finite number for any text)."
                ) from e
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise OLMoDataError(
                    f"The reward {reward.name!r} returned {value!r} for a completion of prompt "
                    f"{where or group.prompt_index}; a reward must return a finite number."
                )
            values[j, r] = float(value)
    weights = torch.tensor([reward.weight for reward in rewards], dtype=torch.float32)
    return ScoredGroup(group, values, (values * weights).sum(dim=1))


@dataclass
class GroupBatch:
    """A group laid out for the training forward."""

    input_ids: torch.Tensor
    """(G, P + C): the prompt, then each completion, right-padded to the longest (C tokens)."""
    prompt_length: int
    completion_ids: torch.Tensor
    """(G, C) the completions, padded."""
    completion_mask: torch.Tensor
    """(G, C) bool: the completions' tokens (none of a truncated one with ``mask_truncated_completions``)."""
    old_logps: torch.Tensor
    """(G, C) float32: the sampling log-probabilities (0 at padding)."""


def group_batch(prompt: torch.Tensor, group: Group, pad: int, mask_truncated: bool = False) -> GroupBatch:
    """``group``'s completions of ``prompt`` (1-D ids) as one batch (see :class:`GroupBatch`)."""
    G, P = len(group.tokens), prompt.numel()
    C = max(1, max(len(t) for t in group.tokens))
    completions = torch.full((G, C), pad, dtype=torch.long)
    mask = torch.zeros(G, C, dtype=torch.bool)
    old = torch.zeros(G, C, dtype=torch.float32)
    for j, (tokens, logps) in enumerate(zip(group.tokens, group.logps)):
        completions[j, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        old[j, : len(tokens)] = logps
        mask[j, : len(tokens)] = not (mask_truncated and group.truncated[j])
    input_ids = torch.cat([prompt.to(torch.long).unsqueeze(0).expand(G, P), completions], dim=1)
    return GroupBatch(input_ids, P, completions, mask, old)


def _completion_head(
    head: OutputHead, *, targets: torch.Tensor, prompt_length: int, temperature: float, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, entropies) (G, C) of the completion tokens ``targets`` from the output layer's input."""
    hidden = head.hidden[:, prompt_length - 1 : prompt_length - 1 + targets.size(1)]
    weight = head.weight[:vocab_size]
    logits = hidden @ weight.T
    if head.bias is not None:
        logits = logits + head.bias[:vocab_size]
    logps = F.log_softmax(logits.float() * head.logit_scale / temperature, dim=-1)
    entropy = -(logps.exp() * logps).sum(dim=-1)
    return logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy.detach()


def completion_logps(
    model: torch.nn.Module, batch: GroupBatch, temperature: float, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's (G, C) log-probabilities of the completion tokens (with gradient) and their entropies, at
    ``temperature`` over the ``vocab_size`` real tokens, as the rollout engine records them."""
    head = partial(
        _completion_head,
        targets=batch.completion_ids,
        prompt_length=batch.prompt_length,
        temperature=temperature,
        vocab_size=vocab_size,
    )
    return model(batch.input_ids, head=head).loss
