"""scripts/benchmark_dataloader.py on a tiny corpus: every loader is measured, recorded and cleaned up."""

import json

from olmo.testing import run_script


def test_smoke_benchmark_measures_each_loader_and_cleans_up(tmp_path):
    out, folder = tmp_path / "result.json", tmp_path / "scratch"
    folder.mkdir()
    result = run_script(
        "benchmark_dataloader.py",
        "--steps=20",
        "--warmup=2",
        "--repeats=2",
        "--workers=0,1",
        "--batch=2",
        "--seq-len=64",
        "--corpus-tokens=100000",
        f"--folder={folder}",
        f"--out={out}",
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"loader, 0 workers", "loader, 1 workers", "numpy gather"}
    for row in report["results"].values():
        assert row["tokens_per_s"] > 0 and row["batches_per_s"] > 0 and len(row["runs_tokens_per_s"]) == 2
        assert 0 < row["batch_ms_median"] <= row["batch_ms_p99"]
        # tokens/s and batches/s describe the same runs: batches of 2 x 64 tokens.
        assert abs(row["tokens_per_s"] - 128 * row["batches_per_s"]) <= 128
    assert report["settings"]["batch"] == 2 and report["settings"]["seq_len"] == 64
    assert report["goal_tokens_per_s"] == 50e6
    assert report["machine"]["cpu_count"] and report["command"].endswith(f"--out={out}")
    assert list(folder.iterdir()) == [], "the benchmark must delete its corpus"
    assert "loader, 0 workers" in result.stdout
