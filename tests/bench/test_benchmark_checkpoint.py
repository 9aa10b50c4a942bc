"""scripts/benchmark_checkpoint.py in its quick smoke mode: every measurement is made and recorded."""

import json

from olmo.testing import run_script


def test_smoke_benchmark_measures_every_kind_and_cleans_up(tmp_path):
    out, folder = tmp_path / "results.json", tmp_path / "scratch"
    folder.mkdir()
    result = run_script(
        "benchmark_checkpoint.py", "--smoke", "--repeats=1", f"--out={out}", f"--folder={folder}", timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {
        "save sharded",
        "load sharded",
        "write sharded",
        "save unsharded",
        "load unsharded",
        "write unsharded",
        "async blocking",
        "async total",
        "async reused blocking",
        "async reused total",
        "raw write",
    }
    for row in report["results"].values():
        assert row["median_s"] > 0 and row["gb_per_s"] > 0 and len(row["runs_s"]) == 1
    sizes = report["state_bytes"]
    # After one step AdamW holds two moments per parameter: the optimizer state is ~2x the weights.
    assert 1.99 < sizes["optimizer"] / sizes["model"] < 2.01
    assert report["checkpoint_bytes_on_disk"]["unsharded"] > sizes["total"]
    assert report["machine"]["cpu_count"] and report["command"].endswith(f"--folder={folder}")
    assert list(folder.iterdir()) == [], "the benchmark must delete its checkpoints"
    assert "sync save, sharded (DCP)" in result.stdout
