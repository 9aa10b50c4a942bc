import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from olmo.data import DataCollator, IterableDataset, MemMapDataset
from olmo.exceptions import OLMoConfigurationError, OLMoDataError


class Numbers(torch.utils.data.Dataset):
    """Instance i holds the token i, so batches show which instances they hold."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([int(i)])}


def rank_indices(dataset, batch, world_size, **kwargs):
    return [
        [item["index"] for item in IterableDataset(dataset, batch, world_size=world_size, rank=r, **kwargs)]
        for r in range(world_size)
    ]


def flatten(lists):
    return [x for row in lists for x in row]


def test_appendix_examples_without_shuffle():
    data = Numbers(20)
    assert rank_indices(data, 2, 2, seed=0, shuffle=False)[0] == list(range(0, 20, 2))
    # B=6 drops the last partial global batch: 18 entries, rank 0 of 3 gets 0, 3, ..., 15.
    assert rank_indices(data, 6, 3, seed=0, shuffle=False)[0] == list(range(0, 18, 3))
    assert rank_indices(data, 2, 2, seed=0, shuffle=False, start_index=12)[0] == [12, 14, 16, 18]
    for world_size in (2, 4):
        ranks = rank_indices(data, 4, world_size, seed=0, shuffle=False, start_index=4)
        assert sorted(flatten(ranks)) == list(range(4, 20))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_split_every_global_batch_by_stride(world_size):
    n, batch = 50, 6
    data = Numbers(n)
    order = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(7 + 2)).shuffle(order)
    ranks = rank_indices(data, batch, world_size, seed=7, epoch=2)
    ds = IterableDataset(data, batch, seed=7, epoch=2, world_size=world_size)
    assert (ds.total_size, ds.batches_per_epoch, ds.device_batch_size) == (48, 8, batch // world_size)
    used = order[: ds.total_size].tolist()
    assert sorted(flatten(ranks)) == sorted(used)  # every used entry exactly once, none of the dropped tail
    device = batch // world_size
    for s in range(ds.batches_per_epoch):
        per_rank = [r[s * device : (s + 1) * device] for r in ranks]
        global_batch = used[s * batch : (s + 1) * batch]
        assert sorted(flatten(per_rank)) == sorted(global_batch)
        for r in range(world_size):
            assert per_rank[r] == global_batch[r::world_size]


def test_resume_with_another_world_size_covers_exactly_the_rest():
    data = Numbers(40)
    full = rank_indices(data, 8, 1, seed=3)[0]
    start = 2 * 8  # two global batches done with 2 ranks; resume on 4
    resumed = rank_indices(data, 8, 4, seed=3, start_index=start)
    assert sorted(flatten(resumed)) == sorted(full[start:])
    assert resumed[1][:2] == [full[start + 1], full[start + 5]]


def test_order_file_is_a_raw_uint32_memmap(tmp_path):
    n = 23
    ds = IterableDataset(Numbers(n), 4, seed=11, work_dir=tmp_path)
    path = tmp_path / "global_indices.npy"
    assert path.stat().st_size == n * 4
    expected = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(11)).shuffle(expected)
    assert np.array_equal(np.memmap(path, dtype=np.uint32, mode="r"), expected)
    # No temporary file left behind; the record of what the file holds comes with it.
    assert sorted(tmp_path.iterdir()) == [path, tmp_path / "global_indices.npy.json"]
    # Other ranks compute the same order without writing.
    other = IterableDataset(Numbers(n), 4, seed=11, world_size=2, rank=1, work_dir=tmp_path / "rank1")
    assert np.array_equal(other.global_indices(), expected)
    assert not (tmp_path / "rank1").exists()

    ds.reshuffle(1)
    epoch1 = tmp_path / "global_indices_epoch1.npy"
    expected1 = np.arange(n, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(12)).shuffle(expected1)
    assert np.array_equal(np.memmap(epoch1, dtype=np.uint32, mode="r"), expected1)
    assert ds.start_index == 0 and ds.order_file() == epoch1


def test_order_file_reuse_conflict_and_overwrite(tmp_path):
    IterableDataset(Numbers(23), 4, seed=11, work_dir=tmp_path)
    path = tmp_path / "global_indices.npy"
    mtime = path.stat().st_mtime_ns
    IterableDataset(Numbers(23), 4, seed=11, work_dir=tmp_path)  # a resume in the same folder
    assert path.stat().st_mtime_ns == mtime
    with pytest.raises(OLMoDataError, match=r"global_indices\.npy.*seed changed.*--save_overwrite"):
        IterableDataset(Numbers(23), 4, seed=12, work_dir=tmp_path)
    with pytest.raises(OLMoDataError, match="--save_overwrite"):
        IterableDataset(Numbers(30), 4, seed=11, work_dir=tmp_path)
    ds = IterableDataset(Numbers(30), 4, seed=12, work_dir=tmp_path, overwrite=True)
    assert np.array_equal(np.memmap(path, dtype=np.uint32, mode="r"), ds.global_indices())


def test_bad_batch_sizes():
    with pytest.raises(OLMoConfigurationError, match="global_train_batch_size=6"):
        IterableDataset(Numbers(20), 6, seed=0, world_size=4)
    with pytest.raises(OLMoDataError, match="fewer than one global batch"):
        IterableDataset(Numbers(3), 4, seed=0)


@pytest.mark.parametrize("start_index", [0, 12])
def test_dataloader_batches_do_not_depend_on_num_workers(write_memmap, start_index):
    dataset = MemMapDataset(
        write_memmap("a.npy", np.arange(2 * 61)), chunk_size=2, include_instance_metadata=False
    )

    def batches(num_workers):
        ds = IterableDataset(dataset, 8, seed=5, world_size=2, rank=1, start_index=start_index)
        loader = DataLoader(
            ds, batch_size=ds.device_batch_size, collate_fn=DataCollator(), num_workers=num_workers
        )
        return [(b["index"].tolist(), b["input_ids"].tolist()) for b in loader]

    single = batches(0)
    assert len(single) == -(-(56 - start_index) // 8)  # a resume mid-batch ends with a partial batch
    assert all(ids == [[2 * i, 2 * i + 1] for i in index] for index, ids in single)
    assert batches(2) == single
