import logging
import pickle

import numpy as np
import pytest
import torch

from olmo.data import MemMapDataset
from olmo.exceptions import OLMoConfigurationError, OLMoDataError


@pytest.fixture
def two_files(write_memmap):
    return write_memmap("a.npy", np.arange(16)), write_memmap("b.npy", np.arange(100, 116))


def test_two_files_chunk_4_gives_8_instances(two_files):
    ds = MemMapDataset(*two_files, chunk_size=4)
    assert len(ds) == 8
    assert ds[1]["input_ids"].tolist() == [4, 5, 6, 7]
    assert ds[7]["input_ids"].tolist() == [112, 113, 114, 115]
    assert ds[4]["input_ids"].tolist() == [100, 101, 102, 103]
    assert ds[0]["input_ids"].dtype == torch.long
    assert ds.instance_location(7) == (two_files[1], 12)
    assert ds[5]["metadata"] == {"path": two_files[1]}


def test_tail_of_each_file_is_dropped(write_memmap):
    ds = MemMapDataset(write_memmap("a.npy", np.arange(16)), chunk_size=3)
    assert len(ds) == 5
    assert ds[4]["input_ids"].tolist() == [12, 13, 14]
    # The tail is dropped per file: file b's instances start at its own token 0, not at a's token 15.
    two = MemMapDataset(
        write_memmap("c.npy", np.arange(16)), write_memmap("d.npy", np.arange(50, 60)), chunk_size=3
    )
    assert len(two) == 5 + 3
    assert two[5]["input_ids"].tolist() == [50, 51, 52]


def test_index_types_and_negative_indices(two_files):
    ds = MemMapDataset(*two_files, chunk_size=4)
    expected = ds[6]["input_ids"].tolist()
    assert ds[np.uint32(6)]["input_ids"].tolist() == expected
    assert ds[np.int64(6)]["input_ids"].tolist() == expected
    assert ds[torch.tensor(6)]["input_ids"].tolist() == expected
    assert ds[-2]["input_ids"].tolist() == expected
    assert ds[-8]["input_ids"].tolist() == [0, 1, 2, 3]
    # A uint32 taken from global_indices.npy must index as a plain number (no unsigned wrap-around).
    order = np.array([7, 0], dtype=np.uint32)
    assert ds[order[0]]["input_ids"].tolist() == [112, 113, 114, 115]
    for bad in (8, -9, np.uint32(8), np.uint32(2**32 - 1)):
        with pytest.raises(IndexError):
            ds[bad]


def test_uint32_files_and_empty_files_in_between(write_memmap):
    big = np.arange(70000, 70008, dtype=np.uint32)
    ds = MemMapDataset(
        write_memmap("a.npy", big, np.uint32),
        write_memmap("empty.npy", [], np.uint32),
        write_memmap("b.npy", big + 8, np.uint32),
        chunk_size=4,
        memmap_dtype="uint32",
    )
    assert len(ds) == 4
    assert [ds[i]["input_ids"][0].item() for i in range(4)] == [70000, 70004, 70008, 70012]


def test_label_mask_attention_mask_and_metadata(write_memmap):
    tokens = [5, 6, 1, 1, 7, 8, 9, 1]
    mask = [True, False, True, True, False, False, True, True]
    ds = MemMapDataset(
        write_memmap("a.npy", tokens),
        chunk_size=4,
        metadata=[{"label": "web"}],
        generate_attention_mask=True,
        pad_token_id=1,
        label_mask_paths=[write_memmap("a_mask.npy", mask, np.bool_)],
    )
    item = ds[1]
    assert item["label_mask"].dtype == torch.bool
    assert item["label_mask"].tolist() == [False, False, True, True]
    assert item["attention_mask"].tolist() == [1, 1, 1, 0]
    assert item["metadata"] == {"path": ds.paths[0], "label": "web"}
    plain = MemMapDataset(ds.paths[0], chunk_size=4, include_instance_metadata=False)
    assert set(plain[0]) == {"input_ids"}


