"""Document spans from the metadata beside a token file (dolma's format is tested on real dolma output in
tests/cli/test_dolma.py): clipping to the instance, files without metadata, and damaged metadata."""

import gzip

import numpy as np
import pytest

from olmo.data.provenance import instance_documents
from olmo.exceptions import OLMoDataError


def test_spans_are_clipped_to_the_instance_and_absent_metadata_is_none(tmp_path):
    tokens = tmp_path / "part-0-00000.npy"
    np.arange(100, dtype=np.uint16).tofile(tokens)
    assert instance_documents(str(tokens), 0, 32) is None
    with gzip.open(tmp_path / "part-0-00000.csv.gz", "wt") as f:
        f.write("0,10,a,src.json.gz,0\n10,40,b,src.json.gz,1\n40,100,c,src.json.gz,2\n")
    assert instance_documents(str(tokens), 32, 32) == [
        {"id": "b", "start": 0, "end": 8},
        {"id": "c", "start": 8, "end": 32},
    ]
    assert instance_documents(str(tokens), 0, 10) == [{"id": "a", "start": 0, "end": 10}]


@pytest.mark.parametrize(
    "content",
    # mtime=0 keeps the bytes, and so the test ids, the same in every pytest-xdist worker.
    [b"not gzip at all", gzip.compress(b"start;end\n", mtime=0), gzip.compress(b"x,y,z\n", mtime=0)],
    ids=["not-gzip", "wrong-separator", "wrong-columns"],
)
def test_damaged_metadata_is_one_paragraph(tmp_path, content):
    tokens = tmp_path / "part.npy"
    np.zeros(64, dtype=np.uint16).tofile(tokens)
    (tmp_path / "part.csv.gz").write_bytes(content)
    with pytest.raises(
        OLMoDataError, match=r"part\.csv\.gz' beside the token file .* is not dolma's document metadata"
    ):
        instance_documents(str(tokens), 0, 32)
