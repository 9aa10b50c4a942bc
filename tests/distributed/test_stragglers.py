"""Straggler detection (``stability.stragglers``, issue 27) with two gloo ranks under torchrun, one of them really
slowed down: a ``sitecustomize`` on the workers' ``PYTHONPATH`` pins each rank to its own core and, in rank 1, makes
every optimizer step (one of the parts of a step that wait for no other rank) take 0.4 s longer, as a throttled
CPU or a slow device would. The warning must name rank 1 within 50 steps, and the same run without the delay must
name nobody. (The delay sleeps: three spinning threads, used before, slowed every other test on the machine.) The
two runs share one launch (each costs seconds of start-up): the delay applies once the throttled run has written its
``config.yaml``, which the healthy run, trained first, never writes."""

import json
import os
from pathlib import Path

from olmo.testing import tiny_config_dict, write_byte_memmap, write_config
from olmo.testing.train_each import run_torchrun_each

SITECUSTOMIZE = """
import os, threading
rank = int(os.environ.get("RANK", "-1"))
if rank >= 0 and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % 2]})
if rank == 1 and os.environ.get("THROTTLE_RANK_1_WHEN"):
    def _slow_down_the_optimizer():
        import sys, time
        while "olmo.train.stragglers" not in sys.modules:  # the trainer is imported, before its first step
            time.sleep(0.01)
        import torch

        step = torch.optim.AdamW.step
        when = os.environ["THROTTLE_RANK_1_WHEN"]

        def slow_step(self, *args, **kwargs):
            if os.path.exists(when):
                time.sleep(0.4)
            return step(self, *args, **kwargs)

        torch.optim.AdamW.step = slow_step
    threading.Thread(target=_slow_down_the_optimizer, daemon=True, name="throttle").start()
"""


def _config(tmp_path: Path, steps: int) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "a.npy"
    write_byte_memmap(data, 100 * 16 * 64)
    cfg = tiny_config_dict(
        tmp_path / "run",
        [str(data)],
        max_duration=steps,
        global_train_batch_size=16,
        device_train_microbatch_size=8,
        save_interval_unsharded=None,
        console_log_interval=10,
        **{
            "model.d_model": 128,
            "model.n_layers": 3,
            "model.max_sequence_length": 64,
            "stability.stragglers.enabled": True,
            "stability.stragglers.interval": 3,
            # Healthy ranks on a busy 2-core machine (another test beside this one) reach 2.8x at single
            # gatherings; the slowed rank is far above. 4.0 keeps the two apart (CI flaked at 1.5).
            "stability.stragglers.threshold": 4.0,
        },
    )
    return write_config(tmp_path / "c.yaml", cfg)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _outputs(stderr: str) -> list[str]:
    """What the launch wrote while training each of its two runs, in turn: each run ends with its summary."""
    parts = stderr.split("Run summary:")
    assert len(parts) == 3, stderr[-3000:]
    return parts[:2]


def test_a_throttled_rank_is_named_within_50_steps_and_an_unthrottled_run_names_nobody(tmp_path):
    # One launch, the two runs one after the other, so that each run's ranks have the two cores to themselves.
    # 30 steps (10 gatherings) throttled: on a busy 2-core CI machine the first gatherings' ratios can sit near the
    # threshold (one CI run saw no 3 in a row over 15 steps with a 0.2 s delay).
    healthy, throttled = _config(tmp_path / "healthy", steps=27), _config(tmp_path / "throttled", steps=30)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {"PYTHONPATH": path, "THROTTLE_RANK_1_WHEN": str(tmp_path / "throttled/run/config.yaml")}
    result = run_torchrun_each(2, [[healthy], [throttled]], timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    healthy_output, throttled_output = _outputs(result.stderr)

    assert "Straggler:" not in healthy_output, healthy_output[-3000:]
    skews = [r["throughput/rank_skew"] for r in _rows(tmp_path / "healthy/run") if "throughput/rank_skew" in r]
    assert len(skews) == 9 and all(s >= 1.0 for s in skews)  # every 3 steps of 27, on rank 0's lines

    named = [line for line in throttled_output.splitlines() if "Straggler: rank 1" in line]
    assert named, throttled_output[-3000:]
    assert int(named[0].split("steps up to ")[1].split(")")[0]) <= 50, named[0]
    assert "Straggler: rank 0" not in throttled_output
    found = [r for r in _rows(tmp_path / "throttled/run") if "throughput/rank_skew" in r]
    assert sum(r["throughput/slowest_rank"] == 1 for r in found) >= len(found) - 2, found
