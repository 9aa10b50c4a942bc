"""The policy losses and advantages of issue 53, from their definitions (TRL GRPOTrainer's): values worked by hand,
gradients of the on-policy step, clipping, the KL estimate, and a batch split into parts equal to the whole."""

from __future__ import annotations

import math

import pytest
import torch

from olmo.rl.policy_loss import LOSSES, group_advantages, reduce_losses, token_losses


def test_advantages_are_centred_in_each_group_and_scaled_by_its_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, zero = group_advantages(rewards, 4, "group")
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # Bessel-corrected: 0.5
    expected = [0.75 / (std + 1e-4)] + [-0.25 / (std + 1e-4)] * 3 + [0.0] * 4
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    assert zero.tolist() == [False] * 4 + [True] * 4  # a group of equal rewards has no signal
    adv, _ = group_advantages(rewards, 4, "none")
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    adv, zero = group_advantages(rewards, 4, "batch")
    batch_std = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]).std().item()
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (batch_std + 1e-4))
    assert not zero.any()


@pytest.mark.parametrize("rewards, group", [(torch.ones(6), 4), (torch.ones(4), 1), (torch.ones(2, 2), 2)])
def test_rewards_that_are_not_whole_groups_are_refused(rewards, group):
    with pytest.raises(ValueError, match="are not groups of"):
        group_advantages(rewards, group)


@pytest.mark.parametrize("loss", LOSSES)
def test_on_policy_every_loss_is_minus_the_advantage_with_its_gradient(loss):
    """The first pass over fresh samples (old = current): the ratio is 1, nothing is clipped, and each token's
    gradient is -A d(logp) (the policy gradient), for every loss type."""
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    adv = torch.tensor([0.5, -2.0])
    out = token_losses(
        logps, logps.detach(), adv, loss=loss, epsilon_low=0.2, epsilon_high=5.0 if loss == "cispo" else 0.2
    )
    expected = -adv.unsqueeze(1).expand(2, 3) * (logps.detach() if loss == "cispo" else 1.0)
    torch.testing.assert_close(out.loss, expected)
    out.loss.sum().backward()
    torch.testing.assert_close(logps.grad, -adv.unsqueeze(1).expand(2, 3))
    assert not out.clipped.any() and out.kl is None


def test_the_clipped_objective_stops_the_gradient_only_where_it_clips():
    # Four completions of one token each, sampled with probability 1 (old log-probability 0): ratio = p.
    logps = torch.tensor([[1.5], [1.5], [0.5], [0.5]]).log().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    out = token_losses(logps, torch.zeros(4, 1), adv, loss="dapo", epsilon_low=0.2, epsilon_high=0.2)
    # r=1.5, A=+1: clipped at 1.2; r=1.5, A=-1: min(-1.5, -1.2) = -1.5 (unclipped: pessimistic);
    # r=0.5, A=-1: clipped at 0.8; r=0.5, A=+1: min(0.5, 0.8) = 0.5 (unclipped).
    torch.testing.assert_close(out.loss.flatten(), torch.tensor([-1.2, 1.5, 0.8, -0.5]))
    assert out.clipped.flatten().tolist() == [True, False, True, False]
    out.loss.sum().backward()
    torch.testing.assert_close(logps.grad.flatten(), torch.tensor([0.0, 1.5, 0.0, -0.5]))  # -A r where unclipped


def test_cispo_clips_the_weight_from_above_and_keeps_every_gradient():
    logps = torch.log(torch.tensor([[8.0], [0.5]])).requires_grad_(True)
    out = token_losses(
        logps, torch.zeros(2, 1), torch.tensor([1.0, 1.0]), loss="cispo", epsilon_low=0.2, epsilon_high=5.0
    )
    torch.testing.assert_close(out.loss.flatten(), -torch.tensor([5.0, 0.5]) * logps.detach().flatten())
    assert out.clipped.flatten().tolist() == [True, False]
    out.loss.sum().backward()
    torch.testing.assert_close(logps.grad.flatten(), torch.tensor([-5.0, -0.5]))


def test_the_kl_term_is_k3_and_zero_at_the_reference():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    out = token_losses(
        logps,
        logps.detach(),
        torch.zeros(1),
        loss="grpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        beta=0.1,
        ref_logps=ref,
    )
    expected_kl = torch.tensor([[0.0, math.exp(0.5) - 0.5 - 1]])
    torch.testing.assert_close(out.kl, expected_kl)
    torch.testing.assert_close(out.loss, 0.1 * expected_kl)
    # Off-policy (the tokens were sampled by an older policy): the estimate is weighted by the ratio, as TRL does.
    old = logps.detach() - 0.5
    weighted = token_losses(
        logps, old, torch.zeros(1), loss="grpo", epsilon_low=0.2, epsilon_high=0.2, beta=0.1, ref_logps=ref
    )
    torch.testing.assert_close(weighted.kl, expected_kl * math.exp(0.5))
    with pytest.raises(ValueError, match="needs the reference"):
        token_losses(logps, logps, torch.zeros(1), loss="grpo", epsilon_low=0.2, epsilon_high=0.2, beta=0.1)


def test_each_loss_averages_as_it_defines():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    quotient = {
        k: (lambda n, d: (n / d).item())(*reduce_losses(per_token, mask, k, max_new_tokens=4)) for k in LOSSES
    }
    assert quotient["grpo"] == pytest.approx(((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2)
    assert quotient["dr_grpo"] == pytest.approx((1 + 2 + 4 + 5 + 6) / (2 * 4))
    assert quotient["dapo"] == quotient["cispo"] == pytest.approx((1 + 2 + 4 + 5 + 6) / 5)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_batch_split_into_parts_has_the_whole_batchs_loss_and_gradient(loss):
    """What ranks and micro-batches do: each part's numerator over the whole batch's denominator, summed."""
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(6, 5, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + 0.3 * torch.randn(6, 5, generator=g)
    ref = logps.detach() + 0.2 * torch.randn(6, 5, generator=g)
    adv = torch.randn(6, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[2] = False  # a masked-out (truncated) completion
    eps_high = 5.0 if loss == "cispo" else 0.28
    kwargs = dict(loss=loss, epsilon_low=0.2, epsilon_high=eps_high, beta=0.04)

    def loss_of(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        out = token_losses(logps[rows], old[rows], adv[rows], ref_logps=ref[rows], **kwargs)
        return reduce_losses(out.loss, mask[rows], loss, max_new_tokens=5)

    num, den = loss_of(slice(None))
    whole = num / den.clamp(min=1.0)
    (grad_whole,) = torch.autograd.grad(whole, logps)
    for cuts in ([0, 2, 6], [0, 1, 3, 6]):
        parts = [loss_of(slice(a, b)) for a, b in zip(cuts, cuts[1:])]
        total = sum(d for _, d in parts)
        split = sum(n for n, _ in parts) / total.clamp(min=1.0)
        (grad_split,) = torch.autograd.grad(split, logps)
        torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad_split, grad_whole, rtol=1e-6, atol=1e-7)
