import pytest
import torch

from olmo.data import DataCollator
from olmo.exceptions import OLMoConfigurationError


def items():
    return [
        {
            "input_ids": torch.tensor([5, 6, 7]),
            "label_mask": torch.tensor([True, False, True]),
            "attention_mask": torch.tensor([1.0, 1.0, 1.0]),
            "index": 4,
            "metadata": {"path": "a.npy"},
        },
        {
            "input_ids": torch.tensor([8]),
            "label_mask": torch.tensor([True]),
            "attention_mask": torch.tensor([1.0]),
            "index": 9,
            "metadata": {"path": "b.npy"},
        },
    ]


def test_right_padding():
    batch = DataCollator(pad_direction="right", pad_token_id=1)(items())
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["input_ids"].dtype == torch.long
    assert batch["label_mask"].tolist() == [[True, False, True], [True, False, False]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["index"].tolist() == [4, 9] and batch["index"].dtype == torch.long
    assert batch["metadata"] == [{"path": "a.npy"}, {"path": "b.npy"}]


def test_left_padding():
    batch = DataCollator(pad_direction="left", pad_token_id=0)(items())
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["label_mask"].tolist() == [[True, False, True], [False, False, True]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_equal_lengths_only_stack():
    batch = DataCollator()([{"input_ids": torch.tensor([1, 2]), "index": 0}, {"input_ids": [3, 4], "index": 1}])
    assert batch["input_ids"].tolist() == [[1, 2], [3, 4]]
    assert set(batch) == {"input_ids", "index"}


def test_bad_direction():
    with pytest.raises(OLMoConfigurationError, match="data.pad_direction"):
        DataCollator(pad_direction="middle")
