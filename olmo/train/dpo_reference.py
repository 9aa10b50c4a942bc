"""The DPO reference's log-probabilities, computed once before training (``dpo.precompute_reference``).

Every instance's summed log-probability of its labels under the frozen reference goes into
``save_folder/train_data/dpo_reference_logps.npy`` (float32, one per instance, in instance order), written by rank 0
through a temporary file and a rename, with a record beside it (``.json``: the reference, the data files, the number
of instances, the sequence length and the file's crc32). A launch in which every rank finds a matching record and
checksum reads the file without building the reference at all; otherwise the ranks compute the values anew (each
rank then holds all of them; only rank 0 writes the file). The data-parallel ranks split the instances (rank ``r``
of ``D`` takes instances ``r, r + D, ...``), each in micro-batches of ``device_train_microbatch_size``, under the
run's autocast; ranks of a tensor-parallel group compute the same instances together.
"""

from __future__ import annotations

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
from ..util import write_result_file
from ..util.atomic import atomic_file

__all__ = ["REFERENCE_FILE", "precomputed_reference", "reference_of_batch"]

log = logging.getLogger(__name__)

REFERENCE_FILE = "dpo_reference_logps.npy"


def _record(cfg: TrainConfig, dataset: Any) -> dict[str, Any]:
    return {
        "reference": cfg.dpo.reference_path,
        "instances": len(dataset),
        "sequence_length": cfg.model.max_sequence_length,
        "files": [*map(str, dataset.paths), *map(str, dataset.label_mask_paths or [])],
        "dtype": "float32",
    }


def _reusable(path: Path, record: dict[str, Any]) -> bool:
    """Whether ``path`` holds the values ``record`` describes (its record matches, and the file its checksum)."""
    try:
        held = json.loads(path.with_name(path.name + ".json").read_text())
        data = path.read_bytes() if path.stat().st_size == 4 * record["instances"] else None
    except (OSError, ValueError):
        return False
    return data is not None and held == {**record, "crc32": zlib.crc32(data)}


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
