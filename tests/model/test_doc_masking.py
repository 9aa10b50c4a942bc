"""Intra-document attention masking (``OLMo.forward(doc_lens=...)``, the model side of OLMo's
``data.generate_doc_lengths``): a packed document sees only itself, and nothing changes without ``doc_lens``."""

import pytest
import torch
import torch.nn.functional as F

from olmo.config import ModelConfig
from olmo.exceptions import OLMoDataError
from olmo.model import OLMo
from olmo.model.attention import (
    attention_bias,
    describe_attention,
    document_ids,
    document_spans,
    flash_varlen_attention,
)
from olmo.testing import tiny_model_config

VOCAB = 100
T = 24
# Packed and separate runs differ only in summation order (masked vs causal SDPA kernel) and RoPE angles.
TIGHT = dict(rtol=1e-5, atol=1e-6)
RELATIVE_POSITIONS = {
    "rope": dict(rope=True),
    "rope_gqa_qk_norm": dict(rope=True, n_kv_heads=2, attention_layer_norm=True),
    "alibi": dict(rope=False, alibi=True),
}


def tiny_config(**overrides) -> ModelConfig:
    return tiny_model_config(**{"vocab_size": VOCAB, "max_sequence_length": T, **overrides})


def build(**overrides) -> OLMo:
    torch.manual_seed(0)
    return OLMo(tiny_config(**overrides))