def test_label_mask_count_must_match(write_memmap):
    with pytest.raises(OLMoConfigurationError, match="data.label_mask_paths"):
        MemMapDataset(write_memmap("a.npy", range(8)), chunk_size=4, label_mask_paths=[])


def test_pickles_without_open_memmaps(two_files):
    ds = MemMapDataset(*two_files, chunk_size=4)
    ds[0]
    assert ds._memmaps
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._memmaps == {}
    assert clone[7]["input_ids"].tolist() == ds[7]["input_ids"].tolist()


def test_file_url_goes_through_cached_path(write_memmap):
    path = write_memmap("a.npy", np.arange(16))
    ds = MemMapDataset(f"file://{path}", chunk_size=4)
    assert len(ds) == 4
    assert ds[2]["input_ids"].tolist() == [8, 9, 10, 11]
    assert ds[2]["metadata"]["path"] == f"file://{path}"


def test_validate_passes_on_good_data(two_files):
    MemMapDataset(*two_files, chunk_size=4).validate(vocab_size=116)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", r"missing\.npy.*does not exist"),
        ("wrong_size", r"odd\.npy.*not a multiple of 2 bytes.*data\.memmap_dtype"),
        ("empty", r"empty\.npy.*is empty"),
        ("vocab", r"ids\.npy.*token id 300 at token offset 5.*model\.vocab_size is 256"),
        ("mask_length", r"ids_mask\.npy.*6 entries.*ids\.npy.*8 tokens"),
        ("all_short", r"chunk_size=4 tokens \(model\.max_sequence_length\).*short\.npy"),
        ("url", r"file://.*nowhere\.npy.*does not exist"),
    ],
)
def test_validate_errors_name_the_file(write_memmap, tmp_path, case, expected):
    good = write_memmap("good.npy", range(8))
    masks = None
    if case == "missing":
        paths = [good, str(tmp_path / "missing.npy")]
    elif case == "wrong_size":
        (tmp_path / "odd.npy").write_bytes(b"\x00" * 7)
        paths = [good, str(tmp_path / "odd.npy")]
    elif case == "empty":
        paths = [good, write_memmap("empty.npy", [])]
    elif case == "vocab":
        paths = [good, write_memmap("ids.npy", [1, 2, 3, 4, 5, 300, 7, 400])]
    elif case == "mask_length":
        paths = [write_memmap("ids.npy", range(8))]
        masks = [write_memmap("ids_mask.npy", [True] * 6, np.bool_)]
    elif case == "all_short":
        paths = [write_memmap("short.npy", [1, 2, 3])]
    else:
        paths = [good, f"file://{tmp_path}/nowhere.npy"]
    ds = MemMapDataset(*paths, chunk_size=4, label_mask_paths=masks)
    with pytest.raises(OLMoDataError, match=expected):
        ds.validate(vocab_size=256)


def test_validate_reports_every_problem(write_memmap, tmp_path):
    ds = MemMapDataset(write_memmap("ids.npy", [999] * 8), str(tmp_path / "gone.npy"), chunk_size=4)
    with pytest.raises(OLMoDataError, match="2 problems") as info:
        ds.validate(vocab_size=256)
    assert "ids.npy" in str(info.value) and "gone.npy" in str(info.value)


def test_validate_scan_budget_and_short_file_warning(write_memmap, caplog):
    ds = MemMapDataset(write_memmap("a.npy", [1] * 8 + [999]), write_memmap("short.npy", [1, 2]), chunk_size=4)
    with caplog.at_level(logging.WARNING):
        ds.validate(vocab_size=256, scan_max_tokens=8)  # the bad id at offset 8 is past the budget
    assert "short.npy" in caplog.text
    with pytest.raises(OLMoDataError, match="token offset 8"):
        ds.validate(vocab_size=256)


def test_reading_a_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(OLMoDataError, match="missing.npy"):
        len(MemMapDataset(str(tmp_path / "missing.npy"), chunk_size=4))
