"""The one atomic file write: a reader finds the old file or the whole new one, and a failed write leaves the old
file and no temporary file behind."""

import os
import stat

import numpy as np
import pytest

from olmo.util import atomic_file, atomic_write, write_result_file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_text_and_bytes_land_whole_with_the_permissions_of_a_plain_write(tmp_path):
    path = tmp_path / "new" / "folder" / "result.json"  # the folders are made
    atomic_write(path, '{"loss": 2.5, "name": "größe"}\n')
    assert path.read_bytes() == '{"loss": 2.5, "name": "größe"}\n'.encode()

    path.chmod(0o600)  # replaced, not written into: the new file has a fresh file's mode
    atomic_write(path, b"\x00\x01binary")
    assert path.read_bytes() == b"\x00\x01binary"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    assert os.listdir(path.parent) == ["result.json"]


def test_a_streamed_writer_is_invisible_until_the_block_ends(tmp_path):
    path = tmp_path / "order.npy"
    path.write_bytes(b"old")
    order = np.arange(1000, dtype=np.uint32)
    with atomic_file(path) as out:
        np.save(out, order)
        assert path.read_bytes() == b"old"
    np.testing.assert_array_equal(np.load(path), order)
    assert os.listdir(tmp_path) == ["order.npy"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "global_indices.npy"
    path.write_bytes(b"the old order")
    with pytest.raises(TypeError):
        with atomic_file(path) as out:
            out.write(b"half of the new order")
            out.write("not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"the old order"
    assert os.listdir(tmp_path) == ["global_indices.npy"]


def test_a_failing_rename_leaves_no_temporary_file(tmp_path):
    # A folder where the file should go: the rename itself fails, after the content was written and fsynced.
    (tmp_path / "result.json").mkdir()
    with pytest.raises(IsADirectoryError):
        write_result_file(tmp_path / "result.json", "{}")
    assert os.listdir(tmp_path) == ["result.json"]
    assert (tmp_path / "result.json").is_dir()
