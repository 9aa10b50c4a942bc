"""The GPU checks' parts (:mod:`olmo.bench.gpu_checks` runs them): each check's commands, its time limit and
whether it needs a GPU, in the order they run, most important first. Standard library only, as the command is."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["Part", "parts", "LADDER"]

BENCH = [sys.executable, "scripts/benchmark.py"]
LADDER = {"300m": ("configs/official/OLMo-300M.yaml", 16), "1b": ("configs/official/OLMo-1B.yaml", 8)}
"""Config and micro-batch of each ladder model: the sizes that gave the best bf16 tokens/s per memory on the H200
(RESEARCH_LOG 2026-11-26); the same micro-batch for bf16 and float8, as the float8 goal is stated."""


@dataclass
class Part:
    """One check: its commands (run in order in the checkout), the time they may take together, and whether it
    needs a GPU."""

    name: str
    what: str
    commands: list[list[str]]
    limit_s: float
    needs_cuda: bool = True
    report: Optional[str] = None
    """A JSON file the last command writes (a benchmark report), read back for the table's numbers."""
    skip_reason: Optional[str] = None
    """Why the part is left out before it starts (set when the machine lacks what it needs)."""


def _bench(name: str, model: str, float8: Optional[str], work: Path, extra: tuple[str, ...] = ()) -> Part:
    """``benchmark.py`` on a ladder model (``--profile`` in ``extra``: where its time goes, too)."""
    config, micro = LADDER[model]
    out = work / f"{name}.json"
    cmd = [*BENCH, config, "--data", "synthetic", "--steps", "10", "--warmup", "3", "--precision", "amp_bf16"]
    cmd += f"--compile --batch {micro} --micro-batch {micro} --override metrics_collect_interval=10".split()
    if float8:
        cmd += ["--override", "model.float8.enabled=true", "--override", f"model.float8.recipe={float8}"]
    what = f"OLMo-{model.upper()} bf16 compiled, micro-batch {micro}" + (f", float8 {float8}" if float8 else "")
    shown = [e for e in extra if e.startswith("model.")] + (["profiled"] if "--profile" in extra else [])
    return Part(
        name,
        what + "".join(f", {e}" for e in shown),
        [cmd + list(extra) + ["--out", str(out)]],
        75,
        report=str(out),
    )


