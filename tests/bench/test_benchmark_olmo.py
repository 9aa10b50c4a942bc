"""scripts/benchmark_olmo.py without the original's virtualenv (CI has none): ``--ours-only`` runs our worker
through the whole protocol and writes the report; ``--help`` works."""

import json
import math
from pathlib import Path

import pytest

from olmo.bench import olmo as benchmark_olmo
from olmo.testing import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/benchmark_olmo.py"


def test_ours_only_run_writes_the_report(tmp_path):
    out = tmp_path / "result.json"
    tiny = ["--d-model=32", "--n-layers=1", "--vocab=256", "--seq=16", "--batch=2"]
    timing = ["--rounds=2", "--iters=1", "--warmup=1", "--threads=1", "--device=cpu"]
    result = run_script(SCRIPT.name, "--ours-only", *tiny, *timing, f"--json={out}", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = {"date", "command", "machine", "setup", "implementations", "bit_identity", "results", "markdown"}
    assert expected <= set(report)
    assert report["bit_identity"] is None, "nothing to compare against without the original"
    assert set(report["implementations"]) == {"ours"} and report["implementations"]["ours"]["threads"] == 1
    assert report["setup"]["model"]["d_model"] == 32 and report["setup"]["model"]["embedding_size"] == 256
    for mode in ("a", "b"):
        r = report["results"][mode]
        assert set(r) == {"ours"}, "no original side and no ratio"
        ours = r["ours"]
        assert len(ours["rounds_s"]) == 2 and 0 < ours["min_s"] <= ours["median_s"]
        assert ours["tokens_per_s"] == pytest.approx(2 * 16 / ours["median_s"])
        assert len(ours["loss_after_round"]) == 2 and all(math.isfinite(x) for x in ours["loss_after_round"])
        assert f"| ({mode}) " in report["markdown"]
    a = report["results"]["a"]["ours"]["loss_after_round"]
    assert a[0] == a[1], "(a) repeats one batch and never steps the optimizer"


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark_olmo.main(["--help"])
    assert exit_info.value.code == 0
    assert "--ours-only" in capsys.readouterr().out
