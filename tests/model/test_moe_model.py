"""``model.moe`` in the model (issue 38): the section's checks, the blocks it builds, the auxiliary losses reaching
the router through each layer's output (equal to differentiating them explicitly, with and without activation
checkpointing), weight decay of the experts, active-parameter FLOPs, and dense models left as they were."""

import copy

import pytest
import torch

import olmo.model.moe as moe_module
from olmo.config import ModelConfig, OptimizerConfig
from olmo.distributed.parallelize import apply_activation_checkpointing, model_config_fingerprint
from olmo.model import OLMo
from olmo.model.moe import MoEFeedForward, load_balancing_loss, router_z_loss
from olmo.optim import get_param_groups

BASE = dict(
    d_model=64,
    n_heads=4,
    n_layers=3,
    max_sequence_length=32,
    vocab_size=100,
    embedding_size=128,
    include_bias=False,
    rope=True,
    eos_token_id=0,
    pad_token_id=1,
    attention_dropout=0.0,
    residual_dropout=0.0,
    embedding_dropout=0.0,
)
MOE = dict(num_experts=4, top_k=2, hidden_size=32, lb_loss_weight=0.3, z_loss_weight=0.05)


def _model(seed: int = 0, **moe) -> OLMo:
    torch.manual_seed(seed)
    return OLMo(ModelConfig.new(**BASE, moe={**MOE, **moe})).train()


def _grads(model: OLMo, x: torch.Tensor, share: float = 0.5) -> dict[str, torch.Tensor]:
    model.zero_grad()
    for block in model.transformer.typed_blocks():
        assert block.moe is not None
        block.moe.aux_scale = share
    model(x, labels=x).loss.total.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "moe, model, fragment",
    [
        (dict(top_k=5), {}, "model.moe.top_k=5 must be between 1 and model.moe.num_experts=4"),
        (dict(num_experts=-1), {}, "model.moe.num_experts=-1"),
        (dict(hidden_size=0), {}, "model.moe.hidden_size=0 must be positive"),
        (dict(lb_loss_weight=-0.1), {}, "model.moe.lb_loss_weight=-0.1"),
        (dict(z_loss_weight=float("nan")), {}, "model.moe.z_loss_weight=nan"),
        ({}, dict(activation_type="gelu"), "model.moe needs model.activation_type=swiglu"),
        ({}, dict(include_bias=True), "set --model.include_bias=false"),
    ],
)
def test_each_bad_value_of_the_section_is_named(moe, model, fragment):
    cfg = ModelConfig.new(**{**BASE, **model}, moe={**MOE, **moe})
    assert any(fragment in p for p in cfg.problems()), cfg.problems()


def test_a_moe_block_holds_experts_instead_of_the_mlp_and_a_shared_expert_in_its_place():
    names = dict(_model().named_parameters())
    assert names["transformer.blocks.0.moe.w1"].shape == (4, 64, 32)
    assert names["transformer.blocks.0.moe.w2"].shape == (4, 32, 64)
    assert names["transformer.blocks.2.moe.router.weight"].shape == (4, 64)
    assert not any("ff_proj" in n or "blocks.0.ff_out" in n for n in names)
    shared = dict(_model(shared_expert_hidden_size=24).named_parameters())
    assert shared["transformer.blocks.0.ff_proj.weight"].shape == (48, 64)
    assert shared["transformer.blocks.0.ff_out.weight"].shape == (64, 24)
    # The shared expert adds the dense SwiGLU to the routed output.
    model = _model(shared_expert_hidden_size=24).eval()
    block = model.transformer.typed_blocks()[0]
    x = torch.randn(2, 5, 64)
    assert block.moe is not None
    torch.testing.assert_close(block.feed_forward(x), block.moe(x) + block._dense_mlp(x))


