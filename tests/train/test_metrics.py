"""The loop's small components alone: the metrics sinks (metrics.jsonl, console), the logger that fans out to
them, the step-metrics queue's reductions, and the stop conditions (last step, signals, time limit)."""

import json
import logging
import os
import signal

import pytest
import torch

from olmo.config import TrainConfig
from olmo.testing import tiny_config_dict
from olmo.train.metrics import ReduceType, StepMetricsQueue
from olmo.train.metrics_sinks import ConsoleSink, JsonlSink, MetricsLogger, SinkOptions
from olmo.train.stop import StopConditions, StopLimits


def _cfg(tmp_path, **overrides):
    return TrainConfig.from_dict(tiny_config_dict(tmp_path / "run", ["x.npy"], **overrides))


def test_jsonl_sink_appends_one_line_per_step_across_launches(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    for step in (1, 2):  # each launch opens the file again and appends
        sink = JsonlSink(path)
        sink.log(step, {"train/CrossEntropyLoss": 5.0 - step}, None)
        sink.close({}, 0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["train/CrossEntropyLoss"]) for r in rows] == [(1, 4.0), (2, 3.0)]
    assert all(isinstance(r["time"], float) for r in rows)


def test_console_sink_shows_training_every_interval_and_evaluations_in_full(caplog):
    now = [100.0]
    sink = ConsoleSink(interval=2, max_steps=4, progress_bar=False, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="olmo.train.metrics_sinks"):
        now[0] += 30  # the first step (compile, warm-up) takes 30 s, the others 5 s each
        for step in range(1, 5):
            sink.log(step, {"train/CrossEntropyLoss": 1.5, "optim/total_grad_norm": 1234.5}, None)
            now[0] += 5
        sink.log(4, {"eval/x/Perplexity": 12.345}, ["eval/x/Perplexity"])
        sink.close({"global step": 4}, 0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [
        "[step=2/4] loss=1.5000 grad_norm=1,234 elapsed=0:00:35 eta=0:00:10",  # the rate after the first step
        "[step=4/4] loss=1.5000 grad_norm=1,234 elapsed=0:00:45 eta=0:00:00",
        "[step=4] eval/x/Perplexity=12.35",
    ]
    assert lines[3] == "Run summary:\n  global step: 4"


def test_metrics_logger_writes_on_rank_zero_only_and_keeps_first_and_last_loss(tmp_path):
    cfg = _cfg(tmp_path, wandb=None)
    sinks = SinkOptions(cfg.save_folder, cfg.console_log_interval)
    other = MetricsLogger(sinks, rank=1, max_steps=3)
    other.log(1, {"train/CrossEntropyLoss": 3.0})
    other.close({})
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and other.first_loss is None
    logger = MetricsLogger(sinks, rank=0, max_steps=3)
    for step, loss in enumerate((3.0, 2.0, 1.0), start=1):
        logger.log(step, {"train/CrossEntropyLoss": loss})
    logger.log(3, {"eval/x/CrossEntropyLoss": 9.0}, console_keys=["eval/x/CrossEntropyLoss"])
    logger.close({"steps": 3})
    assert (logger.first_loss, logger.last["train/CrossEntropyLoss"]) == (3.0, 1.0)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 3]


def test_step_metrics_queue_reduces_recorded_metrics_and_normalizes_the_loss():
    queue = StepMetricsQueue(interval=2, rank=0, z_loss=False)
    extra = {
        "a": (torch.tensor(4.0), ReduceType.mean),
        "b": (torch.tensor(4.0), ReduceType.sum),
        "c": (torch.tensor(4.0), ReduceType.max),
    }
    queue.add(1, 0.5, torch.tensor(6.0), torch.tensor(0.0), torch.tensor(3.0), torch.tensor(1.0), extra)
    assert queue.pop_ready() == []  # still on the device until collected
    queue.collect(1)
    (record,) = queue.pop_ready()
    values = record.values
    assert values["train/CrossEntropyLoss"] == 2.0 and values["optim/learning_rate_group0"] == 0.5
    assert (values["a"], values["b"], values["c"]) == (4.0, 4.0, 4.0)  # one rank: every reduction is the value


def _stop_conditions(cfg: TrainConfig, start: int) -> StopConditions:
    """The stop conditions the trainer builds from ``cfg`` for a run of 10 steps that starts at ``start``."""
    limits = StopLimits(cfg.stop_at, cfg.stop_after, cfg.time_limit)
    return StopConditions(cfg.save_folder, start, 10, limits=limits)


@pytest.mark.parametrize(
    "overrides, start, expected",
    [
        ({"max_duration": 10}, 0, 10),
        ({"max_duration": 10, "stop_at": 6}, 0, 6),
        ({"max_duration": 10, "stop_at": 20}, 0, 10),
        ({"max_duration": 10, "stop_after": 3}, 4, 7),
        ({"max_duration": 10, "stop_at": 6, "stop_after": 3}, 4, 6),
    ],
)
def test_stop_at_is_the_earliest_of_max_duration_stop_at_and_stop_after(tmp_path, overrides, start, expected):
    assert _stop_conditions(_cfg(tmp_path, **overrides), start).stop_at == expected


def test_a_signal_or_the_time_limit_stops_and_handlers_are_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with _stop_conditions(_cfg(tmp_path), 0) as stop:
        assert stop.agree() == (None, True)
        assert stop.agree(writing=True) == (None, False)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agree() == ("SIGTERM", True)
    assert signal.getsignal(signal.SIGTERM) is before
    with _stop_conditions(_cfg(tmp_path, time_limit=0.0), 0) as stop:
        assert stop.agree()[0] == "time_limit"


def test_cpu_peak_memory_is_this_process_not_the_parent_that_started_it():
    """ru_maxrss carries the parent's resident set over into a child it starts; the logged peak must not."""
    import subprocess
    import sys

    parent = bytearray(600 * 2**20)
    parent[::4096] = b"\x01" * len(parent[::4096])  # resident, not just reserved
    code = (
        "import torch; from olmo.train.metrics import peak_memory_mb; print(peak_memory_mb(torch.device('cpu')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert float(out) < 500, out  # torch alone is ~250 MB; the 600 MB parent must not show
    del parent


def test_a_step_that_counts_its_own_tokens_sets_the_throughput(monkeypatch):
    """An RL step trains on its groups, not its batch's padded prompt instances: the throughput counts what the
    train module says it trained on (``step_device_tokens``), step by step."""
    from olmo.train import metrics as metrics_module

    clock = iter([0.0, 2.0, 4.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    counts = iter([100, 300, 500])
    monitor = metrics_module.ThroughputMonitor(
        metrics_module.SpeedMonitor(5, 1, None), lambda: next(counts), torch.device("cpu")
    )
    assert "throughput/device/tokens_per_second" not in monitor.step_metrics(0, None)
    assert monitor.step_metrics(0, None)["throughput/device/tokens_per_second"] == 150.0  # 300 tokens in 2 s
    assert monitor.step_metrics(0, None)["throughput/device/tokens_per_second"] == 200.0  # 800 in 4 s
