"""The epoch's order is built once, in its file, and memory-mapped by every reader: it is OLMo's permutation, a
relaunch reuses it after a cheap check, and neither DataLoader workers nor other ranks recompute it."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader, Dataset

from olmo.data import DataCollator, IterableDataset
from olmo.data import order_file as order_file_module
from olmo.exceptions import OLMoDataError


class Numbers(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return {"input_ids": np.array([i], dtype=np.int64)}


def olmo_order(n: int, seed: int) -> np.ndarray:
    order = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed)).shuffle(order)
    return order


def never(*args, **kwargs):
    raise AssertionError("the order was computed again")


def test_the_file_holds_olmos_permutation_and_is_mapped_not_copied(tmp_path):
    n = 200_003  # more entries than the sampled checksum covers
    ds = IterableDataset(Numbers(n), 8, seed=5, work_dir=tmp_path)
    path = tmp_path / "global_indices.npy"
    assert np.array_equal(np.fromfile(path, dtype=np.uint32), olmo_order(n, 5))
    assert isinstance(ds.global_indices(), np.memmap) and Path(ds.global_indices().filename).samefile(path)
    record = json.loads((tmp_path / "global_indices.npy.json").read_text())
    assert {k: record[k] for k in ("num_instances", "seed", "epoch", "shuffle", "bytes")} == {
        "num_instances": n,
        "seed": 5,
        "epoch": 0,
        "shuffle": True,
        "bytes": 4 * n,
    }


def test_the_order_file_is_readable_by_whoever_may_read_the_run(tmp_path):
    """Built through mkstemp (owner-only), it is then given the umask's mode, as every other run file is."""
    old = os.umask(0o022)
    try:
        IterableDataset(Numbers(100), 8, seed=5, work_dir=tmp_path)
    finally:
        os.umask(old)
    assert (tmp_path / "global_indices.npy").stat().st_mode & 0o777 == 0o644


def test_a_relaunch_reuses_the_file_and_a_damaged_one_is_refused(tmp_path, monkeypatch):
    IterableDataset(Numbers(1000), 8, seed=5, work_dir=tmp_path)
    path = tmp_path / "global_indices.npy"
    with monkeypatch.context() as m:
        m.setattr(order_file_module, "_shuffle_in_place", never)
        relaunch = IterableDataset(Numbers(1000), 8, seed=5, work_dir=tmp_path)
        assert np.array_equal(relaunch.global_indices(), olmo_order(1000, 5))
    order = np.fromfile(path, dtype=np.uint32)
    order[[3, 4]] = order[[4, 3]]  # a file that another order was written over
    order.tofile(path)
    with pytest.raises(OLMoDataError, match=r"holds a different data order.*--save_overwrite"):
        IterableDataset(Numbers(1000), 8, seed=5, work_dir=tmp_path)
    IterableDataset(Numbers(1000), 8, seed=5, work_dir=tmp_path, overwrite=True)
    assert np.array_equal(np.fromfile(path, dtype=np.uint32), olmo_order(1000, 5))


def test_an_order_file_from_before_the_record_is_checked_once_then_recorded(tmp_path):
    path = tmp_path / "global_indices.npy"
    olmo_order(1000, 5).tofile(path)  # as earlier versions (and OLMo) wrote it: no record
    IterableDataset(Numbers(1000), 8, seed=5, work_dir=tmp_path)
    assert (tmp_path / "global_indices.npy.json").is_file()
    olmo_order(1000, 6).tofile(tmp_path / "other.npy")
    (tmp_path / "other.npy").rename(path)
    (tmp_path / "global_indices.npy.json").unlink()
    with pytest.raises(OLMoDataError, match="holds a different data order"):
        IterableDataset(Numbers(1000), 8, seed=5, work_dir=tmp_path)


def test_dataloader_workers_and_other_ranks_map_the_file(tmp_path, monkeypatch):
    rank0 = IterableDataset(Numbers(1000), 8, seed=5, world_size=2, rank=0, work_dir=tmp_path)
    expected = [
        b["input_ids"].flatten().tolist() for b in DataLoader(rank0, batch_size=4, collate_fn=DataCollator())
    ]
    monkeypatch.setattr(order_file_module, "_shuffle_in_place", never)  # inherited by forked workers
    loader = DataLoader(rank0, batch_size=4, collate_fn=DataCollator(), num_workers=2)
    assert [b["input_ids"].flatten().tolist() for b in loader] == expected
    rank1 = IterableDataset(Numbers(1000), 8, seed=5, world_size=2, rank=1, work_dir=tmp_path)
    assert isinstance(rank1.global_indices(), np.memmap)
    assert list(rank1.global_indices()[1:8:2]) == list(olmo_order(1000, 5)[1:8:2])
