"""scripts/benchmark_experts.py at toy sizes: it checks the grouped and the loop variants agree, times them, the dense
MLP and the grouped multiplies alone (eager and compiled) and writes its JSON, which the GPU checks' table reads; bad
sizes are refused naming the flag."""

import json

import pytest

from olmo.bench.gpu_checks_table import report_numbers
from olmo.testing import run_script


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_layer_benchmark_times_its_variants_and_writes_json(tmp_path, compiled):
    out = tmp_path / "r.json"
    args = [
        "--tokens=64",
        "--d-model=32",
        "--experts=4",
        "--top-k=2",
        "--hidden=16",
        "--repeats=2",
        f"--out={out}",
        *(["--compile"] if compiled else []),
    ]
    result = run_script("benchmark_experts.py", *args, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    # Compiled, the grouped kernel traces in bf16 only: on a CPU (fp32) the multiplies alone are left out.
    variants = {"dense", "grouped", "loop"} | (set() if compiled else {"experts"})
    assert set(report["seconds"]) == variants and all(s > 0 for s in report["seconds"].values())
    assert report["grouped_kernel"] is True and report["precision"] == "fp32"  # fp32 on a CPU: the kernel runs
    assert report["compiled"] is compiled and "x dense" in result.stdout
    numbers = report_numbers(report)  # what gpu_checks' table shows of it: each variant over the dense MLP
    assert set(numbers) == {f"{v}/dense" for v in variants - {"dense"}}
    assert numbers["grouped/dense"] == pytest.approx(report["grouped_over_dense"], abs=1e-3)


def test_a_top_k_above_the_experts_is_refused_naming_the_flag():
    result = run_script("benchmark_experts.py", "--experts=2", "--top-k=3", timeout=60)
    assert result.returncode == 2 and "--top-k=3 must not exceed --experts=2" in result.stderr
