import logging
import math

import pytest
import torch
import torch.nn.functional as F

from olmo.config import ActivationType, InitFnType, LayerNormType, ModelConfig
from olmo.model import OLMo, attention_mixer
from olmo.model.layers import LayerNorm, alibi_bias, apply_rotary, rotary_cos_sin
from olmo.testing import tiny_model_config

VOCAB = 100


def tiny_config(**overrides) -> ModelConfig:
    return tiny_model_config(**{"vocab_size": VOCAB, **overrides})


def build(seed: int = 0, **overrides) -> OLMo:
    torch.manual_seed(seed)
    return OLMo(tiny_config(**overrides))


def random_ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


OLMO_1B = dict(
    d_model=2048,
    n_heads=16,
    n_layers=16,
    mlp_ratio=8,
    weight_tying=True,
    rope=True,
    include_bias=False,
    layer_norm_with_affine=False,
    attention_layer_norm_with_affine=False,
    vocab_size=50280,
    embedding_size=50304,
    max_sequence_length=2048,
    init_fn=InitFnType.mitchell,
)


def test_olmo_1b_layout_on_meta():
    with torch.device("meta"):
        model = OLMo(ModelConfig(**OLMO_1B))
    assert model.num_params() == 1_176_764_416
    assert model.num_params(include_embedding=False) == 1_073_741_824
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected = {"transformer.wte.weight": (50304, 2048)}
    for i in range(16):
        expected[f"transformer.blocks.{i}.att_proj.weight"] = (6144, 2048)
        expected[f"transformer.blocks.{i}.attn_out.weight"] = (2048, 2048)
        expected[f"transformer.blocks.{i}.ff_proj.weight"] = (16384, 2048)
        expected[f"transformer.blocks.{i}.ff_out.weight"] = (2048, 8192)
    # No norm keys (no affine), no RoPE tables, no output projection (tied).
    assert shapes == expected
    assert all(t.is_meta for t in model.parameters())


def test_olmo_7b_layout_on_meta():
    cfg = ModelConfig(**{**OLMO_1B, "d_model": 4096, "n_heads": 32, "n_layers": 32, "mlp_hidden_size": 22016})
    cfg.weight_tying = False
    with torch.device("meta"):
        model = OLMo(cfg)
    assert model.num_params() == 6_888_095_744
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes["transformer.ff_out.weight"] == (50304, 4096)
    assert shapes["transformer.blocks.31.ff_proj.weight"] == (22016, 4096)
    assert shapes["transformer.blocks.31.ff_out.weight"] == (4096, 11008)


