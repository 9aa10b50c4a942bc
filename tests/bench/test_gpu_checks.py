"""The GPU checks' own logic on the CPU (scripts/gpu_checks.py): the wheel folder's check, the trimmed original
wheel, each part's time limit and failure kept to itself, and a whole run that installs, skips what needs a GPU and
writes the table. The wheels here are real (zip files pip installs) but hold only their metadata."""

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from olmo.bench import gpu_checks
from olmo.bench.gpu_checks import Part, markdown_table, run_part
from olmo.bench.gpu_wheels import ORIGINAL, ORIGINAL_WHEEL, OURS, check_wheels, trim_wheel
from olmo.testing import run_script
from olmo.testing.processes import alive


def _wheel(folder, name, version, tag="py3-none-any", files=None):
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = folder / f"{dist}-{version}-{tag}.whl"
    contents = {
        **(files or {}),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for member, text in contents.items():
            z.writestr(member, text)
        z.writestr(f"{info}/RECORD", "\n".join(f"{m},," for m in [*contents, f"{info}/RECORD"]) + "\n")
    return path


def _folder(tmp_path):
    folder = tmp_path / "wheels"
    (folder / "original").mkdir(parents=True)
    for spec in (*OURS, *ORIGINAL):
        _wheel(folder, *spec.split("=="))
    _wheel(folder / "original", *ORIGINAL_WHEEL.split("=="))
    return folder


def test_a_gathered_folder_is_ready_and_every_flaw_is_named(tmp_path):
    folder = _folder(tmp_path)
    assert check_wheels(folder, "3.12") == []
    (folder / "boto3-1.44.8-py3-none-any.whl").unlink()
    (folder / "torchao-0.18.0-py3-none-any.whl").write_bytes(b"not a zip")
    _wheel(folder, "dill", "0.3.8")
    _wheel(folder, "numpy", "2.0.0", tag="cp311-cp311-manylinux_2_17_x86_64")
    problems = [str(p) for p in check_wheels(folder, "3.12")]
    assert any(p.startswith("boto3==1.44.8: missing") for p in problems), problems
    assert any("torchao-0.18.0-py3-none-any.whl: is not a readable wheel" in p for p in problems), problems
    assert any(p.startswith("dill: 2 versions") for p in problems), problems
    assert any("does not fit CPython 3.12" in p for p in problems), problems
    assert [str(p) for p in check_wheels(tmp_path / "absent")] == [
        f"{tmp_path / 'absent'}: no such folder: run `make gpu-wheels` here first"
    ]


def test_the_dry_run_lists_every_part_with_its_command_and_limit(tmp_path):
    result = run_script("gpu_checks.py", "--dry-run", "--wheels", str(_folder(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "for Python 3.12: ready" in result.stdout
    parts = ("gpu-tests", "1b-bf16", "1b-float8-tensorwise", "300m-float8-rowwise", "original-olmo")
    for name in (*parts, "linear-attention-kernels", "experts-layer", "olmoe-4-layers", "documents-8192-flex"):
        assert f"  {name} (" in result.stdout
    # Issue 55's parts run first: the windows, documents and the expert layer before float8 and the rest.
    listed = [line for line in result.stdout.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    order = [line.split(" (")[0].strip() for line in listed if " (" in line]
    assert order[:7] == [
        "environment",
        "windows-8192-full",
        "windows-8192-flex",
        "documents-8192-flex",
        "experts-layer",
        "experts-layer-compiled",
        "olmoe-4-layers",
    ]
    assert "scripts/benchmark_experts.py --tokens 16384 --d-model 2048 --experts 64 --top-k 8" in result.stdout
    # On a one-GPU machine the two-process parts are skipped before they start (NCCL refuses two ranks on one GPU).
    one_gpu = {p.name: p for p in gpu_checks.parts(tmp_path, "python", False, cuda=True, gpus=1)}
    for name in ("fsdp-2-processes", "pipeline-2-processes"):
        assert "Duplicate GPU detected" in (one_gpu[name].skip_reason or "")
    assert one_gpu["windows-8192-flex"].skip_reason is None
    assert "model.float8.recipe=rowwise" in result.stdout
    assert "scripts/benchmark_linear_attention.py --seq 2048 8192" in result.stdout
    assert "skipped: no flash-attn wheel" in result.stdout
    broken = run_script("gpu_checks.py", "--dry-run", "--wheels", str(tmp_path / "absent"))
    assert broken.returncode == 1 and "NOT ready" in broken.stdout
    unknown = run_script("gpu_checks.py", "--dry-run", "--only", "1b-bf16,nope")
    assert unknown.returncode == 2 and "--only names unknown parts ['nope']" in unknown.stdout


def test_the_original_wheel_is_trimmed_to_its_code_and_still_installs(tmp_path):
    code = {"olmo/__init__.py": "NAME = 'original'\n", "olmo_data/__init__.py": "", "olmo_data/data.py": ""}
    data = {"olmo_data/hf_datasets/big.arrow": "x" * 10_000}
    source = _wheel(tmp_path, "ai2-olmo", "0.6.0", files={**code, **data})
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / source.name
    trim_wheel(source, target, ("olmo/", "olmo_data/__init__.py", "olmo_data/data.py"))
    names = zipfile.ZipFile(target).namelist()
    assert "olmo/__init__.py" in names and not any("hf_datasets" in n for n in names)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
    subprocess.run([*pip, str(target)], check=True, timeout=120)
    assert (site / "olmo" / "__init__.py").read_text() == "NAME = 'original'\n"


def test_a_part_that_hangs_is_stopped_at_its_limit_with_all_it_started_and_a_failure_names_its_error(
    tmp_path, monkeypatch
):
    # Like torchrun: the command starts a worker in a session of its own, which a signal to its group never reaches.
    agent = (
        "import subprocess, sys, time; "
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
        "print(w.pid, flush=True); time.sleep(120)"
    )
    monkeypatch.setattr(gpu_checks, "GRACE_S", 1.0)
    start = time.monotonic()
    hung = run_part(Part("hang", "sleeps", [[sys.executable, "-c", agent]], 3), {}, 3)
    assert hung.status == "timeout" and time.monotonic() - start < 30
    worker = int(hung.tail.split()[0])
    assert not alive(worker), "the worker outlived its part"
    failing = [sys.executable, "-c", "raise ValueError('the wheel is wrong')"]
    failed = run_part(Part("fail", "raises", [failing, ["true"]], 30), {}, 30)
    assert failed.status == "failed" and failed.note == "ValueError: the wheel is wrong"
    report = tmp_path / "r.json"
    writer = [
        sys.executable,
        "-c",
        f'open({str(report)!r}, \'w\').write(\'{{"results": {{"tokens_per_second": 1234.5, "mfu": 0.5}}}}\')',
    ]
    ok = run_part(Part("ok", "writes", [writer], 30, report=str(report)), {}, 30)
    assert ok.status == "ok" and ok.numbers == {"tokens_per_second": 1234.5, "mfu": 0.5}
    table = markdown_table([hung, failed, ok])
    assert "| hang | sleeps | timeout |" in table and "| ok | writes | ok |" in table and "1,234 | 50.0%" in table


def test_a_run_without_a_gpu_installs_skips_the_gpu_parts_and_writes_the_table(tmp_path):
    out = tmp_path / "out"
    args = ["--wheels", str(_folder(tmp_path)), "--out", str(out), "--only", "environment,gpu-tests,1b-bf16"]
    assert gpu_checks.main(args) == 0
    rows = {r["name"]: r for r in json.loads((out / "gpu_checks.json").read_text())}
    assert rows["install"]["status"] == "ok"
    assert rows["environment"]["status"] == "ok" and rows["environment"]["numbers"]["gpu"] is None
    assert rows["gpu-tests"]["status"] == rows["1b-bf16"]["status"] == "skipped"
    assert rows["1b-bf16"]["note"] == "no CUDA device"
    assert (out / "gpu_checks.md").read_text().startswith("| part | what | status |")
    assert (out / "benchmarks.md").read_text().startswith("| model | GPU | precision |")  # no row ran: the head
    # Its rows paste under docs/throughput.md's "Benchmarks" head, which is the same line.
    docs = (Path(__file__).resolve().parents[2] / "docs" / "throughput.md").read_text()
    assert (out / "benchmarks.md").read_text().splitlines()[0] in docs.split("## Benchmarks")[1]
    # No budget left: the parts are reported as not run, and the run still ends with its table.
    assert gpu_checks.main([*args[:4], "--only", "environment", "--budget", "0"]) == 0
    rows = {r["name"]: r for r in json.loads((out / "gpu_checks.json").read_text())}
    assert rows["environment"]["status"] == "not run"
    # An --out that cannot be written stops the command before it installs or runs anything.
    (tmp_path / "file").write_text("")
    assert gpu_checks.main([*args[:3], str(tmp_path / "file" / "out")]) == 2


def test_the_benchmark_rows_are_written_only_over_an_earlier_table(tmp_path):
    """``benchmarks.md`` joins the files ``--out`` may hold: an earlier table is written over; a link (the write
    would follow it) or a file of other content stops the command before it starts, naming the file."""
    from olmo.bench.gpu_checks_table import Result, out_problem, write_tables

    out = tmp_path / "out"
    write_tables(out, [Result("environment", "probe", "ok")])
    assert out_problem(out) is None
    (out / "benchmarks.md").write_text("my notes\n")
    assert "holds a benchmarks.md that is not an earlier result" in (out_problem(out) or "")
    (out / "benchmarks.md").unlink()
    (out / "benchmarks.md").symlink_to(tmp_path / "elsewhere.md")
    assert "holds benchmarks.md as a symlink" in (out_problem(out) or "")
