"""scripts/benchmark.py in its smoke mode, and the GPU peak table that its MFU depends on."""

import json
from pathlib import Path

import pytest

from olmo.testing import run_script
from olmo.train.metrics import gpu_peak_flops

REPO = Path(__file__).resolve().parents[2]
PHASES = {"data", "prepare", "forward", "backward", "optimizer", "other"}


def test_smoke_benchmark_reports_consistent_throughput(tmp_path):
    out = tmp_path / "result.json"
    # The tiny config's data glob matches nothing from tmp_path: synthetic data must not need the files.
    result = run_script(
        "benchmark.py", REPO / "configs/tiny/OLMo-tiny.yaml", "--smoke", f"--out={out}", cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {
        "date",
        "command",
        "config",
        "overrides",
        "git",
        "machine",
        "steps",
        "warmup",
        "setup",
        "results",
    } <= set(report)
    setup, r = report["setup"], report["results"]
    assert {
        "world_size",
        "device",
        "data",
        "precision",
        "compile",
        "attention",
        "batch",
        "model",
        "peak_flops",
    } <= set(setup)
    assert setup["attention"]["backend"] == "torch SDPA" and setup["precision"] == "fp32"
    assert setup["batch"] == {
        "device_batch": 4,
        "micro_batch": 2,
        "grad_accum": 2,
        "seq_len": 128,
        "global_batch": 4,
        "device_tokens_per_step": 512,
    }
    assert setup["peak_flops"] > 1e9, "the CPU peak is measured, so it is always known"
    synced = r["synced"]
    assert len(synced["steps"]) == report["steps"] == 3 and len(r["warmup_step_times_s"]) == report["warmup"] == 2
    assert r["tokens_per_second"] > 0 and 0 < r["mfu"] <= 1
    assert r["tokens_per_second"] == pytest.approx(512 / r["step_time_s"])
    assert synced["tokens_per_second"] == pytest.approx(512 / synced["step_time_s"])
    assert set(synced["phases_s"]) == PHASES and all(v >= 0 for v in synced["phases_s"].values())
    assert sum(synced["phases_s"].values()) == pytest.approx(synced["step_time_s"], rel=0.2)
    for step in synced["steps"]:  # each step's phases partition it exactly
        assert sum(step[p] for p in PHASES) == pytest.approx(step["step"], rel=1e-6)
    assert r["peak_memory_mb"] > 0 and 5 < r["first_loss"] < 15  # random tokens: ~ln(50280) = 10.8
    assert "tokens/s per device" in result.stdout


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 5090", None),
    ],
)
def test_gpu_peak_lookup_by_device_name(name, peak):
    # An H200 must not fall through to the A100 figure, which would overstate MFU ~3x.
    assert gpu_peak_flops(name) == peak


