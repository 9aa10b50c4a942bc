"""FlexAttention as the attention backend of masked layers (issue 55, point 1, the CPU's part): its forward equals the
SDPA-mask path's for sliding windows, documents, padding and grouped key/value heads; its masks skip the blocks a
window hides; the backend is checked with its key, refused for training on a CPU, and not part of the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from olmo.config import SlidingWindowConfig
from olmo.exceptions import OLMoConfigurationError
from olmo.model import OLMo
from olmo.model.attention import describe_attention
from olmo.model.flex_attention import flex_masks
from olmo.testing import run_train, tiny_config_dict, tiny_model_config, write_byte_memmap, write_config

T = 256


def _logits(model: OLMo, backend: str, ids: torch.Tensor, **inputs) -> torch.Tensor:
    model.config.attention_backend = backend
    with torch.no_grad():
        return model(ids, **inputs).logits


@pytest.fixture(scope="module")
def model() -> OLMo:
    torch.manual_seed(0)
    cfg = tiny_model_config(
        max_sequence_length=T,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,  # grouped key/value heads
        sliding_window=SlidingWindowConfig(pattern=[64, 96, 64, -1]),
        attention_layer_norm=True,
        layer_norm_type="rms",
    )
    built = OLMo(cfg).eval()
    return built


def test_the_forward_equals_the_sdpa_masks_with_windows_documents_and_padding(model):
    ids = torch.randint(0, 100, (3, T), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(model, "flex", ids), _logits(model, "sdpa", ids), rtol=1e-5, atol=1e-5)
    doc_lens = torch.tensor([[100, 156, 0], [T, 0, 0], [30, 30, 196]])
    flex = _logits(model, "flex", ids, doc_lens=doc_lens)
    torch.testing.assert_close(flex, _logits(model, "sdpa", ids, doc_lens=doc_lens), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(flex, _logits(model, "flex", ids), atol=1e-3)  # the documents changed something
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :40] = 0  # a left-padded row: its padding positions' outputs mean nothing, the others must agree
    flex = _logits(model, "flex", ids, attention_mask=mask)
    sdpa = _logits(model, "sdpa", ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(flex[real], sdpa[real], rtol=1e-5, atol=1e-5)
    model.config.attention_backend = None
    assert torch.equal(_logits(model, None, ids), _logits(model, "sdpa", ids))  # a CPU's automatic choice: SDPA


def test_a_window_s_mask_skips_the_blocks_it_hides():
    masks = flex_masks([128], 1024, torch.device("cpu"), None, None)
    assert set(masks) == {128}  # full attention without documents or padding needs no mask: SDPA's causal kernel
    # Causal alone keeps about half of the 8 x 8 blocks of 128; a 128-token window keeps the diagonal and the one
    # below it: 15 of 64.
    kept = masks[128].to_dense()  # (1, 1, query blocks, key blocks), 1 where a block is computed
    assert int(kept.sum()) == 15
    assert set(flex_masks([128, 2048], 1024, torch.device("cpu"), None, None)) == {
        128
    }  # a window past T hides nothing
    # A window's mask alone is the same for every batch: built once and kept; one with documents is each batch's.
    assert flex_masks([128], 1024, torch.device("cpu"), None, None)[128] is masks[128]
    doc_ids = torch.zeros(2, 1024, dtype=torch.long)
    doc_ids[:, 500:] = 1
    with_docs = flex_masks([128], 1024, torch.device("cpu"), doc_ids, None)
    assert with_docs[128] is not masks[128] and set(with_docs) == {128, None}
    assert int(with_docs[None].to_dense()[0].sum()) < 36  # causal 36 of 64 blocks; the documents hide more


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention_backend": "triton"}, "model.attention_backend='triton' must be flex, sdpa or null"),
        ({"attention_backend": "flex", "attention_dropout": 0.1}, "cannot apply attention_dropout=0.1"),
        ({"attention_backend": "flex", "alibi": True, "rope": False}, "cannot apply ALiBi's per-head bias"),
    ],
)
def test_bad_backends_are_named(overrides, message):
    cfg = dataclasses.replace(tiny_model_config(), **overrides)
    assert any(message in p for p in cfg.problems()), cfg.problems()


def test_flex_is_not_part_of_the_model_and_cannot_train_on_a_cpu(tmp_path):
    from olmo.distributed.parallelize import model_config_fingerprint

    cfg = tiny_model_config()
    assert model_config_fingerprint(cfg) == model_config_fingerprint(
        dataclasses.replace(cfg, attention_backend="flex")
    )
    flex = dataclasses.replace(cfg, attention_backend="flex", sliding_window=SlidingWindowConfig(pattern=[8, -1]))
    info = describe_attention(flex, torch.device("cpu"), None, has_bias=False)
    assert info["window_kernel"] == "FlexAttention" and info["masked_kernel"] == "FlexAttention (block-sparse)"
    assert "masked_kernel" not in describe_attention(cfg, torch.device("cpu"), None, has_bias=False)
    corpus = tmp_path / "corpus.npy"
    write_byte_memmap(corpus, 2_000)
    run = tiny_config_dict(
        tmp_path / "run", [str(corpus)], **{"model.attention_backend": "flex", "evaluators": []}
    )
    with pytest.raises(OLMoConfigurationError, match="model.attention_backend=flex cannot train on a CPU"):
        run_train(write_config(tmp_path / "flex.yaml", run))
    assert not (tmp_path / "run").exists()


def test_a_batch_s_masks_built_compiled_are_the_eager_ones():
    """On a GPU a batch's masks (documents and padding, with or without a window: the same function) come from a
    compiled ``create_block_mask``: the same block masks as eager ones, for two batches of different documents
    (compiled once, not per batch). The full-attention layers' mask alone keeps the compile to one graph here."""
    key_mask = torch.ones(2, 512, dtype=torch.bool)
    key_mask[1, 400:] = False
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(seed)
        doc_ids = torch.randint(0, 3, (2, 512), generator=gen).sort(dim=1).values
        eager = flex_masks([], 512, torch.device("cpu"), doc_ids, key_mask, compiled=False)
        compiled = flex_masks([], 512, torch.device("cpu"), doc_ids, key_mask, compiled=True)
        assert set(eager) == set(compiled) == {None}
        for window, mask in eager.items():
            other = compiled[window]
            assert torch.equal(mask.to_dense(), other.to_dense())
            for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                assert torch.equal(getattr(mask, name), getattr(other, name)), (window, name)
