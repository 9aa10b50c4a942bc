"""MFU is never reported above 1: the CPU peak is measured once per machine and cached; a peak that an MFU
above 1 proves wrong gives no MFU (and a warning), wherever MFU is reported."""

import json
import logging
from pathlib import Path

import pytest
import torch

from olmo.testing import run_main, run_train, tiny_config_dict, write_byte_memmap, write_config
from olmo.train.metrics import PeakFlops, SpeedMonitor, cpu_peak_flops, device_peak_flops, model_flops_utilization

REPO = Path(__file__).resolve().parents[2]
OTHER_MACHINE = "Some Other CPU | 64 CPUs | 64 threads | torch 2.0.0"


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    """A private per-user cache, so the test neither reads nor changes the real one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "olmo-trainer" / "cpu_peak_flops.json"


def _mfu_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("MFU would be")]


def test_cpu_peak_is_measured_once_then_read_from_the_cache(cache_file):
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text("{ half a fil")  # an unreadable cache is measured over, never a crash
    first = cpu_peak_flops()
    assert first.flops > 1e8 and first.cache_file == cache_file and str(cache_file) in first.source
    entries = json.loads(cache_file.read_text())
    assert list(entries) == [first.cache_key] and entries[first.cache_key]["peak_flops"] == first.flops
    assert [p.name for p in cache_file.parent.iterdir()] == [cache_file.name]  # no temporary file left behind
    assert f"{torch.get_num_threads()} threads | torch {torch.__version__}" in first.cache_key

    # A figure no measurement would give: seeing it back proves the second call read the file.
    entries[first.cache_key].update(peak_flops=1.25e9, cpu_share=1.0)
    cache_file.write_text(json.dumps(entries))
    peak = device_peak_flops(torch.device("cpu"))
    assert peak is not None and peak.flops == 1.25e9
    assert json.loads(cache_file.read_text()) == entries  # a cache hit writes nothing


def test_a_peak_measured_on_a_busy_machine_is_measured_again_when_it_is_idle(cache_file, monkeypatch):
    import olmo.model.flops as flops

    monkeypatch.setattr(flops, "_machine_idle", lambda: False)  # the load average of a machine at work
    key = cpu_peak_flops().cache_key
    entries = json.loads(cache_file.read_text())
    assert entries[key]["idle"] is False
    entries[key].update(peak_flops=1.25e3, cpu_share=1.0)  # slowed by the other work, yet all threads ran
    cache_file.write_text(json.dumps(entries))
    assert cpu_peak_flops().flops == 1.25e3  # still busy: the provisional figure serves
    monkeypatch.setattr(flops, "_machine_idle", lambda: True)
    again = cpu_peak_flops()
    assert again.flops > 1e8  # measured again, idle this time, and kept
    assert json.loads(cache_file.read_text())[key]["idle"] is True


def test_mfu_above_one_is_never_reported():
    table_peak = PeakFlops(989e12, "the dense bf16 peak of NVIDIA H100 80GB HBM3", "Fix the FLOP count.")
    assert model_flops_utilization(494.5e12, table_peak) == pytest.approx(0.5)
    assert model_flops_utilization(1e15, table_peak) is None
    assert model_flops_utilization(1e15, None) is None


def test_only_a_settled_window_proves_the_peak_wrong(caplog):
    """On a GPU the host's clock runs ahead of the device until metrics are read back: a window ending at a step
    the device had not finished may look faster than the peak. Its MFU is dropped without a warning; a settled one
    (a CPU step, or a GPU step whose metrics were read back) warns, once."""
    peak = PeakFlops(1.0, "a peak far too low", "Set speed_monitor.gpu_flops_available.")
    monitor = SpeedMonitor(window_size=20, flops_per_token=10**6, peak_flops=peak)
    with caplog.at_level(logging.WARNING):
        unsettled = [monitor.step(1024, settled=False) for _ in range(4)]
        assert _mfu_warnings(caplog) == []
        settled = [monitor.step(1024, settled=True) for _ in range(3)]
    assert all(r["throughput/device/tokens_per_second"] > 0 for r in unsettled[1:] + settled)
    assert not any("throughput/mfu" in r for r in unsettled + settled)
    (warning,) = _mfu_warnings(caplog)
    assert "a peak far too low" in warning and "speed_monitor.gpu_flops_available" in warning


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "a.npy"
    write_byte_memmap(path, 30_000)
    return [str(path)]


@pytest.mark.parametrize("forced", ["pinned", "cached"])
def test_training_with_a_too_low_peak_reports_no_mfu(tmp_path, corpus, cache_file, caplog, forced):
    args = []
    if forced == "pinned":
        args.append("--speed_monitor.gpu_flops_available=1000")
    else:  # a cached measurement far too low, next to another machine's entry
        key = cpu_peak_flops().cache_key
        cache_file.write_text(
            json.dumps({key: {"peak_flops": 1000.0, "cpu_share": 1.0}, OTHER_MACHINE: {"peak_flops": 1e12}})
        )
    config = write_config(
        tmp_path / "c.yaml",
        tiny_config_dict(tmp_path / "run", corpus, max_duration=6, save_interval_unsharded=None),
    )
    record: list = []
    with caplog.at_level(logging.WARNING):
        assert run_train(config, *args, record=record) == 0

    steps = [r for r in record if "train/CrossEntropyLoss" in r]
    assert len(steps) == 6 and all("throughput/device/tokens_per_second" in r for r in steps[1:])
    assert not any("throughput/mfu" in r for r in record)
    lines = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and not any("throughput/mfu" in line for line in lines)
    (warning,) = _mfu_warnings(caplog)  # once a run, not once a step
    if forced == "pinned":
        assert "speed_monitor.gpu_flops_available" in warning
    else:
        assert str(cache_file) in warning
        # Proven too low, the entry is dropped so that the next run measures again; other machines' stay.
        assert json.loads(cache_file.read_text()) == {OTHER_MACHINE: {"peak_flops": 1e12}}


def test_benchmark_with_a_too_low_peak_reports_null_mfu(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "result.json"
    with caplog.at_level(logging.WARNING):
        code = run_main(
            "benchmark.py",
            REPO / "configs/tiny/OLMo-tiny.yaml",
            "--smoke",
            "--steps=2",
            "--warmup=0",
            "--override=speed_monitor.gpu_flops_available=1000",
            f"--out={out}",
        )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["results"]["mfu"] is None and report["results"]["tokens_per_second"] > 0
    assert report["setup"]["peak_flops"] == 1000 and report["setup"]["peak_flops_source"].startswith(
        "speed_monitor"
    )
    assert len(_mfu_warnings(caplog)) == 1