def test_smoke_ladder_measures_each_rung_on_the_same_batches(tmp_path):
    out = tmp_path / "ladder"
    result = run_script(
        "benchmark_ladder.py",
        REPO / "configs/tiny/OLMo-tiny.yaml",
        "--smoke",
        "--rungs=eager,fused_loss",
        f"--out-dir={out}",
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    rows = json.loads((out / "ladder.json").read_text())
    assert [r["rung"] for r in rows] == ["eager", "fused_loss"]
    eager, fused = (r["result"]["results"] for r in rows)
    assert "--override=fused_loss=true" in rows[1]["flags"] and "--override=fused_loss=false" in rows[0]["flags"]
    # Same model, same synthetic batches: the fused loss gives the same losses, under the same pinned peak.
    assert fused["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)
    assert rows[1]["result"]["setup"]["peak_flops"] == pytest.approx(
        rows[0]["result"]["setup"]["peak_flops"], rel=1e-5
    )
    markdown = (out / "ladder.md").read_text().splitlines()
    assert markdown[0].startswith("| rung | tokens/s | MFU") and len(markdown) == 4
    assert "| torch SDPA (" in markdown[2]  # the attention column names the kernel that ran
    assert markdown[3].startswith("| + fused loss |") and "%" in markdown[3].split("|")[-3]


def test_loss_benchmark_compares_plain_and_fused_on_the_same_inputs(tmp_path):
    out = tmp_path / "loss.json"
    result = run_script(
        "benchmark_loss.py",
        "--tokens=300",
        "--d-model=32",
        "--vocab=1000",
        "--chunk=64",
        "--repeats=1",
        f"--out={out}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(out.read_text())["results"]
    assert set(r) == {"plain", "fused"}
    assert r["fused"]["mean_ce"] == pytest.approx(r["plain"]["mean_ce"], rel=1e-5)
    assert 6.5 < r["plain"]["mean_ce"] < 7.5  # ~ln(1000) for a near-uniform prediction
    assert all(v["median_seconds"] > 0 for v in r.values())
    assert "| fused |" in result.stdout


def test_out_never_replaces_a_file_that_is_not_a_benchmark_result(tmp_path):
    from olmo.bench.train_step import parse_args
    from olmo.exceptions import OLMoCliError

    config = tmp_path / "config.yaml"
    config.write_text("run_name: x\n")
    with pytest.raises(
        OLMoCliError, match=r"--out=.*config\.yaml cannot be written: it exists and is not an earlier"
    ):
        parse_args([str(config), "--out", str(config)])
    assert config.read_text() == "run_name: x\n"
    earlier = tmp_path / "r.json"
    earlier.write_text(json.dumps({"setup": {}, "results": {}}))
    assert parse_args([str(config), "--out", str(earlier)]).out == str(earlier)


def test_rl_benchmark_times_sampling_with_and_without_the_cache_and_training(tmp_path):
    """scripts/benchmark_rl.py on a tiny config's random model: both ways of sampling draw (nearly) the same tokens
    from the same streams, every part is timed, and the reference's weights are the model's."""
    from olmo.testing import tiny_config_dict, write_config

    config = write_config(tmp_path / "tiny.yaml", tiny_config_dict(tmp_path / "run", ["unused.npy"]))
    out = tmp_path / "rl.json"
    args = ["--groups=1", "--group-size=2", "--prompt-tokens=4", "--new-tokens=3", f"--out={out}"]
    result = run_script("benchmark_rl.py", config, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["sampled_alike_fraction"] > 0.5 and r["kv_cache_speedup"] > 0
    assert all(r[k] > 0 for k in ("rollout_seconds_per_group", "train_seconds_per_group"))
    assert r["reference_weight_bytes"] == 4 * r["params"]  # fp32
    assert "sampling, KV cache" in result.stdout and "training + reference" in result.stdout
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    refused = run_script("benchmark_rl.py", config, f"--out={tmp_path / 'notes.json'}")
    assert refused.returncode != 0 and "--out=" in refused.stderr
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'


def test_synthetic_documents_are_masked_and_the_report_becomes_a_benchmark_row(tmp_path):
    """``--doc-length``: instances cut into documents ending with EOS and carrying their ``doc_lens`` (the cost of
    document masking, issue 55); the report read back as the GPU checks read it gives docs/throughput.md's row."""
    import sys

    import torch

    from olmo.bench.common import RandomTokens
    from olmo.bench.gpu_checks_table import Result, benchmark_table, read_report
    from olmo.data import DataCollator

    tokens = RandomTokens(3, 512, 100, seed=1, doc_length=64, eos_token_id=7)
    for i in range(3):
        item = tokens[i]
        lens, ids = item["doc_lens"], item["input_ids"]
        assert int(lens.sum()) == 512 and bool((lens >= 1).all()) and bool((lens[:-1] >= 32).all())
        ends = lens.cumsum(0) - 1
        assert bool((ids[ends] == 7).all()) and int((ids == 7).sum()) == len(lens)  # EOS at the ends only
        assert torch.equal(tokens[i]["input_ids"], ids)  # instance i is the same on every call
    assert "doc_lens" in DataCollator(pad_token_id=1)([tokens[0], tokens[1]])
    assert "doc_lens" not in RandomTokens(1, 64, 100, seed=1)[0]

    out = tmp_path / "docs.json"
    args = ["--smoke", "--doc-length=32", "--profile", f"--out={out}"]
    result = run_script("benchmark.py", REPO / "configs/tiny/OLMo-tiny.yaml", *args, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "data.generate_doc_lengths=true" in report["overrides"]
    # --profile: 2 more steps under the profiler, their busy time split by kind of work (each op counted once).
    profile = report["profile"]
    assert profile["steps"] == 2 and profile["time"] == "operators' own CPU time"
    assert sum(profile["categories_ms_per_step"].values()) == pytest.approx(profile["busy_ms_per_step"], rel=1e-3)
    assert {"matmul", "attention"} <= set(profile["categories_ms_per_step"])
    assert (
        any(top["name"] == "aten::mm" for top in profile["top"]) and len(report["results"]["synced"]["steps"]) == 3
    )
    command = f"{sys.executable} scripts/benchmark.py configs/tiny/OLMo-tiny.yaml --doc-length 32 --out {out}"
    row = benchmark_table([Result("docs", "documents", "ok", 5.0, read_report(str(out)), command=command)])
    assert "matmul %" in read_report(str(out))  # the GPU checks' table shows the largest shares
    cells = row.splitlines()[2].split(" | ")
    assert (
        cells[0] == "| OLMo-tiny, model.n_layers=2, model.d_model=64"
        and cells[2] == "fp32"
        and cells[3:5] == ["128", "2"]
    )
    assert cells[5] == f"{report['results']['tokens_per_second']:,.0f}" and cells[7].endswith(" GiB")
    assert cells[8] == "`python scripts/benchmark.py configs/tiny/OLMo-tiny.yaml --doc-length 32`"
    assert cells[9].startswith(report["date"][:10] + ", ")
    bad = run_script("benchmark.py", REPO / "configs/tiny/OLMo-tiny.yaml", "--doc-length=0", cwd=tmp_path)
    assert bad.returncode == 2 and "--doc-length must be at least 1" in bad.stderr


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "matmul"),
        ("aten::addmm_", "matmul"),
        ("flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        ("triton_tem_fused_flex_attention_backward_0", "attention"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
        ("triton_red_fused_abs_amax_clamp_0", "float8 casts"),
        ("void multi_tensor_apply_kernel<FusedAdam>", "optimizer"),
        ("Memcpy HtoD (Pinned -> Device)", "copies and indexing"),
        ("triton_poi_fused_add_mul_silu_0", "elementwise, norms and reductions"),
        ("aten::native_layer_norm_backward", "elementwise, norms and reductions"),
        ("_FusedOutputLoss", "other"),
    ],
)
def test_a_profiled_kernel_or_operator_falls_in_its_kind_of_work(name, kind):
    from olmo.bench.profile import category

    assert category(name) == kind
