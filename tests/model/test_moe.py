"""The mixture-of-experts layer (olmo/model/moe.py, issue 38's first part): routing checked by hand on two experts,
the grouped multiply against a token-by-token reference and against the loop over experts (values and gradients),
the permutation into expert order and back (issue 55: gathers both ways, each token's rows added in its experts'
order), dropless routing when every token picks one expert, and the auxiliary losses."""

import math

import pytest
import torch
import torch.nn.functional as F

from olmo.model.moe import (
    MoEFeedForward,
    combine,
    dispatch,
    grouped_mm_runs,
    load_balancing_loss,
    permutation,
    route,
    router_z_loss,
)
from olmo.testing import forward_backward


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


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("top_k,norm_topk_prob", [(1, False), (3, True), (6, False)])
def test_values_and_gradients_equal_the_token_by_token_reference(grouped, top_k, norm_topk_prob):
    """Every gradient (the input's, the router's through the combine weights, each expert matrix's) equals the one
    autograd takes through the reference loop, also with every expert chosen by every token (top 6 of 6)."""
    torch.manual_seed(2)
    layer = MoEFeedForward(d_model=16, num_experts=6, top_k=top_k, hidden_size=8, norm_topk_prob=norm_topk_prob)
    layer.use_grouped_mm = grouped
    x = torch.randn(19, 16, requires_grad=True)
    upstream = torch.randn(19, 16)
    params = [x, *layer.parameters()]
    ours = layer(x)
    reference = _reference(layer, x)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for a, b in zip(
        torch.autograd.grad((ours * upstream).sum(), params),
        torch.autograd.grad((reference * upstream).sum(), params),
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_permutation_sorts_by_expert_and_each_token_finds_its_rows():
    torch.manual_seed(3)
    experts = torch.stack([torch.randperm(8)[:3] for _ in range(50)])  # (N, k): distinct experts per token
    perm = permutation(experts, 8)
    flat = experts.flatten()
    assert flat[perm.order].tolist() == sorted(flat.tolist())  # sorted by expert ...
    for e in range(8):  # ... and within an expert by token
        tokens = perm.token_of[flat[perm.order] == e]
        assert tokens.tolist() == sorted(tokens.tolist())
    assert perm.counts.tolist() == torch.bincount(flat, minlength=8).tolist()
    assert (perm.token_of[perm.rows_of] == torch.arange(50).unsqueeze(1)).all()  # each token's own rows ...
    assert (perm.rows_of.diff(dim=1) > 0).all()  # ... ascending, so in the order of its experts
    assert (perm.order // 3 == perm.token_of).all()


def test_dispatch_and_combine_are_gathers_adding_each_token_in_its_experts_order():
    """The combine (and the dispatch's backward) gathers each token's k rows and adds them in its experts' order: the
    forward is bitwise ``index_add_`` of the sorted rows (which adds in index order on a CPU), at OLMoE's top 8; the
    dispatch's backward is bitwise that same sum of the upstream rows and the combine's a plain gather. float64
    gradcheck of both."""
    torch.manual_seed(4)
    experts = torch.stack([torch.randperm(64)[:8] for _ in range(300)])
    perm = permutation(experts, 64)
    rows = torch.randn(300 * 8, 32, requires_grad=True)
    y = combine(rows, perm)
    assert torch.equal(y, torch.zeros(300, 32).index_add_(0, perm.token_of, rows.detach()))
    upstream = torch.randn(300, 32)
    (grad_rows,) = torch.autograd.grad((y * upstream).sum(), [rows])
    assert torch.equal(grad_rows, upstream[perm.token_of])

    x = torch.randn(300, 32, requires_grad=True)
    dispatched = dispatch(x, perm)
    assert torch.equal(dispatched, x.detach()[perm.token_of])
    upstream_rows = torch.randn(300 * 8, 32)
    (grad_x,) = torch.autograd.grad((dispatched * upstream_rows).sum(), [x])
    expected = torch.stack([_added_in_order(upstream_rows[perm.rows_of[n]]) for n in range(300)])
    assert torch.equal(grad_x, expected)

    small = permutation(torch.tensor([[2, 0], [1, 2], [0, 1]]), 3)
    x64 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    rows64 = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: dispatch(t, small), (x64,))
    assert torch.autograd.gradcheck(lambda t: combine(t, small), (rows64,))


def _added_in_order(rows: torch.Tensor) -> torch.Tensor:
    total = rows[0]
    for row in rows[1:]:
        total = total + row
    return total


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


def test_the_layer_compiles_as_one_graph_to_its_eager_values_and_gradients():
    """bf16 on a CPU (where the grouped kernel traces): ``fullgraph=True`` holds through routing, the permutation's
    autograd functions, the grouped multiplies and the auxiliary losses, and gives eager's values and gradients
    within bf16 rounding (the GPU check does the same under CUDA's sync debug mode)."""
    from olmo.model.compile_guards import install_compile_guards

    torch.manual_seed(5)
    layer = MoEFeedForward(64, 8, 2, 32, lb_weight=0.01, z_weight=0.001).to(torch.bfloat16)
    x = torch.randn(2, 64, 64, dtype=torch.bfloat16, requires_grad=True)
    eager, expected = forward_backward(layer, x)
    install_compile_guards()
    compiled, grads = forward_backward(torch.compile(layer, fullgraph=True), x, list(layer.parameters()))
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-3)
    for grad, eager_grad in zip(grads, expected):
        torch.testing.assert_close(grad, eager_grad, rtol=5e-2, atol=5e-3)