def parts(work: Path, original_python: str, flash_attn: bool, cuda: bool = True, gpus: int = 2) -> list[Part]:
    """The checks in the order they run (most important first), with the limit of each. Without ``cuda`` the
    comparison with the original runs a small model on the CPU (the other parts need the GPU). With one GPU the
    two-process parts are skipped before they start: NCCL refuses two ranks on one GPU ("Duplicate GPU detected",
    since NCCL 2.5), so they would spend a minute of a lease to fail."""
    env_probe = (
        "import json, platform, torch; d = torch.cuda.is_available(); "
        "info = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'gpu': torch.cuda.get_device_name() if d else None, "
        "'capability': list(torch.cuda.get_device_capability()) if d else None}\n"
        "for m in ('torchao', 'flash_attn', 'fla', 'triton', 'omegaconf'):\n"
        "    try: info[m] = __import__(m).__version__\n"
        "    except Exception as e: info[m] = f'not importable ({type(e).__name__})'\n"
        "print(json.dumps(info))"
    )
    ladder = [
        _bench("1b-bf16", "1b", None, work, ("--profile",)),
        _bench("1b-float8-tensorwise", "1b", "tensorwise", work, ("--profile",)),
        _bench("300m-bf16", "300m", None, work),
        _bench("300m-float8-tensorwise", "300m", "tensorwise", work),
    ]
    size = "--d-model 2048 --n-layers 8 --seq 2048 --batch 4 --rounds 4 --iters 3".split()
    if not cuda:
        size = "--d-model 128 --n-layers 2 --seq 64 --batch 2 --rounds 1 --iters 1".split()
    device = ["--device", "cuda", "--dtype", "bf16"] if cuda else ["--device", "cpu", "--threads", "1"]
    original = Part(
        "original-olmo",
        "against ai2-olmo 0.6.0, same weights: "
        + ("OLMo-1B's shape, 8 layers, bf16" if cuda else "a small model"),
        [
            [sys.executable, "scripts/benchmark_olmo.py", *device, *size, "--warmup", "1"]
            + ["--olmo-python", original_python, "--json", str(work / "original-olmo.json")]
        ],
        90,
        needs_cuda=False,
        report=str(work / "original-olmo.json"),
    )
    fsdp = Part(
        "fsdp-2-processes",
        "torchrun --nproc_per_node=2 on two GPUs: FSDP over NCCL, float8 weights all-gathered in float8",
        [
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "scripts/benchmark.py"]
            + ["configs/official/OLMo-300M.yaml", "--data", "synthetic", "--steps", "5", "--warmup", "2"]
            + ["--precision", "amp_bf16", "--batch", "4", "--micro-batch", "4", "--out", str(work / "fsdp.json")]
            + ["--override", "model.float8.enabled=true", "--override", "distributed_strategy=fsdp"]
        ],
        60,
        report=str(work / "fsdp.json"),
    )
    windows = []
    for name, extra, what in (
        ("windows-8192-full", [], "full attention"),
        (
            "windows-8192-flex",
            ["--override", "model.sliding_window.pattern=[4096,4096,4096,-1]", "--profile"],
            "OLMo 3's windows (4,096) on FlexAttention, profiled",
        ),
        (
            "documents-8192-flex",
            ["--doc-length", "2048", "--profile"],
            "documents of 1,024-3,072 tokens masked, on FlexAttention, profiled",
        ),
        (
            "windows-8192-sdpa",
            ["--override", "model.sliding_window.pattern=[4096,4096,4096,-1]"]
            + ["--override", "model.attention_backend=sdpa"],
            "OLMo 3's windows (4,096) in an SDPA mask",
        ),
    ):
        out = work / f"{name}.json"
        windows.append(
            Part(
                name,
                "OLMo-300M at 8,192 tokens, bf16 compiled, micro-batch 4: " + what,
                [
                    [*BENCH, "configs/official/OLMo-300M.yaml", "--data", "synthetic", "--steps", "10"]
                    + ["--warmup", "3", "--precision", "amp_bf16", "--compile", "--seq-len", "8192"]
                    + ["--batch", "4", "--micro-batch", "4", *extra, "--out", str(out)]
                ],
                90,
                report=str(out),
            )
        )
    pipeline = Part(
        "pipeline-2-processes",
        "torchrun --nproc_per_node=2: OLMo-300M as a 2-stage 1F1B pipeline over NCCL (issue 54), 8 micro-batches",
        [
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "scripts/benchmark.py"]
            + ["configs/official/OLMo-300M.yaml", "--data", "synthetic", "--steps", "5", "--warmup", "2"]
            + [
                "--precision",
                "amp_bf16",
                "--batch",
                "8",
                "--micro-batch",
                "1",
                "--out",
                str(work / "pipeline.json"),
            ]
            + ["--override", "pipeline_parallel.degree=2", "--override", "model.weight_tying=false"]
            + ["--override", "evaluators=[]"]
        ],
        60,
        report=str(work / "pipeline.json"),
    )
    rowwise = [
        _bench("1b-float8-rowwise", "1b", "rowwise", work),
        _bench("300m-float8-rowwise", "300m", "rowwise", work),
    ]
    experts = []
    for name, extra in (("experts-layer", []), ("experts-layer-compiled", ["--compile"])):
        out = work / f"{name}.json"
        shape = "--tokens 16384 --d-model 2048 --experts 64 --top-k 8 --hidden 1024 --precision bf16 --repeats 5"
        experts.append(
            Part(
                name,
                "OLMoE-1B-7B's expert layer, 2 x 8,192 tokens, bf16 weights held (as FSDP hands them)"
                + (", compiled" if extra else ", eager")
                + ": the grouped layer, the loop and the grouped multiplies alone, each over the dense MLP of "
                "equal active width",
                [[sys.executable, "scripts/benchmark_experts.py", *shape.split(), *extra, "--out", str(out)]],
                90 if extra else 60,
                report=str(out),
            )
        )
    olmoe_out = work / "olmoe-4-layers.json"
    olmoe = Part(
        "olmoe-4-layers",
        "OLMoE-1B-7B with 4 layers, 4 x 4,096 tokens, bf16 compiled: MFU on active parameters, profiled",
        [
            [*BENCH, "configs/official/OLMoE-1B-7B.yaml", "--data", "synthetic", "--steps", "10", "--warmup", "3"]
            + ["--precision", "amp_bf16", "--compile", "--batch", "4", "--micro-batch", "4"]
            + ["--override", "model.n_layers=4", "--override", "metrics_collect_interval=10"]
            + ["--profile", "--out", str(olmoe_out)]
        ],
        90,
        report=str(olmoe_out),
    )
    flash = _bench("1b-bf16-flash-attn", "1b", None, work, ("--override", "model.flash_attention=true"))
    if not flash_attn:
        flash.skip_reason = "no flash-attn wheel (PyPI has none; put flash_attn-*.whl into the wheel folder)"
    curves = Part(
        "float8-loss-curves",
        "bf16 and float8 tensorwise, 200 steps of real text (4 layers, d_model 1024), compiled",
        [[sys.executable, "-m", "olmo.bench.float8_curves", "--out", str(work / "float8-curves.json")]],
        120,
        report=str(work / "float8-curves.json"),
    )
    linear = Part(
        "linear-attention-kernels",
        "Gated DeltaNet at OLMo Hybrid's layer shape (30 heads, key 96, value 192), bf16, 2 x 2,048 and 2 x 8,192: "
        "flash-linear-attention's kernels against the pure-PyTorch chunked path (fp32 difference) and attention",
        [
            [sys.executable, "scripts/benchmark_linear_attention.py", "--seq", "2048", "8192", "--batch", "2"]
            + "--heads 30 --key-dim 96 --value-dim 192 --precision bf16 --recurrence-max 0".split()
            + ["--out", str(work / "linear-attention.json")]
        ],
        90,
        report=str(work / "linear-attention.json"),
    )
    tests = Part(
        "gpu-tests", "pytest tests/test_gpu.py", [[sys.executable, "-m", "pytest", "-q", "tests/test_gpu.py"]], 120
    )
    probe = Part(
        "environment",
        "Python, torch, CUDA, GPU, torchao, flash-attn",
        [[sys.executable, "-c", env_probe]],
        30,
        False,
    )
    if gpus < 2:
        for part in (fsdp, pipeline):
            part.skip_reason = "one GPU: NCCL refuses two ranks on one GPU (Duplicate GPU detected); needs two"
    # Issue 55's parts first (windows, the expert layer, float8 on OLMo-1B), then the rest of the checks.
    first = [probe, *windows[:3], *experts, olmoe, ladder[0], ladder[1], rowwise[0], tests, ladder[2], ladder[3]]
    return [*first, rowwise[1], curves, windows[3], fsdp, original, linear, pipeline, flash]
