"""scripts/benchmark_experts.py at toy sizes: it checks the grouped and the loop variants agree, times all three and
writes its JSON; bad sizes are refused naming the flag."""

import json

from olmo.testing import run_script


def test_the_layer_benchmark_times_three_variants_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    args = [
        "--tokens=64",
        "--d-model=32",
        "--experts=4",
        "--top-k=2",
        "--hidden=16",
        "--repeats=2",
        f"--out={out}",
    ]
    result = run_script("benchmark_experts.py", *args, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["seconds"]) == {"dense", "grouped", "loop"} and all(
        s > 0 for s in report["seconds"].values()
    )
    assert report["grouped_kernel"] is True and report["precision"] == "fp32"  # fp32 on a CPU: the kernel runs
    assert "x dense" in result.stdout


def test_a_top_k_above_the_experts_is_refused_naming_the_flag():
    result = run_script("benchmark_experts.py", "--experts=2", "--top-k=3", timeout=60)
    assert result.returncode == 2 and "--top-k=3 must not exceed --experts=2" in result.stderr
