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
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import TrainConfig
from ..data import DataCollator, DataContext, build_dataset
from ..distributed.collectives import DistEnv, all_reduce, barrier
from ..exceptions import OLMoError
from ..util import local_path_of, write_result_file
from ..util.atomic import atomic_file
from ..util.bounded_files import open_regular, read_bounded

__all__ = ["REFERENCE_FILE", "data_fingerprint", "precomputed_reference", "reference_of_batch"]

log = logging.getLogger(__name__)

REFERENCE_FILE = "dpo_reference_logps.npy"
_HASH_CHUNK = 1 << 20
_MAX_RECORD_BYTES = 1 << 24
"""The largest record read (its files' names and fingerprints): far above what thousands of data files take."""


def _record(cfg: TrainConfig, dataset: Any) -> dict[str, Any]:
    return {
        "reference": cfg.dpo.reference_path,
        "instances": len(dataset),
        "sequence_length": cfg.model.max_sequence_length,
        "files": data_fingerprint(dataset),
        "dtype": "float32",
    }


def data_fingerprint(dataset: Any) -> dict[str, dict[str, Any]]:
    """What identifies the content of each of ``dataset``'s token and label-mask files: a local file's size and
    SHA-256 (read in chunks), a remote file's size and version (ETag, generation or Last-Modified, as the server
    says), so that files prepared again, even with as many instances, are told apart."""
    remote = dataset.remote_records() if dataset.has_remote_files else {}
    out: dict[str, dict[str, Any]] = {}
    for path in [*map(str, dataset.paths), *map(str, dataset.label_mask_paths or [])]:
        if path in remote:
            out[path] = {"size": remote[path].size, "version": remote[path].version}
            continue
        digest, size = hashlib.sha256(), 0
        with open_regular(local_path_of(path), 1 << 62, f"The data file '{path}'") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        out[path] = {"size": size, "sha256": digest.hexdigest()}
    return out


def _reusable(path: Path, record: dict[str, Any]) -> bool:
    """Whether ``path`` holds the values ``record`` describes (its record matches, and the file its checksum). Both
    files are read only when they are regular files of the sizes they must have."""
    try:
        held = json.loads(read_bounded(path.with_name(path.name + ".json"), _MAX_RECORD_BYTES))
        data = read_bounded(path, 4 * record["instances"])
    except (OLMoError, OSError, ValueError):
        return False
    return len(data) == 4 * record["instances"] and held == {**record, "crc32": zlib.crc32(data)}


def precomputed_reference(
    cfg: TrainConfig,
    env: DistEnv,
    build_reference: Callable[[], nn.Module],
    forward: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
) -> np.ndarray:
    """The reference's log-probability of every instance, computed now unless every rank finds a matching file.
    ``build_reference()`` builds and loads the frozen model (only when needed; freed afterwards);
    ``forward(reference, batch)`` returns the summed log-probabilities (B,) of a collated batch on the device."""
    dataset = build_dataset(cfg.data, cfg.model, DataContext.from_train_config(cfg))
    path = Path(cfg.save_folder) / "train_data" / REFERENCE_FILE
    record = _record(cfg, dataset)
    found = torch.tensor([1.0 if _reusable(path, record) else 0.0], device=env.device)
    # All ranks compute together, or none: a rank that does not see the file decides.
    if all_reduce(found, torch.distributed.ReduceOp.MIN).item() == 1.0:
        log.info("Reusing the DPO reference's log-probabilities in %s (its record matches).", path)
        return np.fromfile(path, dtype=np.float32)
    values = _compute(cfg, env, dataset, build_reference, forward)  # every rank holds them all
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
    cfg: TrainConfig,
    env: DistEnv,
    dataset: Any,
    build_reference: Callable[[], nn.Module],
    forward: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
) -> np.ndarray:
    n, micro = len(dataset), cfg.device_train_microbatch_size
    dp, dp_rank = cfg.data_parallel_size(env.world_size), cfg.data_parallel_rank(env.rank)
    per_rank = math.ceil(
        n / dp
    )  # every rank runs the same forwards (collectives under FSDP); past n: repeats of 0
    mine = [dp_rank + k * dp for k in range(per_rank)]
    collate = DataCollator(pad_direction=cfg.data.pad_direction, pad_token_id=cfg.model.pad_token_id)
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
        r = cfg.data_parallel_rank(rank)  # ranks of a tensor-parallel group hold the same values
        positions = np.arange(r, r + per_rank * dp, dp)
        keep = positions < n
        full[positions[keep]] = part.cpu().numpy()[keep]
    return full


def reference_of_batch(logps: np.ndarray, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The precomputed log-probabilities (B,) of the instances ``indices`` (host tensor)."""
    return torch.from_numpy(np.asarray(logps[indices.numpy()], dtype=np.float32)).to(device)
