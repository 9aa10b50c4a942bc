"""scripts/benchmark_inspect.py on a few files: every lookup is timed and answers with documents."""

import json

from olmo.testing import run_script


def test_smoke_benchmark_times_lookups_with_documents(tmp_path):
    out = tmp_path / "result.json"
    result = run_script(
        "benchmark_inspect.py",
        "--files=12",
        "--instances-per-file=8",
        "--seq-len=64",
        "--docs-per-file=5",
        "--lookups=3",
        f"--folder={tmp_path}",
        f"--out={out}",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    r = report["results"]
    assert r["lookups"] == 3 and 0 < r["lookup_s_median"] <= r["lookup_s_max"] and r["command_s"] > 0
    assert r["instances_per_lookup"] == 8 and r["documents_per_instance"] >= 1
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # the scratch files are gone
