"""The loss: the fused output-layer loss must give the plain loss's values and gradients."""

import pytest
import torch

from olmo.config import ModelConfig
from olmo.model import OLMo
from olmo.model.loss import cross_entropy_sums, fused_output_loss


def test_z_loss_is_the_squared_log_partition_over_labelled_positions():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1, 2, -100, 4, 5], [-100, -100, 3, 3, 0]])
    loss = cross_entropy_sums(logits, labels, 1e-3)
    valid = labels != -100
    expected_ce = -torch.log_softmax(logits, -1)[valid].gather(1, labels[valid][:, None]).sum()
    torch.testing.assert_close(loss.ce, expected_ce)
    assert loss.z is not None
    torch.testing.assert_close(loss.z, 1e-3 * (torch.logsumexp(logits, -1)[valid] ** 2).sum())
    torch.testing.assert_close(loss.total, loss.ce + loss.z)
    assert cross_entropy_sums(logits, labels, None).z is None


def _leaves(n=37, c=16, v=101, bias=False, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, c, generator=gen, dtype=dtype, requires_grad=True)
    b = torch.randn(v, generator=gen, dtype=dtype, requires_grad=True) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::5] = -100
    return hidden, weight, b, labels


def _loss_and_grads(fn, hidden, weight, bias, upstream=3.0):
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    for t in leaves:
        t.grad = None
    loss = fn()
    (loss.total * upstream).backward()
    return loss, [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("z_loss", [None, 1e-2], ids=["ce", "ce_and_z"])
@pytest.mark.parametrize("chunk", [8, 37, 1000], ids=["chunks_with_remainder", "one_exact_chunk", "big_chunk"])
def test_fused_loss_matches_the_plain_loss_and_its_gradients(bias, z_loss, chunk):
    hidden, weight, b, labels = _leaves(bias=bias)
    scale = 0.5

    def plain():
        return cross_entropy_sums(torch.nn.functional.linear(hidden, weight, b) * scale, labels, z_loss)

    def fused():
        return fused_output_loss(hidden, weight, labels, z_loss, scale, b, chunk_size=chunk)

    expected, expected_grads = _loss_and_grads(plain, hidden, weight, b)
    got, grads = _loss_and_grads(fused, hidden, weight, b)
    torch.testing.assert_close(got.ce, expected.ce, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(got.total, expected.total, rtol=1e-12, atol=1e-10)
    assert (got.z is None) == (z_loss is None)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_fused_loss_under_cpu_bf16_autocast_is_as_close_as_bf16_allows():
    hidden, weight, _, labels = _leaves(n=64, c=32, v=300, dtype=torch.float32)
    reference, reference_grads = _loss_and_grads(
        lambda: fused_output_loss(hidden, weight, labels, 1e-4), hidden, weight, None
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, plain_grads = _loss_and_grads(
            lambda: cross_entropy_sums(torch.nn.functional.linear(hidden, weight), labels, 1e-4),
            hidden,
            weight,
            None,
        )
        fused, fused_grads = _loss_and_grads(
            lambda: fused_output_loss(hidden, weight, labels, 1e-4, chunk_size=16), hidden, weight, None
        )
    assert fused.ce.dtype == torch.float32 and fused_grads[0].dtype == torch.float32
    # Both bf16 paths land as close to the fp32 loss as each other.
    fused_error = (fused.ce - reference.ce).abs() / reference.ce
    plain_error = (plain.ce - reference.ce).abs() / reference.ce
    assert fused_error < 1e-2 and plain_error < 1e-2
    for f, p, r in zip(fused_grads, plain_grads, reference_grads):
        assert (f - r).norm() / r.norm() < 2e-2
        assert (f - p).norm() / r.norm() < 2e-2


def test_fused_loss_of_fully_masked_labels_is_zero_with_zero_gradients():
    hidden, weight, _, labels = _leaves()
    loss, (grad_hidden, grad_weight) = _loss_and_grads(
        lambda: fused_output_loss(hidden, weight, torch.full_like(labels, -100), 1e-2, chunk_size=8),
        hidden,
        weight,
        None,
    )
    assert loss.total.item() == 0.0
    assert not grad_hidden.any() and not grad_weight.any()


def test_fused_loss_without_gradients_computes_only_the_loss():
    hidden, weight, _, labels = _leaves()
    with torch.no_grad():
        loss = fused_output_loss(hidden, weight, labels, None, chunk_size=8)
    expected = cross_entropy_sums(hidden.detach() @ weight.detach().T, labels, None)
    torch.testing.assert_close(loss.ce, expected.ce)
    assert not loss.total.requires_grad


@pytest.mark.parametrize("weight_tying", [False, True], ids=["untied", "tied"])
def test_model_with_fused_loss_gets_the_plain_gradients(weight_tying):
    config = ModelConfig(
        d_model=32,
        n_heads=2,
        n_layers=2,
        max_sequence_length=16,
        vocab_size=250,
        embedding_size=256,
        weight_tying=weight_tying,
        scale_logits=True,
        include_bias=True,
        attention_dropout=0.0,
        residual_dropout=0.0,
        embedding_dropout=0.0,
    )
    torch.manual_seed(0)
    model = OLMo(config).double()
    ids = torch.randint(0, 250, (3, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), -100)], dim=1)

    def grads(fused: bool):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels, z_loss_multiplier=1e-3, fused_loss=fused)
        assert (out.logits is None) == fused
        out.loss.total.backward()
        return out.loss.ce, {name: p.grad.clone() for name, p in model.named_parameters()}

    plain_ce, plain = grads(False)
    fused_ce, fused = grads(True)
    torch.testing.assert_close(fused_ce, plain_ce, rtol=1e-12, atol=1e-10)
    assert fused.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_fused_loss_scales_bf16_gradients_without_rounding_the_scale():
    # The trainer backpropagates loss * (world_size / n_labels); rounding that factor to bf16 (1/5000 is
    # off by 0.14%) would bias every gradient of the step the same way.
    hidden, weight, _, labels = _leaves(n=64, c=32, v=300, dtype=torch.float32)
    grads = {}
    for scale in (1.0, 1 / 5000):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, grads[scale] = _loss_and_grads(
                lambda: fused_output_loss(hidden, weight, labels, 1e-4, chunk_size=16), hidden, weight, None, scale
            )
    for unit, scaled in zip(grads[1.0], grads[1 / 5000]):
        ratio = (scaled.double().abs().sum() / unit.double().abs().sum()).item() * 5000
        assert ratio == pytest.approx(1.0, abs=2e-4)


