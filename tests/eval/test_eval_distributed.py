"""Evaluation on 2 gloo ranks with an FSDP2-sharded model equals evaluation in one process.

The ranks get different numbers of batches (so a rank that stopped early would hang the other inside
FSDP's all-gather) and the metrics must come out identical on both ranks.
"""

import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from olmo.config import TrainConfig
from olmo.distributed import DistEnv, ParallelizeOptions, ParallelLayout, build_model
from olmo.eval import DownstreamEvaluator, LMEvaluator
from olmo.model import OLMo
from olmo.testing import free_port, tiny_config_dict, write_byte_memmap

CPU = torch.device("cpu")
WORLD_SIZE = 2


def _rank_main(rank, port, jobs, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        env = DistEnv(device=CPU, rank=rank, local_rank=rank, world_size=WORLD_SIZE)
        results = {}
        for name, (cfg, state_dict, make_evaluator) in jobs.items():
            # FSDP2, one unit per block plus the root
            model = build_model(
                cfg.model, ParallelLayout.of_run(cfg, env), ParallelizeOptions.from_train_config(cfg)
            )
            set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))
            results[name] = make_evaluator(rank).evaluate(model, CPU)
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _run_ranks(jobs, out_dir, timeout: float = 30.0) -> list[dict]:
    """Run :func:`_rank_main` in 2 forked processes (the jobs need no pickling); fail on a hang."""
    context = mp.start_processes(
        _rank_main, args=(free_port(), jobs, out_dir), nprocs=WORLD_SIZE, join=False, start_method="fork"
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"evaluation on {WORLD_SIZE} ranks did not finish within {timeout} s (a rank hung)")
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


def test_fsdp_two_ranks_with_uneven_batches_match_one_process(
    tmp_path, load_task, task_model, first_docs, downstream_config, evaluators_of
):
    # LM: 5 instances in batches of 2 -> rank 0 makes 2 forward passes, rank 1 only 1.
    write_byte_memmap(tmp_path / "val.npy", 5 * 32)
    lm_cfg = TrainConfig.from_dict(
        tiny_config_dict(
            tmp_path / "run",
            [str(tmp_path / "val.npy")],
            evaluators=[{"label": "val", "data": {"paths": [str(tmp_path / "val.npy")]}}],
            device_eval_batch_size=2,
        )
    )
    torch.manual_seed(0)
    lm_model = OLMo(lm_cfg.model)
    lm_evaluator = evaluators_of(lm_cfg)[0]
    assert isinstance(lm_evaluator, LMEvaluator)

    # Downstream: 5 two-choice questions in batches of 4 samples -> 2 passes on rank 0, 1 on rank 1.
    task = first_docs(load_task("copa"), 5)
    jobs = {
        "lm": (
            lm_cfg,
            lm_model.state_dict(),
            lambda rank: evaluators_of(lm_cfg, world_size=WORLD_SIZE, rank=rank)[0],
        ),
        "copa": (
            downstream_config(),
            task_model.state_dict(),
            lambda rank: DownstreamEvaluator("copa", task, batch_size=4, world_size=WORLD_SIZE, rank=rank),
        ),
    }
    expected = {
        "lm": lm_evaluator.evaluate(lm_model, CPU),
        "copa": DownstreamEvaluator("copa", task, batch_size=4).evaluate(task_model, CPU),
    }

    ranks = _run_ranks(jobs, tmp_path)

    assert ranks[0] == ranks[1]
    for name, metrics in expected.items():
        assert ranks[0][name] == pytest.approx(metrics, rel=1e-5)
