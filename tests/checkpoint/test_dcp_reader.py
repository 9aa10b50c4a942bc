"""The sharded-checkpoint reader that reads tensors straight into their targets
(:class:`olmo.checkpoint.dcp_reader.DirectFileSystemReader`): the same tensors as DCP's own reader, on the files DCP
writes, with the cases it cannot read directly handed to DCP's path."""

import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from olmo.checkpoint.dcp_reader import DirectFileSystemReader
from olmo.checkpoint.safe_reads import SafeLoadPlanner, root_cause


def _saved(tmp_path):
    torch.manual_seed(0)
    state = {
        "w": torch.randn(37, 11),
        "bf16": torch.randn(5, 3, 2).to(torch.bfloat16),
        "transposed": torch.randn(6, 4).t(),  # stored as a view: DCP's path
        "step": torch.tensor(7.0),  # 0-dim: DCP's path
        "big": torch.randn(3000, 17),
        "ints": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "hyper": {"lr": 1e-3, "name": "adamw"},  # not a tensor: DCP's path
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.save(state, checkpoint_id=str(tmp_path))
    return state


def _empty_like(state):
    return {
        k: ({"lr": 0.0, "name": ""} if isinstance(v, dict) else torch.full_like(v, -1).contiguous())
        for k, v in state.items()
    }


def _load(tmp_path, target, reader):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner())


def test_every_tensor_loads_exactly_as_with_dcps_own_reader(tmp_path):
    saved = _saved(tmp_path)
    direct, plain = _empty_like(saved), _empty_like(saved)
    reader = DirectFileSystemReader(str(tmp_path))
    _load(tmp_path, direct, reader)
    _load(tmp_path, plain, FileSystemReader(str(tmp_path)))
    for key, value in saved.items():
        if isinstance(value, dict):
            assert direct[key] == plain[key] == value
        else:
            assert torch.equal(direct[key], value) and torch.equal(plain[key], value), key
            assert direct[key].dtype == value.dtype
    # w, bf16, big, ints directly; the transposed view, the 0-dim tensor and the two plain values through DCP.
    assert (reader.direct_items, reader.fallback_items) == (4, 4)


def test_a_part_of_a_stored_tensor_loads_into_a_smaller_target(tmp_path):
    # What resharding does: a rank's target is a run of rows of the stored tensor (a DTensor shard's local part).
    torch.manual_seed(1)
    full = torch.randn(10, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": full}, checkpoint_id=str(tmp_path))
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = DirectFileSystemReader(str(tmp_path))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    target = torch.zeros(4, 6)

    class Rows(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            return target

        def commit_tensor(self, read_item, tensor):
            pass

    (chunk,) = metadata.state_dict_metadata["w"].chunks
    assert isinstance(chunk, ChunkStorageMetadata)
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", torch.Size([0, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", torch.Size([0, 0]), 0),
        storage_offsets=torch.Size([5, 0]),
        lengths=torch.Size([4, 6]),
    )
    reader.read_data(LoadPlan([item]), Rows()).wait()
    assert reader.direct_items == 1
    assert torch.equal(target, full[5:9])


def test_a_truncated_shard_file_is_an_error_not_silent_zeros(tmp_path):
    _saved(tmp_path)
    (shard,) = tmp_path.glob("*.distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 30_000])  # cuts into "big", the largest tensor
    with pytest.raises(CheckpointException) as raised:
        _load(tmp_path, _empty_like(_saved_shapes()), DirectFileSystemReader(str(tmp_path)))
    assert re.search("truncated|corrupted", str(root_cause(raised.value)))


def _saved_shapes():
    return {
        "w": torch.zeros(37, 11),
        "bf16": torch.zeros(5, 3, 2, dtype=torch.bfloat16),
        "transposed": torch.zeros(4, 6),
        "step": torch.tensor(0.0),
        "big": torch.zeros(3000, 17),
        "ints": torch.zeros(3, 4, dtype=torch.int64),
        "hyper": {"lr": 0.0, "name": ""},
    }