def _kl_reference(c=16, v=101, n=37, bias=False, seed=1):
    from olmo.model.loss import OutputHead

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, c, generator=gen, dtype=torch.float64)
    b = torch.randn(v, generator=gen, dtype=torch.float64) if bias else None
    return OutputHead(hidden, weight, b, 0.5)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("z_loss", [None, 1e-2], ids=["ce", "ce_and_z"])
@pytest.mark.parametrize("chunk", [8, 1000], ids=["chunks_with_remainder", "big_chunk"])
def test_fused_kl_is_the_exact_kl_to_the_reference_with_its_gradients(bias, z_loss, chunk):
    """kl_estimator: full. The chunked KL(policy || reference) and the gradient of ce + z + beta * KL must equal
    autograd's through the textbook formula, sum over labelled rows of sum_v p (log p - log r)."""
    hidden, weight, b, labels = _leaves(bias=bias)
    ref = _kl_reference(bias=bias)
    scale, beta = 0.5, 0.3

    def plain():
        logits = torch.nn.functional.linear(hidden, weight, b) * scale
        loss = cross_entropy_sums(logits, labels, z_loss)
        ref_logp = torch.log_softmax(torch.nn.functional.linear(ref.hidden, ref.weight, ref.bias) * scale, -1)
        logp = torch.log_softmax(logits, -1)
        rows = (logp.exp() * (logp - ref_logp)).sum(-1)[labels != -100]
        kl = rows.sum()
        return type(loss)(loss.total + beta * kl, loss.ce, loss.z, kl.detach())

    def fused():
        return fused_output_loss(
            hidden, weight, labels, z_loss, scale, b, chunk_size=chunk, reference=ref, kl_beta=beta
        )

    expected, expected_grads = _loss_and_grads(plain, hidden, weight, b)
    got, grads = _loss_and_grads(fused, hidden, weight, b)
    assert got.kl is not None and got.kl > 0
    torch.testing.assert_close(got.kl, expected.kl, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.total, expected.total, rtol=1e-12, atol=1e-10)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


def test_fused_kl_to_an_identical_reference_is_exactly_zero_and_adds_no_gradient():
    from olmo.model.loss import OutputHead

    hidden, weight, _, labels = _leaves(dtype=torch.float32)
    ref = OutputHead(hidden.detach().clone(), weight.detach().clone(), None)
    plain, plain_grads = _loss_and_grads(
        lambda: fused_output_loss(hidden, weight, labels, None), hidden, weight, None
    )
    got, grads = _loss_and_grads(
        lambda: fused_output_loss(hidden, weight, labels, None, reference=ref, kl_beta=0.5), hidden, weight, None
    )
    assert got.kl is not None and got.kl.item() == 0.0
    torch.testing.assert_close(got.total, plain.total, rtol=0, atol=0)
    for g, e in zip(grads, plain_grads):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_ce_weight_scales_only_the_cross_entropy_term(fused):
    """kl_estimator: nll_diff trains ce + beta * (ce - reference ce) = (1 + beta) ce + const."""
    hidden, weight, _, labels = _leaves()

    def loss(w):
        if fused:
            return fused_output_loss(hidden, weight, labels, 1e-2, chunk_size=8, ce_weight=w)
        return cross_entropy_sums(torch.nn.functional.linear(hidden, weight), labels, 1e-2, w)

    one, _ = _loss_and_grads(lambda: loss(1.0), hidden, weight, None)
    weighted, grads = _loss_and_grads(lambda: loss(1.7), hidden, weight, None)
    assert one.z is not None and weighted.z is not None
    torch.testing.assert_close(weighted.total, 1.7 * one.ce + one.z, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(weighted.ce, one.ce, rtol=0, atol=0)

    def by_parts():  # autograd of 1.7 ce + z, through the plain formulas
        logits = torch.nn.functional.linear(hidden, weight)
        parts = cross_entropy_sums(logits, labels, 1e-2)
        return type(parts)(0.7 * cross_entropy_sums(logits, labels, None).total + parts.total, parts.ce, parts.z)

    _, expected = _loss_and_grads(by_parts, hidden, weight, None)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
