"""``data.generate_doc_lengths``: each instance's document lengths, as OLMo computes them, reach the model."""

import numpy as np
import pytest
import torch

from olmo.config import ModelConfig, TrainConfig
from olmo.data import DataCollator, MemMapDataset, build_memmap_dataset
from olmo.exceptions import OLMoConfigurationError
from olmo.model import OLMo
from olmo.testing import BYTE_EOS, run_train, tiny_config_dict, write_byte_memmap, write_config

T = 32  # the tiny config's max_sequence_length


def _expected_doc_lens(tokens: list[int], eos: int) -> list[int]:
    """Documents end after each EOS (included); the instance's end closes the last one."""
    lens, current = [], 0
    for token in tokens:
        current += 1
        if token == eos:
            lens.append(current)
            current = 0
    return lens + [current] if current else lens


def test_doc_lens_of_real_text_follow_olmos_formula(tmp_path):
    tokens = write_byte_memmap(tmp_path / "text.npy", 3000 * T)
    cfg = TrainConfig.from_dict(
        tiny_config_dict(tmp_path, [str(tmp_path / "text.npy")], **{"data.generate_doc_lengths": True})
    )
    dataset = build_memmap_dataset(cfg, cfg.data)  # eos_token_id from model.eos_token_id
    with_eos = 0
    for i in range(len(dataset)):
        doc_lens = dataset[i]["doc_lens"]
        assert doc_lens.dtype == torch.long and int(doc_lens.sum()) == T
        assert doc_lens.tolist() == _expected_doc_lens(tokens[i * T : (i + 1) * T].tolist(), BYTE_EOS)
        with_eos += len(doc_lens) > 1
    assert with_eos >= 5  # instances that cross documents


@pytest.mark.parametrize(
    "tokens, doc_lens",
    [
        ([3, 4, 9, 5, 6, 9, 7, 8], [3, 3, 2]),  # a document cut off at the end
        ([3, 4, 9, 5, 6, 7, 8, 9], [3, 5]),  # ends with EOS: no empty document after it
        ([9, 3, 4, 5, 6, 7, 8, 2], [1, 7]),  # starts with EOS
        ([3, 4, 5, 6, 7, 8, 1, 2], [8]),  # no EOS at all
        ([9] * 8, [1] * 8),
    ],
)
def test_doc_lens_edge_cases(tmp_path, tokens, doc_lens):
    path = tmp_path / "tokens.npy"
    np.asarray(tokens, dtype=np.uint32).tofile(path)
    dataset = MemMapDataset(path, chunk_size=8, memmap_dtype="uint32", generate_doc_lengths=True, eos_token_id=9)
    assert dataset[0]["doc_lens"].tolist() == doc_lens
    assert "doc_lens" not in MemMapDataset(path, chunk_size=8, memmap_dtype="uint32")[0]


def test_doc_lens_need_the_eos_token(tmp_path):
    with pytest.raises(OLMoConfigurationError, match="model.eos_token_id"):
        MemMapDataset(tmp_path / "x.npy", chunk_size=8, generate_doc_lengths=True)


def test_collator_pads_doc_lens_with_zeros_and_lists_the_longest_document():
    items = [
        {"input_ids": torch.arange(8), "doc_lens": torch.tensor([3, 3, 2])},
        {"input_ids": torch.arange(8), "doc_lens": torch.tensor([8])},
        {"input_ids": torch.arange(8), "doc_lens": torch.tensor([1, 7])},
    ]
    batch = DataCollator()(items)
    assert batch["doc_lens"].dtype == torch.long
    assert batch["doc_lens"].tolist() == [[3, 3, 2], [8, 0, 0], [1, 7, 0]]
    assert batch["max_doc_lens"] == [3, 8, 7]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_becomes_its_own_document_so_the_model_accepts_the_batch(side):
    items = [
        {"input_ids": torch.arange(2, 10), "doc_lens": torch.tensor([3, 5])},
        {"input_ids": torch.arange(2, 7), "doc_lens": torch.tensor([2, 3])},
    ]
    batch = DataCollator(pad_direction=side, pad_token_id=1)(items)
    assert batch["doc_lens"].tolist() == [[3, 5, 0], [2, 3, 3] if side == "right" else [3, 2, 3]]
    assert batch["max_doc_lens"] == [5, 3]
    model = OLMo(
        ModelConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=16, embedding_size=16, max_sequence_length=8)
    )
    logits = model(batch["input_ids"], doc_lens=batch["doc_lens"], max_doc_lens=batch["max_doc_lens"]).logits
    assert logits.shape == (2, 8, 16)


def _config(tmp_path, **overrides):
    """Real text cut into short documents (an EOS every 24 tokens on average)."""
    data = tmp_path / "text.npy"
    tokens = write_byte_memmap(data, 48 * T).copy()
    tokens[np.random.default_rng(0).random(len(tokens)) < 1 / 24] = BYTE_EOS
    tokens.tofile(data)
    cfg = tiny_config_dict(tmp_path / "run", [str(data)], max_duration=3, **overrides)
    return write_config(tmp_path / "config.yaml", cfg)


def test_every_micro_batch_passes_its_rows_doc_lens_to_the_model(tmp_path, monkeypatch):
    calls = []
    forward = OLMo.forward

    def recording_forward(self, input_ids, *args, doc_lens=None, max_doc_lens=None, **kwargs):
        calls.append((input_ids.clone(), doc_lens, max_doc_lens))
        return forward(self, input_ids, *args, **kwargs)  # without doc_lens: this test is about the wiring

    monkeypatch.setattr(OLMo, "forward", recording_forward)
    assert run_train(_config(tmp_path, **{"data.generate_doc_lengths": True})) == 0
    assert len(calls) == 3 * 2  # 3 steps of 2 micro-batches of 4
    for input_ids, doc_lens, max_doc_lens in calls:
        assert doc_lens.shape[0] == input_ids.shape[0] == 4
        for row, lens, longest in zip(input_ids.tolist(), doc_lens.tolist(), max_doc_lens):
            expected = _expected_doc_lens(row, BYTE_EOS)
            assert lens == expected + [0] * (len(lens) - len(expected)) and longest == max(expected)

    calls.clear()
    assert run_train(_config(tmp_path / "off")) == 0
    assert calls and all(doc_lens is None and max_doc_lens is None for _, doc_lens, max_doc_lens in calls)


def test_training_with_document_masking_differs_from_training_across_documents(tmp_path):
    masked: list = []
    assert run_train(_config(tmp_path / "masked", **{"data.generate_doc_lengths": True}), record=masked) == 0
    plain: list = []
    assert run_train(_config(tmp_path / "plain"), record=plain) == 0
    masked_losses = [r["train/CrossEntropyLoss"] for r in masked]
    plain_losses = [r["train/CrossEntropyLoss"] for r in plain]
    assert all(np.isfinite(masked_losses)) and masked_losses != plain_losses