def test_absent_or_zero_experts_is_the_dense_model_with_its_fingerprint():
    dense = ModelConfig.new(**BASE)
    zero = ModelConfig.new(**BASE, moe={"num_experts": 0})
    assert model_config_fingerprint(zero) == model_config_fingerprint(dense)
    assert model_config_fingerprint(ModelConfig.new(**BASE, moe=MOE)) != model_config_fingerprint(dense)
    torch.manual_seed(0)
    a = OLMo(dense).state_dict()
    torch.manual_seed(0)
    b = OLMo(zero).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_auxiliary_losses_reach_the_router_as_if_added_to_the_loss(monkeypatch):
    """The losses ride each layer's output into the backward pass; the gradients equal those of ``CE + share *
    sum over layers (lb_weight / L * lb / top_k + z_weight / L * z)`` differentiated explicitly (``lb`` balancing
    each of the 2 instances on its own: ``lb_loss_granularity: instance``)."""
    x = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    model = _model()
    attached = _grads(model, x, share=0.5)

    reference = copy.deepcopy(model)
    for block in reference.transformer.typed_blocks():
        assert block.moe is not None
        block.moe.lb_weight = block.moe.z_weight = 0.0
    routings = []
    real_route = moe_module.route
    monkeypatch.setattr(moe_module, "route", lambda *a, **k: routings.append(real_route(*a, **k)) or routings[-1])
    reference.zero_grad()
    loss = reference(x, labels=x).loss.total
    aux = sum(0.3 / 3 * load_balancing_loss(r, groups=2) / 2 + 0.05 / 3 * router_z_loss(r) for r in routings)
    (loss + 0.5 * aux).backward()
    assert len(routings) == 3
    for name, grad in attached.items():
        torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad, rtol=1e-6, atol=1e-9)
    # ... and they matter: without them the router's gradient is another.
    monkeypatch.setattr(moe_module, "route", real_route)
    plain = _grads(_model(lb_loss_weight=0.0, z_loss_weight=0.0), x)
    router = "transformer.blocks.0.moe.router.weight"
    assert not torch.allclose(plain[router], attached[router])


@pytest.mark.parametrize("strategy", ["whole_layer", "fine_grained"])
def test_activation_checkpointing_gives_the_same_gradients(strategy):
    x = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(2))
    model = _model()
    expected = _grads(model, x)
    checkpointed = copy.deepcopy(model)  # a trained-on layer copies (its routing is kept detached)
    apply_activation_checkpointing(checkpointed, strategy)
    got = _grads(checkpointed, x)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def test_an_eval_forward_measures_nothing_and_a_training_forward_once():
    model = _model()
    x = torch.randint(0, 100, (1, 16))
    layer = model.transformer.typed_blocks()[0].moe
    assert isinstance(layer, MoEFeedForward)
    with torch.no_grad():
        model(x)
    assert layer.take_stats() is None
    model(x)
    stats = layer.take_stats()
    assert stats is not None and stats.counts.sum().item() == 16 * 2 and stats.lb_loss.item() >= 1.0 - 1e-6
    assert layer.take_stats() is None


def test_the_experts_decay_like_linear_weights():
    groups = get_param_groups(OptimizerConfig(weight_decay=0.1), _model())
    decayed = {n for g in groups if g["weight_decay"] > 0 for n, _ in g["params"]}
    assert {"transformer.blocks.1.moe.w1", "transformer.blocks.1.moe.w2", "transformer.blocks.1.moe.w3"} <= decayed
    assert "transformer.blocks.1.moe.router.weight" in decayed
    assert "transformer.blocks.1.attn_norm.weight" not in decayed


def test_flops_count_the_active_parameters():
    model = _model()
    dense_part = model.num_params() - 3 * 3 * (4 * 64 * 32)
    assert model.num_active_params() == dense_part + 3 * 3 * (2 * 64 * 32)  # 2 of 4 experts per token
    full = OLMo(ModelConfig.new(**BASE, moe={**MOE, "top_k": 4}))
    assert full.num_active_params() == full.num_params()
    saved = 6 * 3 * 3 * (2 * 64 * 32)
    assert full.num_flops_per_token() - model.num_flops_per_token() == saved


def test_instance_granularity_balances_each_instance_and_micro_batch_the_whole():
    x = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(3))
    for per_instance in (True, False):
        model = _model(lb_loss_granularity="instance" if per_instance else "micro_batch")
        layer = model.transformer.typed_blocks()[0].moe
        assert isinstance(layer, MoEFeedForward) and layer.lb_per_instance is per_instance
        layer(x)
        stats, routing = layer.take_stats(), layer.routing
        assert stats is not None and routing is not None
        each = [
            load_balancing_loss(moe_module.RouterOutput(*(t[8 * i : 8 * i + 8] for t in routing)))
            for i in range(3)
        ]
        expected = torch.stack(each).mean() if per_instance else load_balancing_loss(routing)
        torch.testing.assert_close(stats.lb_loss, expected / 2)
    assert torch.stack(each).mean() > load_balancing_loss(routing)  # balancing each instance asks more
    cfg = ModelConfig.new(**BASE, moe={**MOE, "lb_loss_granularity": "batch"})
    assert any(
        "model.moe.lb_loss_granularity='batch' is not one of instance, micro_batch" in p for p in cfg.problems()
    )
