"""The DPO reference's log-probabilities, computed once before training (``dpo.precompute_reference``).

Every instance's summed log-probability of its labels under the frozen reference goes into
``save_folder/train_data/dpo_reference_logps.npy`` (float32, one per instance, in instance order), written by rank 0
through a temporary file and a rename, with a record beside it (``.json``: the reference, the data files with a
fingerprint of each one's content (:func:`data_fingerprint`: files prepared again are told apart even when they hold
as many instances), the number of instances, the sequence length and the file's crc32). A launch in which every rank
finds a matching record and checksum reads the file without building the reference at all; otherwise the ranks
compute the values anew (each rank then holds all of them; only rank 0 writes the file). The data-parallel ranks split the instances (rank ``r``
of ``D`` takes instances ``r, r + D, ...``), each in micro-batches of ``device_train_microbatch_size``, under the
run's autocast; ranks of a tensor-parallel group compute the same instances together.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ..config import DataConfig, ModelConfig
from ..data import DataCollator, DataContext, build_dataset
from ..distributed.collectives import all_reduce, barrier
from ..distributed.layout import ParallelLayout
from ..exceptions import OLMoError
from ..util import local_path_of, write_result_file
from ..util.atomic import atomic_file
from ..util.bounded_files import open_regular, read_bounded

__all__ = ["REFERENCE_FILE", "ReferenceInputs", "data_fingerprint", "precomputed_reference", "reference_of_batch"]

log = logging.getLogger(__name__)

REFERENCE_FILE = "dpo_reference_logps.npy"
_HASH_CHUNK = 1 << 20
_SETTLED_NS = 2_000_000_000
"""A data file's hash is remembered by its size, mtime and inode only once it is this old (2 s): file systems keep
mtimes to a few milliseconds or coarser, so a file rewritten in place just after it was hashed could look unchanged."""
_MAX_RECORD_BYTES = 1 << 24
"""The largest record read (its files' names and fingerprints): far above what thousands of data files take."""


@dataclass(frozen=True)
class ReferenceInputs:
    """What the precomputation reads of a run: its preference data, the model's sizes, the reference's path and where
    the values are kept (``save_folder/train_data``)."""

    data: DataConfig
    model: ModelConfig
    data_context: DataContext
    reference_path: Optional[str]
    save_folder: str
    micro_batch: int
    """Instances per forward pass (``device_train_microbatch_size``)."""


def _record(inputs: ReferenceInputs, dataset: Any, held: dict[str, Any]) -> dict[str, Any]:
    files, stats = data_fingerprint(dataset, held.get("file_stats") or {})
    return {
        "reference": inputs.reference_path,
        "instances": len(dataset),
        "sequence_length": inputs.model.max_sequence_length,
        "files": files,
        "dtype": "float32",
        "file_stats": stats,
    }


def data_fingerprint(
    dataset: Any, known: Optional[dict[str, Any]] = None
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """What identifies the content of each of ``dataset``'s token and label-mask files: a local file's size and
    SHA-256 (read in chunks), a remote file's size and version (ETag, generation or Last-Modified, as the server
    says), so that files prepared again, even with as many instances, are told apart; and, for local files, the
    ``{path: {"stat": [size, mtime_ns, inode], "sha256": ...}}`` that lets the next launch skip reading a file whose
    ``known`` entry (the previous record's) still matches it."""
    remote = dataset.remote_records() if dataset.has_remote_files else {}
    out: dict[str, dict[str, Any]] = {}
    stats: dict[str, Any] = {}
    for path in [*map(str, dataset.paths), *map(str, dataset.label_mask_paths or [])]:
        if path in remote:
            out[path] = {"size": remote[path].size, "version": remote[path].version}
            continue
        local = local_path_of(path)
        st = os.stat(local)
        stat = [st.st_size, st.st_mtime_ns, st.st_ino]
        cached = (known or {}).get(path)
        if isinstance(cached, dict) and cached.get("stat") == stat and isinstance(cached.get("sha256"), str):
            sha = cached["sha256"]  # the same file, unchanged since the last launch hashed it
        else:
            digest = hashlib.sha256()
            with open_regular(local, 1 << 62, f"The data file '{path}'") as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
            sha = digest.hexdigest()
        out[path] = {"size": st.st_size, "sha256": sha}
        if time.time_ns() - st.st_mtime_ns > _SETTLED_NS:  # a file written just now may change within its mtime
            stats[path] = {"stat": stat, "sha256": sha}
    return out, stats


def _held_record(path: Path) -> dict[str, Any]:
    """The record beside ``path`` from an earlier launch ({} if none can be read)."""
    try:
        held = json.loads(read_bounded(path.with_name(path.name + ".json"), _MAX_RECORD_BYTES))
    except (OLMoError, OSError, ValueError, RecursionError):
        return {}
    return held if isinstance(held, dict) else {}


def _reusable(path: Path, record: dict[str, Any], held: dict[str, Any]) -> bool:
    """Whether ``path`` holds the values ``record`` describes (the record ``held`` beside it matches, the content
    of the data files included, and the file its checksum); read only when it is a regular file of the size it must
    have. Where the data files lie and when they were written (``file_stats``) do not matter."""
    try:
        data = read_bounded(path, 4 * record["instances"])
    except (OLMoError, OSError):
        return False
    same = {k: v for k, v in held.items() if k != "file_stats"}
    return len(data) == 4 * record["instances"] and same == {
        **{k: v for k, v in record.items() if k != "file_stats"},
        "crc32": zlib.crc32(data),
    }


def precomputed_reference(
    inputs: ReferenceInputs,
    layout: ParallelLayout,
    build_reference: Callable[[], nn.Module],
    forward: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
) -> np.ndarray:
    """The reference's log-probability of every instance, computed now unless every rank finds a matching file.
    ``build_reference()`` builds and loads the frozen model (only when needed; freed afterwards);
    ``forward(reference, batch)`` returns the summed log-probabilities (B,) of a collated batch on the device."""
    dataset = build_dataset(inputs.data, inputs.model, inputs.data_context)
    path = Path(inputs.save_folder) / "train_data" / REFERENCE_FILE
    held = _held_record(path)
    record = _record(inputs, dataset, held)
    env = layout.launch
    found = torch.tensor([1.0 if _reusable(path, record, held) else 0.0], device=env.device)
    # All ranks compute together, or none: a rank that does not see the file decides.
    if all_reduce(found, torch.distributed.ReduceOp.MIN).item() == 1.0:
        log.info("Reusing the DPO reference's log-probabilities in %s (its record matches).", path)
        return np.fromfile(path, dtype=np.float32)
    values = _compute(inputs, layout, dataset, build_reference, forward)  # every rank holds them all
    if env.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = values.astype(np.float32).tobytes()
        with atomic_file(path) as f:
            f.write(data)
        write_result_file(
            path.with_name(path.name + ".json"), json.dumps({**record, "crc32": zlib.crc32(data)}) + "\n"
        )
        log.info("Wrote the DPO reference's log-probabilities of %d instances to %s.", len(values), path)
    barrier()
    return values


def _compute(
    inputs: ReferenceInputs,
    layout: ParallelLayout,
    dataset: Any,
    build_reference: Callable[[], nn.Module],
    forward: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
) -> np.ndarray:
    n, micro = len(dataset), inputs.micro_batch
    env = layout.launch
    dp, dp_rank = layout.data_parallel_size, layout.data_parallel_rank
    per_rank = math.ceil(
        n / dp
    )  # every rank runs the same forwards (collectives under FSDP); past n: repeats of 0
    mine = [dp_rank + k * dp for k in range(per_rank)]
    collate = DataCollator(pad_direction=inputs.data.pad_direction, pad_token_id=inputs.model.pad_token_id)
    reference = build_reference()
    values = torch.zeros(per_rank, dtype=torch.float32, device=env.device)
    started, reported = time.monotonic(), 0
    with torch.no_grad():
        for start in range(0, per_rank, micro):
            chunk = [i if i < n else 0 for i in mine[start : start + micro]]
            batch = collate([{k: v for k, v in dataset[i].items() if k != "metadata"} for i in chunk])
            values[start : start + len(chunk)] = forward(reference, batch).float()
            done = min(start + micro, per_rank)
            if env.rank == 0 and (done * 10 // per_rank > reported or done == per_rank):
                reported = done * 10 // per_rank
                log.info(
                    "DPO reference log-probabilities: %d of %d instances on this rank (%.0f s).",
                    done,
                    per_rank,
                    time.monotonic() - started,
                )
    del reference
    gathered = [torch.zeros_like(values) for _ in range(env.world_size)] if env.world_size > 1 else [values]
    if env.world_size > 1:
        torch.distributed.all_gather(gathered, values)
    full = np.zeros(n, dtype=np.float32)
    for rank, part in enumerate(gathered):
        r = layout.data_parallel_rank_of(rank)  # ranks of a tensor-parallel group hold the same values
        positions = np.arange(r, r + per_rank * dp, dp)
        keep = positions < n
        full[positions[keep]] = part.cpu().numpy()[keep]
    return full


def reference_of_batch(logps: np.ndarray, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The precomputed log-probabilities (B,) of the instances ``indices`` (host tensor)."""
    return torch.from_numpy(np.asarray(logps[indices.numpy()], dtype=np.float32)).to(device)
