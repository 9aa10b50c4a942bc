"""Issue 50: under context (or tensor) parallelism the ranks of a group share data rank 0, yet only one process,
global rank 0, writes ``global_indices.npy``; its peers wait for the file and map the same order."""

import json
import logging
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from olmo.data import IterableDataset
from olmo.data.order_file import OrderSpec, order_in_memory
from olmo.testing import free_port

N, BATCH = 64, 4


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rank_main(rank: int, port: int, world: int, cp: int, folder) -> None:
    """One process of ``world`` with context-parallel degree ``cp``: data rank ``rank // cp`` of ``world // cp``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    recorder = _Recorder()
    logging.getLogger("olmo.data.iterable_dataset").addHandler(recorder)
    logging.getLogger("olmo.data.iterable_dataset").setLevel(logging.INFO)
    try:
        instances = [{"input_ids": torch.tensor([i])} for i in range(N)]
        data = IterableDataset(instances, BATCH, seed=3, world_size=world // cp, rank=rank // cp, work_dir=folder)
        first = data.global_indices().tolist()
        data.reshuffle(1)
        second = data.global_indices().tolist()
        indices = [int(item["index"]) for item in data]
        touched = [line for line in recorder.lines if "data order" in line]
        result = {"touched": touched, "orders": [first, second], "indices": indices}
        (folder / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(world: int, cp: int, folder) -> list[dict]:
    context = mp.start_processes(
        _rank_main, args=(free_port(), world, cp, folder), nprocs=world, join=False, start_method="fork"
    )
    deadline = time.monotonic() + 60
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError("the ranks hung")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def test_one_process_writes_the_order_under_context_parallelism(tmp_path):
    results = _run(2, 2, tmp_path)  # two processes, one data rank (as context_parallel.degree=2 on 2 ranks)
    # Only global rank 0 wrote (or looked at) the order files, for epoch 0 and epoch 1.
    assert [len(r["touched"]) for r in results] == [2, 0], [r["touched"] for r in results]
    assert all("Wrote the data order" in line for line in results[0]["touched"])
    # Both map the same order, OLMo's permutation, and read the same instances (they share data rank 0).
    for epoch in (0, 1):
        expected = order_in_memory(OrderSpec(N, 3, epoch)).tolist()
        assert results[0]["orders"][epoch] == results[1]["orders"][epoch] == expected
    assert results[0]["indices"] == results[1]["indices"]
    assert np.fromfile(tmp_path / "global_indices.npy", dtype=np.uint32).tolist() == results[0]["orders"][0]
    # A relaunch reuses the files: still global rank 0 alone looks at them.
    again = _run(2, 2, tmp_path)
    assert [len(r["touched"]) for r in again] == [2, 0]
    assert all("Reusing the data order" in line for line in again[0]["touched"])
