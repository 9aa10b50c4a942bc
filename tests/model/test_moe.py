"""The mixture-of-experts layer (olmo/model/moe.py, issue 38's first part): routing checked by hand on two experts,
the grouped multiply against a token-by-token reference and against the loop over experts (values and gradients),
dropless routing when every token picks one expert, and the auxiliary losses."""

import math

import pytest
import torch
import torch.nn.functional as F

from olmo.model.moe import MoEFeedForward, grouped_mm_runs, load_balancing_loss, route, router_z_loss


def _reference(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the router's logits, the top-k experts, each expert's SwiGLU, weighted sum."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        probs = (layer.router.weight @ x[n]).softmax(-1)
        weights, experts = probs.topk(layer.top_k)
        if layer.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            out[n] += w * ((F.silu(x[n] @ layer.w1[e]) * (x[n] @ layer.w3[e])) @ layer.w2[e])
    return out


def test_two_experts_by_hand():
    """d_model 2, two experts, top-1: the router's logits are the inputs themselves, so token (2, 0) goes to
    expert 0 with weight softmax([2, 0])[0] and token (0, 1) to expert 1 with softmax([0, 1])[1]."""
    layer = MoEFeedForward(d_model=2, num_experts=2, top_k=1, hidden_size=1)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2))
        layer.w1.copy_(torch.tensor([[[1.0], [0.0]], [[0.0], [1.0]]]))  # gate: expert e reads coordinate e
        layer.w3.copy_(torch.ones(2, 2, 1))  # up: the sum of the coordinates
        layer.w2.copy_(torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]]))  # down: expert e writes coordinate e
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    y = layer(x)
    routing = layer.routing
    assert routing is not None and routing.experts.tolist() == [[0], [1]]
    p0, p1 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(-1))  # softmax([2, 0])[0], softmax([0, 1])[1]
    torch.testing.assert_close(routing.weights, torch.tensor([[p0], [p1]]))
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    torch.testing.assert_close(y, torch.tensor([[p0 * silu(2.0) * 2.0, 0.0], [0.0, p1 * silu(1.0) * 1.0]]))
    # Load balancing: one assignment each (f = 1/2), mean probabilities P_0 = (p0 + 1 - p1) / 2, P_1 = 1 - P_0.
    P0 = (p0 + (1 - p1)) / 2
    assert load_balancing_loss(routing).item() == pytest.approx(2 * (0.5 * P0 + 0.5 * (1 - P0)), rel=1e-6)
    z = (math.log(math.exp(2) + 1) ** 2 + math.log(1 + math.e) ** 2) / 2
    assert router_z_loss(routing).item() == pytest.approx(z, rel=1e-6)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_grouped_multiply_matches_token_by_token_and_the_loop_over_experts(norm_topk_prob):
    torch.manual_seed(0)
    layer = MoEFeedForward(d_model=16, num_experts=6, top_k=2, hidden_size=8, norm_topk_prob=norm_topk_prob)
    x = torch.randn(3, 7, 16, requires_grad=True)
    grouped = layer(x)
    assert grouped_mm_runs(x.reshape(-1, 16), layer.w1) and grouped_mm_runs(x.reshape(-1, 16), layer.w2)
    expected = _reference(layer, x.reshape(-1, 16)).reshape(3, 7, 16)
    torch.testing.assert_close(grouped, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(
        grouped.square().sum(), [x.requires_grad_(), *layer.parameters()], allow_unused=True
    )
    x.grad = None
    layer.use_grouped_mm = False
    looped = layer(x)
    torch.testing.assert_close(looped, grouped, rtol=1e-6, atol=1e-7)
    loop_grads = torch.autograd.grad(looped.square().sum(), [x, *layer.parameters()])
    for a, b in zip(grads, loop_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dropless_when_every_token_picks_the_same_expert():
    """All 64 tokens want expert 3 (a router bias no balancing would fix): every one is computed, none dropped, and
    the experts nobody chose get zero gradients, not NaN."""
    torch.manual_seed(1)
    layer = MoEFeedForward(d_model=8, num_experts=4, top_k=1, hidden_size=4)
    x = torch.randn(64, 8).abs()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3] = 10.0  # positive inputs: expert 3's logit is far above the others' (0)
    y = layer(x)
    assert layer.routing is not None and set(layer.routing.experts.flatten().tolist()) == {3}
    torch.testing.assert_close(y, _reference(layer, x), rtol=1e-5, atol=1e-6)
    assert bool((y.abs().sum(-1) > 0).all())  # no token's output dropped
    y.sum().backward()
    for weight in (layer.w1, layer.w2, layer.w3):
        assert weight.grad is not None and torch.isfinite(weight.grad).all()
        assert bool((weight.grad[:3] == 0).all()) and bool((weight.grad[3] != 0).any())
    assert load_balancing_loss(layer.routing).item() == pytest.approx(4 * layer.routing.probs[:, 3].mean().item())


def test_routing_of_a_balanced_router_gives_the_minimum_load_balancing_loss():
    logits = torch.zeros(8, 4)  # every expert equally likely: ties go to the lowest indices, so force a balance
    logits[torch.arange(8), torch.arange(8) % 4] = 1e-6
    routing = route(logits, top_k=1)
    assert torch.bincount(routing.experts.flatten(), minlength=4).tolist() == [2, 2, 2, 2]
    assert load_balancing_loss(routing).item() == pytest.approx(1.0, rel=1e-5)
    assert router_z_loss(routing).item() == pytest.approx(math.log(4) ** 2, rel=1e-5)


def test_rows_the_grouped_kernel_refuses_take_the_loop():
    """d_model 2 in fp32 is an 8-byte row, which ``torch._grouped_mm`` refuses: the loop computes it instead."""
    layer = MoEFeedForward(d_model=2, num_experts=3, top_k=2, hidden_size=4)
    x = torch.randn(5, 2)
    assert not grouped_mm_runs(x, layer.w1)
    torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-6)


def test_top_k_outside_the_experts_is_refused():
    with pytest.raises(ValueError, match=r"top_k=5 must be between 1 and num_experts=4"):
        MoEFeedForward(d_model=8, num_experts=4, top_k=5, hidden_size=4)