def test_every_optional_module_has_olmo_keys_and_loads_strictly():
    overrides = dict(
        rope=False,
        weight_tying=False,
        embedding_layer_norm=True,
        attention_layer_norm=True,
        n_kv_heads=2,
        include_bias=True,
    )
    model = build(**overrides)
    block = {
        "att_proj.weight": (32 + 2 * 16, 32),
        "att_proj.bias": (64,),
        "attn_out.weight": (32, 32),
        "attn_out.bias": (32,),
        "ff_proj.weight": (128, 32),
        "ff_proj.bias": (128,),
        "ff_out.weight": (32, 64),
        "ff_out.bias": (32,),
        "attn_norm.weight": (32,),
        "attn_norm.bias": (32,),
        "ff_norm.weight": (32,),
        "ff_norm.bias": (32,),
        "q_norm.weight": (32,),
        "q_norm.bias": (32,),
        "k_norm.weight": (16,),
        "k_norm.bias": (16,),
    }
    expected = {
        "transformer.wte.weight": (128, 32),
        "transformer.wpe.weight": (16, 32),
        "transformer.emb_norm.weight": (32,),
        "transformer.emb_norm.bias": (32,),
        "transformer.ln_f.weight": (32,),
        "transformer.ln_f.bias": (32,),
        "transformer.ff_out.weight": (128, 32),
        "transformer.ff_out.bias": (128,),
    }
    for i in range(2):
        expected.update({f"transformer.blocks.{i}.{k}": v for k, v in block.items()})
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == expected

    other = build(seed=5, **overrides)
    other.load_state_dict(model.state_dict(), strict=True)
    ids = random_ids()
    torch.testing.assert_close(other(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "positions",
    [dict(rope=True), dict(rope=False, alibi=True), dict(rope=False)],
    ids=["rope", "alibi", "learned"],
)
def test_logits_are_causal(positions):
    model = build(**positions)
    ids = random_ids()
    t = 6
    changed = ids.clone()
    changed[:, t + 1 :] = torch.randint(1, VOCAB, changed[:, t + 1 :].shape)
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_grouped_query_attention_equals_mha_with_repeated_kv_heads(n_kv_heads):
    """Query head h must read kv head h // (n_heads / n_kv_heads), the layout of OLMo checkpoints and flash-attn."""
    gqa = build(n_kv_heads=n_kv_heads, include_bias=True)
    mha = build(include_bias=True)
    group, head_dim, d = 4 // n_kv_heads, 8, 32
    state = gqa.state_dict()
    for name in list(state):
        if "att_proj" in name:
            q, k, v = state[name].split((d, n_kv_heads * head_dim, n_kv_heads * head_dim))

            def repeat(t):
                return t.reshape(n_kv_heads, head_dim, *t.shape[1:]).repeat_interleave(group, 0).flatten(0, 1)

            state[name] = torch.cat((q, repeat(k), repeat(v)))
    mha.load_state_dict(state, strict=True)
    ids = random_ids()
    torch.testing.assert_close(gqa(ids).logits, mha(ids).logits)


def test_left_padding_with_attention_mask_does_not_change_real_tokens():
    model = build(rope=False, alibi=True)  # ALiBi is translation invariant, so left padding is exact
    ids = random_ids(batch=1, seq=10)
    pad = 6
    padded = torch.cat((torch.zeros(1, pad, dtype=torch.long), ids), dim=1)
    mask = torch.cat((torch.zeros(1, pad), torch.ones(1, 10)), dim=1)
    logits = model(padded, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[:, pad:], model(ids).logits)
    assert not torch.allclose(model(padded).logits[:, pad:], model(ids).logits, atol=1e-3)


@pytest.mark.parametrize(
    "overrides", [dict(rope=False, alibi=True), dict(layer_norm_type=LayerNormType.low_precision)]
)
def test_bf16_autocast_with_padding_mask_stays_finite_and_close_to_fp32(overrides):
    model = build(**overrides)
    ids = random_ids()
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: those query rows see no key at all
    reference = model(ids, attention_mask=mask).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[:, 5:].float(), reference[:, 5:], atol=0.05, rtol=0.05)


def test_all_ones_mask_matches_plain_causal_attention():
    model = build()
    ids = random_ids()
    mask = torch.ones_like(ids, dtype=torch.bool)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, model(ids).logits)


def test_right_padding_mask_keeps_prefix_logits():
    model = build()
    ids = random_ids(batch=1, seq=9)
    padded = torch.cat((ids, torch.zeros(1, 7, dtype=torch.long)), dim=1)
    mask = torch.cat((torch.ones(1, 9), torch.zeros(1, 7)), dim=1)
    torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, :9], model(ids).logits)