def random_ids(batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def document_slices(lengths: list[int]) -> list[slice]:
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return [slice(start, end) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]


@pytest.mark.parametrize("positions", RELATIVE_POSITIONS.values(), ids=RELATIVE_POSITIONS.keys())
def test_packed_documents_give_the_logits_of_separate_runs(positions):
    model = build(**positions)
    ids = random_ids(batch=3)
    doc_lens = torch.tensor([[7, 9, 8], [24, 0, 0], [3, 3, 18]])
    logits = model(ids, doc_lens=doc_lens).logits
    for row, lengths in enumerate(doc_lens.tolist()):
        for doc in document_slices(lengths):
            alone = model(ids[row : row + 1, doc]).logits[0]
            torch.testing.assert_close(logits[row, doc], alone, **TIGHT)


@pytest.mark.parametrize("positions", RELATIVE_POSITIONS.values(), ids=RELATIVE_POSITIONS.keys())
def test_documents_with_padding_give_the_logits_of_separate_runs(positions):
    model = build(**positions)
    ids = random_ids(batch=3)
    # Padding is counted in a document: its own (row 0), or a real one, before (row 1) or after (row 2) its tokens.
    doc_lens = torch.tensor([[5, 10, 9], [16, 8, 0], [6, 18, 0]])
    mask = torch.ones_like(ids)
    mask[0, 15:] = 0  # right padding
    mask[1, :4] = 0  # left padding inside the first document
    mask[2, 17:] = 0  # right padding inside the second document
    real_docs = {0: [slice(0, 5), slice(5, 15)], 1: [slice(4, 16), slice(16, 24)], 2: [slice(0, 6), slice(6, 17)]}
    logits = model(ids, attention_mask=mask, doc_lens=doc_lens).logits
    assert torch.isfinite(logits).all()
    for row, docs in real_docs.items():
        for doc in docs:
            alone = model(ids[row : row + 1, doc]).logits[0]
            torch.testing.assert_close(logits[row, doc], alone, **TIGHT)


def test_one_document_per_row_is_plain_causal_attention_and_no_doc_lens_builds_no_mask():
    model = build()
    ids = random_ids(batch=2)
    whole_rows = torch.full((2, 1), T)
    torch.testing.assert_close(model(ids, doc_lens=whole_rows).logits, model(ids).logits, **TIGHT)
    # Without doc_lens, padding or ALiBi there is no mask at all: SDPA runs its plain causal kernel as before.
    assert attention_bias(model.config, T, torch.device("cpu")) is None


@pytest.mark.parametrize(
    "positions", [*RELATIVE_POSITIONS.values(), dict(rope=False)], ids=[*RELATIVE_POSITIONS.keys(), "learned"]
)
def test_a_document_depends_only_on_its_own_tokens_and_gradients_flow(positions):
    model = build(**positions)
    ids = random_ids(batch=2)
    doc_lens = torch.tensor([[8, 10, 6], [12, 12, 0]])
    first, rest = slice(0, 8), slice(8, T)
    changed = ids.clone()
    changed[0, first] = torch.randint(1, VOCAB, (8,), generator=torch.Generator().manual_seed(7))

    out = model(ids, doc_lens=doc_lens, output_hidden_states=True)
    assert out.hidden_states is not None and out.logits is not None
    torch.testing.assert_close(
        model(changed, doc_lens=doc_lens).logits[0, rest], out.logits[0, rest], rtol=0, atol=0
    )
    assert not torch.allclose(model(changed).logits[0, rest], model(ids).logits[0, rest], atol=1e-3)

    embeddings = out.hidden_states[0]  # (B, T, C), the input of the first block
    embeddings.retain_grad()
    loss = F.cross_entropy(out.logits[0, 8:17].float(), ids[0, 9:18])  # the second document of row 0
    loss.backward()
    assert embeddings.grad is not None
    assert (embeddings.grad[0, first] == 0).all()  # the first document cannot influence it
    assert embeddings.grad[0, 8:18].abs().sum() > 0
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model.transformer.blocks[0].att_proj.weight.grad.abs().sum() > 0


def test_labels_and_fused_loss_take_doc_lens():
    model = build(weight_tying=True)
    ids = random_ids(batch=2)
    doc_lens = torch.tensor([[8, 10, 6], [12, 12, 0]])
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), dim=1)
    logits = model(ids, doc_lens=doc_lens).logits
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    plain = model(ids, doc_lens=doc_lens, labels=labels, z_loss_multiplier=1e-4).loss
    fused_out = model(ids, doc_lens=doc_lens, labels=labels, z_loss_multiplier=1e-4, fused_loss=True)
    fused = fused_out.loss
    assert fused_out.logits is None and plain is not None and fused is not None
    torch.testing.assert_close(plain.ce, expected, **TIGHT)
    torch.testing.assert_close(fused.ce, plain.ce, **TIGHT)
    torch.testing.assert_close(fused.z, plain.z, **TIGHT)
    unmasked = model(ids, labels=labels, fused_loss=True).loss
    assert unmasked is not None and not torch.allclose(unmasked.ce, fused.ce)
    fused.total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def reference_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal):
    """flash-attn's documented ``flash_attn_varlen_func`` contract in plain PyTorch: q (total, H, hd) and k/v
    (total, KV, hd) cut at ``cu_seqlens`` into sequences of at most ``max_seqlen`` tokens, each attended alone."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32 and causal
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        assert 0 < end - start <= max_seqlen_q == max_seqlen_k
        group = q.size(1) // k.size(1)
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (heads, L, hd)
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout_p, is_causal=True).transpose(
            0, 1
        )
    return out


def test_flash_varlen_layout_matches_the_sdpa_document_mask():
    """The GPU path's reshapes and ``cu_seqlens``, checked on CPU against the kernel's contract."""
    config = tiny_config(n_kv_heads=2)
    doc_lens = torch.tensor([[7, 9, 8], [24, 0, 0], [3, 3, 18]])
    spans = document_spans(doc_lens, None)
    assert spans.cu_seqlens.tolist() == [0, 7, 16, 24, 48, 51, 54, 72] and spans.max_seqlen == 24
    assert document_spans(doc_lens, [9, 24, 18]).max_seqlen == 24
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, T, 8, generator=g)  # (B, H, T, hd)
    k, v = torch.randn(2, 3, 2, T, 8, generator=g)  # (B, KV, T, hd) each
    varlen = flash_varlen_attention(reference_varlen_func, q, k, v, spans, 0.0)  # (B, T, H, hd)
    bias = attention_bias(config, T, torch.device("cpu"), None, document_ids(doc_lens, T))
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=bias)
    torch.testing.assert_close(varlen, dense.transpose(1, 2), **TIGHT)


@pytest.mark.parametrize(
    "doc_lens, max_doc_lens, message",
    [
        (torch.tensor([[T], [T], [T]]), None, r"got shape \(3, 1\) for input_ids of shape \(2, 24\)"),
        (torch.tensor([T, T]), None, r"got shape \(2,\)"),
        (torch.tensor([[T], [T]], dtype=torch.float), None, "got dtype torch.float32"),
        (torch.tensor([[T, 0], [10, 13]]), None, r"row 1 has lengths \[10, 13\] for 24 tokens \(1 of 2 rows"),
        (torch.tensor([[T + 2, -2], [T, 0]]), None, r"row 0 has lengths \[26, -2\]"),
        (torch.tensor([[T, 0], [12, 12]]), [12, 12], r"at most max\(max_doc_lens\)=12; row 0"),
    ],
    ids=["batch", "1d", "float", "sum", "negative", "max_doc_lens"],
)
def test_bad_doc_lens_are_refused_with_the_reason(doc_lens, max_doc_lens, message):
    model = build()
    with pytest.raises(OLMoDataError, match=message):
        model(random_ids(batch=2), doc_lens=doc_lens, max_doc_lens=max_doc_lens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("flash_attention", [False, True], ids=["sdpa_mask", "flash_varlen"])
def test_bf16_doc_masking_on_cuda_matches_separate_runs(flash_attention):
    if flash_attention:
        pytest.importorskip("flash_attn")
    device = torch.device("cuda")
    with device:
        model = build(flash_attention=flash_attention, n_kv_heads=2)
    ids = random_ids(batch=3).to(device)
    doc_lens = torch.tensor([[7, 9, 8], [24, 0, 0], [3, 3, 18]], device=device)
    report = describe_attention(model.config, device, torch.bfloat16, has_bias=False, doc_masking=True)
    assert report["backend"] == ("flash_attn.flash_attn_varlen_func" if flash_attention else "torch SDPA")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(ids, doc_lens=doc_lens, max_doc_lens=[9, 24, 18]).logits.float()
        for row, lengths in enumerate(doc_lens.tolist()):
            for doc in document_slices(lengths):
                alone = model(ids[row : row + 1, doc]).logits[0].float()
                torch.testing.assert_close(logits[row, doc], alone, atol=5e-2, rtol=5e-2)
        loss = model(ids, doc_lens=doc_lens, labels=ids, fused_loss=True).loss
    assert loss is not None
    loss.total.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
