from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

WriteMemmap = Callable[..., str]


@pytest.fixture
def write_memmap(tmp_path: Path) -> WriteMemmap:
    """Write ``values`` as a headerless memmap (as ``dolma tokens`` does) and return its path."""

    def write(name: str, values, dtype=np.uint16) -> str:
        path = tmp_path / name
        array = np.asarray(values, dtype=dtype)
        if array.size == 0:
            path.write_bytes(b"")
        else:
            out = np.memmap(path, dtype=dtype, mode="w+", shape=array.shape)
            out[:] = array
            out.flush()
            del out
        return str(path)

    return write
