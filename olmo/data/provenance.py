"""Which documents an instance holds, from the metadata ``dolma tokens`` writes beside every token file.

``dolma tokens`` writes ``part-N-XXXXX.npy`` and, beside it, ``part-N-XXXXX.csv.gz``: one row per document,
``start,end,id,src,loc``, where ``[start, end)`` are the document's token offsets in the ``.npy`` file, in
increasing order. An instance of ``T`` tokens at offset ``o`` holds the documents whose span meets ``[o, o + T)``;
their spans are given relative to the instance (clipped to it), as ``{id, start, end}``.
"""

from __future__ import annotations

import csv
import gzip
from pathlib import Path
from typing import Optional

from ..exceptions import OLMoDataError
from ..util import is_url

__all__ = ["document_metadata_path", "instance_documents"]


def document_metadata_path(token_file: str) -> Optional[Path]:
    """The dolma metadata file of a local token file, or None when there is none (or the file is remote)."""
    if is_url(token_file):
        return None
    path = Path(token_file)
    candidate = path.with_name(path.name[: -len(path.suffix)] + ".csv.gz") if path.suffix else None
    return candidate if candidate is not None and candidate.is_file() else None


def instance_documents(token_file: str, offset: int, length: int) -> Optional[list[dict[str, object]]]:
    """The documents of the instance ``[offset, offset + length)`` of ``token_file``, or None without metadata.

    :raises OLMoDataError: for a metadata file that is not dolma's (unreadable, or rows without token offsets).
    """
    meta = document_metadata_path(token_file)
    if meta is None:
        return None
    end_of_instance = offset + length
    out: list[dict[str, object]] = []
    try:
        with gzip.open(meta, "rt", newline="") as f:
            for row_number, row in enumerate(csv.reader(f), start=1):
                if len(row) < 3:
                    raise ValueError(f"row {row_number} has {len(row)} fields, not start,end,id,...")
                start, end = int(row[0]), int(row[1])
                if start >= end_of_instance:
                    break  # rows are in token order: none later meets the instance
                if end > offset:
                    out.append(
                        {
                            "id": row[2],
                            "start": max(start, offset) - offset,
                            "end": min(end, end_of_instance) - offset,
                        }
                    )
    except (OSError, ValueError, EOFError, csv.Error, UnicodeDecodeError) as e:
        raise OLMoDataError(
            f"'{meta}' beside the token file '{token_file}' is not dolma's document metadata ({e}). Expected a "
            f"gzipped CSV of start,end,id,src,loc rows; move it aside to inspect the batch without document ids."
        ) from None
    return out