def _truncated_std(std: float, cutoff: float) -> float:
    pdf = math.exp(-(cutoff**2) / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(cutoff / math.sqrt(2))
    return std * math.sqrt(1 - 2 * cutoff * pdf / mass)


INIT_CASES = {
    "normal": (
        dict(init_fn=InitFnType.normal, init_std=0.02),
        None,
        {"wte": 0.02, "att_proj": 0.02, "attn_out.0": 0.02, "ff_out.1": 0.02, "lm_head": 0.02},
    ),
    "normal_cutoff": (
        dict(init_fn=InitFnType.normal, init_std=0.02, init_cutoff_factor=2.0),
        2.0,
        {"wte": 0.02, "att_proj": 0.02, "attn_out.1": 0.02},
    ),
    "mitchell": (
        dict(init_fn=InitFnType.mitchell),
        3.0,
        {
            "wte": 128**-0.5,
            "att_proj": 128**-0.5,
            "ff_proj": 128**-0.5,
            "attn_out.0": (2 * 128 * 1) ** -0.5,
            "attn_out.1": (2 * 128 * 2) ** -0.5,
            "ff_out.0": (2 * 256 * 1) ** -0.5,
            "ff_out.1": (2 * 256 * 2) ** -0.5,
            "lm_head": 128**-0.5,
        },
    ),
    "full_megatron": (
        dict(init_fn=InitFnType.full_megatron, init_std=0.02, scale_emb_init=True),
        3.0,
        {
            "wte": 0.02 * 128**0.5,
            "att_proj": 0.02,
            "attn_out.1": 0.02 / 2,
            "ff_out.0": 0.02 / 2,
            "lm_head": 128**-0.5,
        },
    ),
}


@pytest.mark.parametrize("case", list(INIT_CASES))
def test_init_std_and_truncation(case):
    overrides, cutoff, expected = INIT_CASES[case]
    cfg = tiny_config(d_model=128, vocab_size=256, embedding_size=512, weight_tying=False, **overrides)
    torch.manual_seed(0)
    model = OLMo(cfg)
    blocks = model.transformer.blocks
    tensors = {
        "wte": model.transformer.wte.weight,
        "lm_head": model.transformer.ff_out.weight,
        "att_proj": torch.cat([b.att_proj.weight.flatten() for b in blocks]),
        "ff_proj": torch.cat([b.ff_proj.weight.flatten() for b in blocks]),
    }
    for i, block in enumerate(blocks):
        tensors[f"attn_out.{i}"] = block.attn_out.weight
        tensors[f"ff_out.{i}"] = block.ff_out.weight
    for name, nominal in expected.items():
        w = tensors[name].detach()
        want = nominal if cutoff is None else _truncated_std(nominal, cutoff)
        assert w.mean().abs() < 0.05 * nominal, name
        assert w.std().item() == pytest.approx(want, rel=0.05), name
        if cutoff is None:
            assert w.abs().max() > 3 * nominal, f"{name} looks truncated"
        else:
            assert w.abs().max() <= cutoff * nominal * (1 + 1e-6), name
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "norm" in name or "ln_f" in name:
            assert torch.all(p == 1), name


def test_init_is_deterministic_and_meta_build_matches_direct_build():
    cfg = tiny_config(init_fn=InitFnType.mitchell)
    torch.manual_seed(0)
    direct = OLMo(cfg)
    torch.manual_seed(0)
    again = OLMo(cfg)
    torch.manual_seed(1)
    other = OLMo(cfg)
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = OLMo(cfg)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()

    ref = direct.state_dict()
    for candidate in (again, lazy):
        got = candidate.state_dict()
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert not torch.equal(other.state_dict()["transformer.wte.weight"], ref["transformer.wte.weight"])
    ids = random_ids()
    torch.testing.assert_close(lazy(ids).logits, direct(ids).logits, rtol=0, atol=0)


def test_rope_tables_from_inference_mode_do_not_break_training():
    model = build()
    ids = random_ids()
    with torch.inference_mode():
        model(ids)
    model(ids).logits.sum().backward()
    assert model.transformer.wte.weight.grad is not None


VARIANTS = {
    "rope": {},
    "alibi": dict(rope=False, alibi=True),
    "learned_positions": dict(rope=False),
    "untied": dict(weight_tying=False),
    "scale_logits": dict(scale_logits=True),
    "clip_qkv": dict(clip_qkv=0.5),
    "qk_norm": dict(attention_layer_norm=True),
    "norm_after": dict(norm_after=True, layer_norm_type=LayerNormType.rms),
    "rms": dict(layer_norm_type=LayerNormType.rms),
    "low_precision": dict(layer_norm_type=LayerNormType.low_precision),
    "gelu": dict(activation_type=ActivationType.gelu),
    "relu": dict(activation_type=ActivationType.relu),
    "mqa": dict(n_kv_heads=1),
    "emb_norm": dict(embedding_layer_norm=True),
    "no_bias_no_affine": dict(include_bias=False, layer_norm_with_affine=False),
    "dropout": dict(attention_dropout=0.1, residual_dropout=0.1, embedding_dropout=0.1),
    "rope_half_precision": dict(rope_full_precision=False),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains(name):
    model = build(**VARIANTS[name])
    ids = random_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    logits = model(ids, attention_mask=mask if name == "alibi" else None).logits
    assert logits.shape == (2, 16, 128)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    for param_name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), param_name
        assert p.grad.abs().sum() > 0, param_name


def test_mlp_width_per_activation():
    assert build(activation_type=ActivationType.swiglu).transformer.blocks[0].ff_out.in_features == 64
    assert build(activation_type=ActivationType.gelu).transformer.blocks[0].ff_out.in_features == 128


def test_swiglu_first_half_is_linear_branch_second_half_is_gate():
    block = build().transformer.blocks[0]
    x = torch.randn(2, 5, 32)
    up_w, gate_w = block.ff_proj.weight.chunk(2, dim=0)
    up_b, gate_b = block.ff_proj.bias.chunk(2)
    expected = block.ff_out(F.silu(x @ gate_w.T + gate_b) * (x @ up_w.T + up_b))
    torch.testing.assert_close(block.feed_forward(x), expected)


def test_clip_qkv_bounds_attention_values():
    seen = []

    def capture(module, args):
        seen.append(args[0].abs().max().item())

    for clip in (None, 0.01):
        model = build(clip_qkv=clip, init_std=0.5)
        model.transformer.blocks[0].attn_out.register_forward_pre_hook(capture)
        model(random_ids())
    # The attention output is a convex combination of clamped values, so it cannot exceed the clip.
    assert seen[0] > 0.01
    assert seen[1] <= 0.01 + 1e-6


def test_qk_norm_makes_attention_invariant_to_query_key_scale():
    for qk_norm, should_change in ((True, False), (False, True)):
        model = build(attention_layer_norm=qk_norm, include_bias=False, init_std=0.2)
        ids = random_ids()
        before = model(ids).logits
        with torch.no_grad():
            for block in model.transformer.blocks:
                block.att_proj.weight[: 2 * 32] *= 7.0  # q and k rows
        changed = not torch.allclose(model(ids).logits, before, atol=1e-4)
        assert changed == should_change


@pytest.mark.parametrize("norm_after", [False, True])
def test_norm_after_normalizes_sublayer_outputs(norm_after):
    model = build(norm_after=norm_after)
    block = model.transformer.blocks[0]
    captured = {}
    block.register_forward_pre_hook(lambda m, args: captured.__setitem__("block_in", args[0]))
    block.attn_out.register_forward_hook(lambda m, args, out: captured.__setitem__("attn_out", out))
    block.attn_norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("norm_in", args[0]))
    model(random_ids())
    # Pre-norm normalizes the block input; OLMo-2's norm_after normalizes the attention output instead.
    source = captured["attn_out"] if norm_after else captured["block_in"]
    assert captured["norm_in"] is source


