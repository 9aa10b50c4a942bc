"""The policy losses of RL with verifiable rewards (issue 53), as TRL's ``GRPOTrainer`` defines them.

For completion ``i`` of a batch, token ``t``, with ``r = exp(logp - old_logp)`` (the probability ratio against
the policy that sampled it) and the completion's advantage ``A``:

* ``grpo``, ``dr_grpo``, ``dapo``: ``-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)`` per token (PPO's
  clipped objective);
* ``cispo``: ``-sg(min(r, epsilon_high)) A logp`` (the ratio clipped from above and not differentiated: every token
  keeps its gradient; ``epsilon_high`` is then the largest ratio, 5 in ScaleRL);

plus ``beta`` times the k3 estimate of the KL divergence to a reference, ``exp(ref - logp) - (ref - logp) - 1``,
weighted by ``r`` (the tokens were sampled by the old policy: TRL's ``use_bias_correction_kl``, on by default),
when ``beta > 0``. The per-token losses (over each completion's tokens, :func:`reduce_losses`'s ``mask``) are then
averaged as each loss says: ``grpo`` over each completion's tokens and then over completions; ``dr_grpo`` summed
and divided by completions x ``max_new_tokens`` (no length bias); ``dapo`` and ``cispo`` over every token of the
batch. The sums and their denominators are kept apart, so that a step split into ranks and micro-batches divides
the summed numerators by the whole batch's denominator and equals one process's loss.

Advantages (:func:`group_advantages`): each completion's reward minus its group's mean (the ``group_size``
completions of one prompt), divided by the group's (``scale_rewards: group``) or the batch's (``batch``) standard
deviation (Bessel-corrected) plus 1e-4, or not divided (``none``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "LOSSES",
    "SCALES",
    "TokenLosses",
    "group_advantages",
    "loss_denominator",
    "reduce_losses",
    "token_losses",
]

LOSSES = ("grpo", "dr_grpo", "dapo", "cispo")
"""``rl.loss``'s values."""
SCALES = ("group", "batch", "none")
"""``rl.scale_rewards``'s values."""
STD_FLOOR = 1e-4
"""Added to the standard deviation that divides the advantages (TRL's), so a group of equal rewards gives 0."""


def _std(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The Bessel-corrected standard deviation (over ``dim``; all elements when None)."""
    return x.std(dim=dim, correction=1) if dim is not None else x.std(correction=1)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", batch_std: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, std_zero)`` of ``rewards`` (N,), N a multiple of ``group_size``, the completions of one prompt
    next to each other. ``std_zero``: the completions whose standard deviation (the group's, or the batch's with
    ``scale="batch"``) is 0, which carry no signal (for the metrics). ``batch_std``: the batch's standard deviation
    when the batch spans more than ``rewards`` (other ranks' completions); None: that of ``rewards``."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards={scale!r} is not one of {', '.join(SCALES)}")
    if group_size < 2 or rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not groups of {group_size} (at least 2) completions")
    groups = rewards.float().view(-1, group_size)
    centred = (groups - groups.mean(dim=1, keepdim=True)).flatten()
    if scale == "batch":
        std = (_std(groups.flatten()) if batch_std is None else batch_std.float()).expand(rewards.numel())
    else:
        std = _std(groups, dim=1).repeat_interleave(group_size)
    advantages = centred if scale == "none" else centred / (std + STD_FLOOR)
    return advantages, torch.isclose(std, torch.zeros_like(std))


@dataclass
class TokenLosses:
    """Per-token values of a batch of completions (B, T)."""

    loss: torch.Tensor
    """What the completion's tokens contribute to the loss (policy term plus ``beta`` x KL)."""
    clipped: torch.Tensor
    """Tokens whose ratio was clipped where it matters: for PPO's objective below ``1 - epsilon_low`` with a
    negative advantage or above ``1 + epsilon_high`` with a positive one; for CISPO above ``epsilon_high`` with a
    positive advantage (TRL's ``clip_ratio/region_mean`` and ``cispo_clip_ratio``)."""
    kl: Optional[torch.Tensor]
    """The k3 estimate of the KL divergence to the reference, weighted by the ratio (None when ``beta`` is 0)."""


def token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    loss: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: Optional[torch.Tensor] = None,
) -> TokenLosses:
    """The per-token losses of completions whose tokens have log-probabilities ``logps`` (B, T: the policy's, with
    gradient), ``old_logps`` (those of the policy that sampled them) and ``ref_logps`` (the reference's, needed
    when ``beta > 0``); ``advantages`` (B,) is each completion's."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not one of {', '.join(LOSSES)}")
    adv = advantages.unsqueeze(1).to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    if loss == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps
        clipped = (ratio > epsilon_high) & (adv > 0)
    else:
        bounded = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        per_token = -torch.min(ratio * adv, bounded * adv)
        clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities (ref_logps)")
        delta = ref_logps - logps
        kl = (torch.exp(delta) - delta - 1) * ratio  # estimated under the sampling policy: importance-weighted
        per_token = per_token + beta * kl
    return TokenLosses(per_token, clipped, kl)


def reduce_losses(
    per_token: torch.Tensor, mask: torch.Tensor, loss: str, max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(numerator, denominator)`` of this batch's loss: the loss of the batch is their quotient, and that of a
    batch split into parts (ranks, micro-batches) is the sum of the parts' numerators over the sum of their
    denominators (at least 1: a batch of ``dapo`` or ``cispo`` whose tokens are all masked has loss 0). ``mask``
    (B, T) marks each completion's tokens (with ``mask_truncated_completions``, none of a truncated one: it still
    counts as a completion for ``grpo`` and ``dr_grpo``)."""
    mask = mask.to(per_token.dtype)
    summed = per_token * mask
    if loss == "grpo":
        numerator = (summed.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum()
    else:
        numerator = summed.sum()
    return numerator, loss_denominator(mask, loss, max_new_tokens)


def loss_denominator(mask: torch.Tensor, loss: str, max_new_tokens: int) -> torch.Tensor:
    """What a batch of completions (``mask`` (B, T) of their tokens) adds to the loss's denominator: its completions
    (``grpo``), completions x ``max_new_tokens`` (``dr_grpo``), its tokens (``dapo``, ``cispo``)."""
    if loss == "grpo":
        return torch.tensor(float(mask.size(0)), device=mask.device)
    if loss == "dr_grpo":
        return torch.tensor(float(mask.size(0) * max_new_tokens), device=mask.device)
    if loss in ("dapo", "cispo"):
        return mask.float().sum()
    raise ValueError(f"loss={loss!r} is not one of {', '.join(LOSSES)}")
