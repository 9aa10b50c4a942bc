"""bf16 and float8 loss curves on real text, for the GPU checks (``scripts/gpu_checks.py``, part
``float8-loss-curves``):

    python -m olmo.bench.float8_curves [--steps 200] [--recipe tensorwise] [--emulate] [--out FILE.json]

Trains the same model twice from the same initialization on the same batches (byte-level tokens of the Python
standard library's source, written on the spot, so nothing is downloaded): 4 layers at d_model 1,024 (every block
linear wide enough for float8), 1,024 tokens x 16 instances per step, bf16 autocast and compile on a GPU. Reports
both curves' means over the last quarter and the relative differences per step. ``--emulate`` runs torchao's
emulation (on a CPU, fp32, uncompiled: a check of this program, not of float8's speed).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, Optional

from ..testing import metric_by_step, run_train, tiny_config_dict, write_byte_memmap, write_config

__all__ = ["main", "compare"]


def compare(bf16: dict[int, float], float8: dict[int, float]) -> dict[str, Any]:
    """The two curves' summary: means over the last quarter, the largest and the last quarter's mean relative
    difference per step."""
    steps = sorted(bf16)
    if not steps or sorted(float8) != steps:
        raise ValueError(f"the runs logged different steps ({len(bf16)} and {len(float8)})")
    rel = [abs(float8[s] - bf16[s]) / abs(bf16[s]) for s in steps]
    tail = steps[len(steps) * 3 // 4 :]
    return {
        "steps": len(steps),
        "bf16_last_quarter": round(sum(bf16[s] for s in tail) / len(tail), 4),
        "float8_last_quarter": round(sum(float8[s] for s in tail) / len(tail), 4),
        "max_relative_difference": round(max(rel), 4),
        "last_quarter_relative_difference": round(sum(rel[-len(tail) :]) / len(tail), 4),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--recipe", choices=["tensorwise", "rowwise"], default="tensorwise")
    parser.add_argument(
        "--emulate", action="store_true", help="torchao's emulation: fp32 on any device, no compile"
    )
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--out", help="write the summary and both curves as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="float8-curves-") as tmp:
        root = Path(tmp)
        tokens = args.steps * 16 * 1024 + 1024
        write_byte_memmap(root / "text.npy", tokens)
        settings: dict[str, Any] = {
            "model.d_model": args.d_model,
            "model.n_heads": max(1, args.d_model // 128),
            "model.n_layers": 4,
            "model.max_sequence_length": 1024,
            "global_train_batch_size": 16,
            "device_train_microbatch_size": 16,
            "max_duration": args.steps,
            "save_interval_unsharded": None,
            "console_log_interval": 50,
            "optimizer.learning_rate": 2e-3,
            "scheduler.t_warmup": max(1, args.steps // 10),
            "metrics_collect_interval": 10,
        }
        if not args.emulate:
            settings.update({"precision": "amp_bf16", "compile": {}})
        curves = {}
        for name in ("bf16", "float8"):
            float8 = {
                "enabled": True,
                "recipe": args.recipe,
                "emulate": args.emulate,
                "min_features": min(1024, args.d_model),
            }
            extra = {"model.float8": float8} if name == "float8" else {}
            config = write_config(
                root / f"{name}.yaml", tiny_config_dict(root / name, [str(root / "text.npy")], **settings, **extra)
            )
            if run_train(config) != 0:
                raise SystemExit(f"the {name} run failed")
            curves[name] = metric_by_step(root / name)
    summary = compare(curves["bf16"], curves["float8"])
    print(json.dumps(summary))
    if args.out:
        report = {"summary": summary, "curves": {k: {str(s): v for s, v in c.items()} for k, c in curves.items()}}
        Path(args.out).write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