def test_tied_logits_use_embedding_and_hidden_states_are_returned():
    model = build()
    ids = random_ids()
    out = model(ids, output_hidden_states=True)
    assert out.attn_key_values is None
    assert len(out.hidden_states) == 3
    torch.testing.assert_close(out.hidden_states[0], model.transformer.wte(ids))
    torch.testing.assert_close(out.logits, out.hidden_states[-1] @ model.transformer.wte.weight.T)
    assert model(ids).hidden_states is None


def test_scale_logits_divides_by_sqrt_d_model():
    ids = random_ids()
    plain, scaled = build()(ids).logits, build(scale_logits=True)(ids).logits
    torch.testing.assert_close(scaled, plain / math.sqrt(32))


def test_layer_norm_variants():
    x = torch.randn(3, 8) * 5 + 2
    rms = LayerNorm(8, LayerNormType.rms, eps=4.0, elementwise_affine=True, bias=True)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 2.0)
        rms.bias.uniform_(-1, 1)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 4.0) * rms.weight + rms.bias
    torch.testing.assert_close(rms(x), expected)
    assert not list(LayerNorm(8, LayerNormType.rms, 1e-5, elementwise_affine=False, bias=True).parameters())

    default = LayerNorm(8, LayerNormType.default, 1e-5, elementwise_affine=True, bias=False)
    low = LayerNorm(8, LayerNormType.low_precision, 1e-5, elementwise_affine=True, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low_out = low(x)
    assert low_out.dtype == torch.bfloat16
    torch.testing.assert_close(low_out.float(), default(x), atol=0.05, rtol=0.02)


def test_rope_uses_neox_rotate_half_layout():
    cos, sin = rotary_cos_sin(seq_len=5, head_dim=4, theta=10000, device=torch.device("cpu"))
    p = 3
    e0 = torch.tensor([1.0, 0.0, 0.0, 0.0])
    e1 = torch.tensor([0.0, 1.0, 0.0, 0.0])
    # Frequencies are 1 and 10000^-0.5; frequency i drives the pair (i, i + head_dim/2).
    torch.testing.assert_close(apply_rotary(e0, cos[p], sin[p]), torch.tensor([math.cos(p), 0, math.sin(p), 0]))
    torch.testing.assert_close(
        apply_rotary(e1, cos[p], sin[p]), torch.tensor([0, math.cos(p * 0.01), 0, math.sin(p * 0.01)])
    )


def test_alibi_bias_values():
    bias = alibi_bias(n_heads=2, seq_len=3, bias_max=8.0, device=torch.device("cpu"))
    assert bias.shape == (1, 2, 3, 3)
    assert bias[0, 0, 2, 0].item() == pytest.approx(-2 * 2**-4)
    assert bias[0, 1, 2, 1].item() == pytest.approx(-(2**-8))
    assert torch.all(bias.diagonal(dim1=-2, dim2=-1) == 0)


def test_flash_attention_without_package_warns_once_and_matches_sdpa(caplog):
    attention_mixer._warn_once.cache_clear()
    ids = random_ids()
    with caplog.at_level(logging.WARNING, logger="olmo.model"):
        flash = build(flash_attention=True)
        first, second = flash(ids).logits, flash(ids).logits
    assert len([r for r in caplog.records if "flash-attn" in r.getMessage()]) == 1
    torch.testing.assert_close(first, build()(ids).logits)
    torch.testing.assert_close(second, first)


def test_tiny_model_overfits_fixed_batch():
    model = build(seed=0, d_model=64, max_sequence_length=32)
    ids = random_ids(batch=4, seq=32)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_num_flops_per_token():
    # Per block: att_proj 32*96 + attn_out 32*32 + ff_proj 32*128 + ff_out 64*32 = 10240; LM head 128*32 = 4096.
    n_matmul = 2 * 10240 + 4096
    overrides = dict(include_bias=False, layer_norm_with_affine=False)
    tied = build(**overrides)
    untied_learned = build(weight_tying=False, rope=False, **overrides)
    for model in (tied, untied_learned):
        assert model.num_flops_per_token() == 6 * n_matmul + 12 * 2 * 32 * 16 == 159_744
        assert model.num_flops_per_token(seq_len=8) == 6 * n_matmul + 12 * 2 * 32 * 8
    assert tied.num_params(include_embedding=False) == 2 * 10240
    assert untied_learned.num_params(include_embedding=False) == 2 * 10240 + 4096


def test_each_layer_is_a_mixer_and_a_feed_forward_under_olmos_parameter_names_and_order():
    """The parts are chosen per layer from the config, and whatever the parts, a block's parameters keep OLMo's names
    in OLMo's order (checkpoints' keys and the optimizer state's order depend on it; these lists are the block's
    before it was split into parts)."""
    from olmo.config import MoEConfig
    from olmo.model.attention_mixer import AttentionMixer
    from olmo.model.block import OLMoBlock
    from olmo.model.feed_forward import DenseFeedForward, RoutedFeedForward

    dense = OLMoBlock(0, tiny_config(attention_layer_norm=True))
    assert isinstance(dense, AttentionMixer) and isinstance(dense, DenseFeedForward) and dense.moe is None
    modules = ["attn_out", "ff_out", "attn_norm", "ff_norm", "att_proj", "ff_proj"]
    both = [f"{m}.{p}" for m in modules for p in ("weight", "bias")]
    assert [n for n, _ in dense.named_parameters()] == [
        *("k_norm.weight", "k_norm.bias", "q_norm.weight", "q_norm.bias"),
        *both,
    ]
    moe = MoEConfig(num_experts=4, top_k=2, shared_expert_hidden_size=16)
    routed = OLMoBlock(1, tiny_config(moe=moe))
    assert isinstance(routed, RoutedFeedForward)
    assert [n for n, _ in routed.named_parameters()] == [*both, "moe.w1", "moe.w3", "moe.w2", "moe.router.weight"]
    # The model computes all its heads; only a tensor-parallel plan, from outside, gives a mixer a share of them.
    assert (dense.n_heads, dense.n_kv_heads) == (dense.config.n_heads, dense.config.effective_n_kv_heads)
