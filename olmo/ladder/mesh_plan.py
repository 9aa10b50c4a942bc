"""``scripts/plan.py``: a config's memory and speed on a cluster before renting it, for the configured mesh and the
other meshes its world size allows.

    python scripts/plan.py CONFIG [--key=value ...] --world_size N --device h100|h200|a100|cpu [--json]

For each mesh: the degrees (``replicate`` x ``shard``: FSDP over all ranks; ``expert_parallel`` for a mixture of
experts; ``context_parallel``, offered for sequences of 16,384 tokens or more; ``tensor_parallel``, offered within
a node for models of ``d_model`` 4,096 or more), the micro-batch, the memory of one rank by part
(:func:`olmo.ladder.estimates.estimate_memory`: within 1.3 % of every peak measured on an H200, see docs/ladder.md),
whether it fits the device with 10 % allocator headroom and the CUDA context, and the step time and MFU at the
assumed MFU of the device's dense peak (``--mfu``, default 0.45: OLMo-1B measured 0.54-0.56 on an H200, OLMo-300M
0.50). A mesh that does not fit names the largest micro-batch that would; when none does, the plan says which mesh
fits. ``--json``: a list of meshes, each with ``degrees``, ``micro_batch``, ``memory`` (bytes by part, with
``total``), ``fits``, ``step_seconds`` and ``mfu``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

from ..config import ShardingStrategy, TrainConfig
from ..config.layout_checks import MAX_WORLD_SIZE, layout_problems
from ..exceptions import OLMoConfigurationError

if TYPE_CHECKING:
    from ..distributed.run_shape import RunShape
    from .estimates import DeviceSpec

# The estimates build the model on the meta device, so they import torch: loaded only once the config and its
# layout are known to be good, so that usage errors, --help and refusals answer in a second.

__all__ = ["MeshPlan", "mesh_variants", "check_layout", "plan_meshes", "format_plans", "main"]

DEVICES = {"h100": "H100", "h200": "H200", "a100": "A100", "cpu": "cpu"}
DEFAULT_MFU = 0.45
GIB = 2**30
"""Memory is shown in GiB (2^30 bytes), as GPU makers state device memory (an H100 has 80 GiB)."""


@dataclass
class MeshPlan:
    """One mesh of a plan."""

    name: str
    degrees: dict[str, int]
    micro_batch: int
    memory: dict[str, float]
    fits: bool
    step_seconds: Optional[float]
    mfu: float
    configured: bool
    largest_micro_batch: Optional[int]
    """The largest micro-batch (a power of two up to the configured one) that fits, when the configured one does not."""
    bubble: float = 0.0
    """The share of a step a pipeline's ranks idle (:func:`olmo.distributed.pipeline_plan.bubble_fraction`; 0 without
    pipeline parallelism); the step time includes it."""


def mesh_variants(run: RunShape, world_size: int) -> list[tuple[str, RunShape]]:
    """The configured layout first, then the other FSDP layouts (and expert-parallel, context- and tensor-parallel
    degrees) this world allows, each as ``run`` with its parallel sections changed (:func:`plan_meshes` keeps those
    a launch would accept)."""
    from .estimates import GPUS_PER_NODE

    out = [("configured", run)]
    if world_size == 1:
        return out  # one rank: nothing to shard
    configured = run.layout(world_size, GPUS_PER_NODE)
    fsdp = run.fsdp
    assert fsdp is not None

    def variant(strategy: ShardingStrategy, replicas: Optional[int] = None, **degrees: int) -> RunShape:
        """``run`` with this sharding strategy and these degrees (by section name)."""
        sharded = dataclasses.replace(
            fsdp, sharding_strategy=strategy, hybrid_sharding_num_model_replicas=replicas
        )
        sections = {k: dataclasses.replace(getattr(run, k), degree=d) for k, d in degrees.items()}
        return dataclasses.replace(run, fsdp=sharded, **sections)

    layouts: list[tuple[str, ShardingStrategy, Optional[int]]] = [
        ("FULL_SHARD", ShardingStrategy.FULL_SHARD, None),
        ("SHARD_GRAD_OP", ShardingStrategy.SHARD_GRAD_OP, None),
    ]
    if world_size > GPUS_PER_NODE and world_size % GPUS_PER_NODE == 0:
        layouts.append(("HYBRID_SHARD", ShardingStrategy.HYBRID_SHARD, world_size // GPUS_PER_NODE))
    layouts.append(("NO_SHARD", ShardingStrategy.NO_SHARD, None))
    degrees = [1]
    m = run.model
    if m.is_moe and m.moe is not None:
        degrees += [
            d
            for d in (2, 4, 8, 16, 32, 64)
            if d <= world_size and world_size % d == 0 and m.moe.num_experts % d == 0
        ]
    for label, strategy, replicas in layouts:
        for degree in degrees:
            if degree > 1 and strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
                continue
            name = label + (f" + EP {degree}" if degree > 1 else "")
            out.append((name, variant(strategy, replicas, expert_parallel=degree)))
    if (m.max_sequence_length >= 16384 or configured.context > 1) and not m.is_moe:
        for cp in (2, 4, 8, 16):
            if cp <= world_size:
                out.append((f"FULL_SHARD + CP {cp}", variant(ShardingStrategy.FULL_SHARD, context_parallel=cp)))
    if (m.d_model >= 4096 or configured.tensor > 1) and not m.is_moe and not m.alibi:
        cp = configured.context  # a long-context config keeps its context parallelism
        # Within a node (its all-reduces run in every layer).
        for tp in (tp for tp in (2, 4, 8) if tp <= min(world_size, GPUS_PER_NODE)):
            name = f"FULL_SHARD{f' + CP {cp}' if cp > 1 else ''} + TP {tp}"
            out.append((name, variant(ShardingStrategy.FULL_SHARD, tensor_parallel=tp)))
    if (world_size > GPUS_PER_NODE or configured.pipeline > 1) and not m.is_moe and not m.weight_tying:
        # Across nodes: only a stage's activations cross the slower links between them.
        for pp in (p for p in (2, 4, 8) if p <= m.n_layers and world_size % p == 0):
            out.append((f"FULL_SHARD + PP {pp}", variant(ShardingStrategy.FULL_SHARD, pipeline_parallel=pp)))
    return out


def check_layout(problems: list[str], world_size: int, config: str = "the config") -> None:
    """Refuse a configured layout that ``scripts/train.py`` would refuse on ``world_size`` processes for
    ``problems``: the model's values and :func:`olmo.config.validation.layout_problems`, the checks of a launch.

    :raises OLMoConfigurationError: listing every problem, each naming its key and fix.
    """
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise OLMoConfigurationError(
            f"{config} cannot launch on --world_size={world_size}: scripts/train.py refuses it for "
            f"{len(problems)} reason(s), so there is nothing to plan. Fix them in the YAML or with --key=value, or "
            f"plan another --world_size:\n{listing}"
        )


def plan_meshes(cfg: TrainConfig, world_size: int, device: DeviceSpec, mfu: float = DEFAULT_MFU) -> list[MeshPlan]:
    """Every mesh of :func:`mesh_variants` for ``cfg`` on ``world_size`` ranks of ``device`` that a launch would
    accept (the config with the mesh's parallel sections passes :func:`layout_problems`).

    :raises OLMoConfigurationError: when a launch would refuse the configured layout (:func:`check_layout`).
    """
    check_layout(cfg.model.problems() + layout_problems(cfg, world_size), world_size)
    from ..distributed.pipeline_plan import bubble_fraction
    from ..distributed.run_shape import RunShape
    from .estimates import GPUS_PER_NODE, estimate_memory, model_facts

    shape = RunShape.from_train_config(cfg)
    facts = model_facts(shape)
    plans = []
    for name, mesh in mesh_variants(shape, world_size):
        sections = {
            k: getattr(mesh, k)
            for k in ("fsdp", "expert_parallel", "context_parallel", "tensor_parallel", "pipeline_parallel")
        }
        if name != "configured" and layout_problems(dataclasses.replace(cfg, **sections), world_size):
            continue  # a launch would refuse it
        micro = mesh.device_train_microbatch_size
        estimate = estimate_memory(mesh, facts, world_size, device, micro)
        memory = {k: float(v) for k, v in asdict(estimate).items()}
        memory["total"] = float(estimate.total)
        fits = estimate.total <= device.memory_bytes
        largest = None
        if not fits:
            candidate = micro // 2
            while candidate >= 1 and largest is None:
                if estimate_memory(mesh, facts, world_size, device, candidate).total <= device.memory_bytes:
                    largest = candidate
                candidate //= 2
        tokens = mesh.global_train_batch_size * mesh.model.max_sequence_length / world_size
        rate = (device.peak_flops or 0.0) * mfu
        pp = mesh.pipeline_parallel
        microbatches = pp.microbatches or mesh.grad_accum_steps(world_size)
        bubble = bubble_fraction(str(pp.schedule), pp.degree, microbatches, pp.stages_per_rank)
        step = facts.flops_per_token * tokens / rate / (1 - bubble) if rate else None
        degrees = mesh.layout(world_size, GPUS_PER_NODE).degrees()  # the sizes a launch's layout gives this mesh
        configured = name == "configured"
        plans.append(MeshPlan(name, degrees, micro, memory, fits, step, mfu, configured, largest, bubble))
    return plans


def format_plans(plans: list[MeshPlan], device: DeviceSpec, world_size: int) -> str:
    """The plans as a table, memory in GiB."""
    from .estimates import FRAGMENTATION

    lines = [
        f"{world_size:,} x {device.name} ({device.memory_bytes / GIB:.0f} GiB each, peak "
        f"{(device.peak_flops or 0) / 1e12:.0f} TFLOP/s); memory per rank in GiB, with {FRAGMENTATION:.0%} "
        f"allocator headroom:",
        f"{'mesh':28s} {'repl x shard':>12s} {'EP':>3s} {'CP':>3s} {'TP':>3s} {'PP':>3s} {'micro':>5s} {'params':>7s} {'grads':>6s} {'optim':>6s} "
        f"{'gather':>6s} {'activ':>7s} {'loss':>6s} {'total':>7s}  fits  step (bubble)",
    ]
    for p in plans:
        m = {k: v / GIB for k, v in p.memory.items()}
        step = f"{p.step_seconds:.3g} s" if p.step_seconds is not None else "?"
        if p.bubble:
            step += f" ({p.bubble:.0%})"
        fits = (
            "yes"
            if p.fits
            else f"NO (micro-batch {p.largest_micro_batch} would)"
            if p.largest_micro_batch
            else "NO"
        )
        lines.append(
            f"{p.name:28s} {p.degrees['replicate']:>5d} x {p.degrees['shard']:<4d} {p.degrees['expert_parallel']:>3d} "
            f"{p.degrees['context_parallel']:>3d} {p.degrees['tensor_parallel']:>3d} "
            f"{p.degrees['pipeline_parallel']:>3d} {p.micro_batch:>5d} {m['params']:>7.2f} {m['grads']:>6.2f} {m['optimizer']:>6.2f} {m['gathered_params']:>6.2f} "
            f"{m['activations'] + m['recompute']:>7.2f} {m['loss']:>6.2f} {m['total']:>7.2f}  {fits}  {step}"
        )
    configured = plans[0]
    if not configured.fits and configured.largest_micro_batch is None:
        fitting = [p.name for p in plans[1:] if p.fits]
        lines.append(
            "The configured mesh does not fit at any micro-batch; "
            + (
                f"these do: {', '.join(fitting)}."
                if fitting
                else f"no mesh of this world size does. One micro-batch's activations and loss take "
                f"{(configured.memory['activations'] + configured.memory['loss']) / GIB:.0f} GiB per rank, which more "
                f"ranks do not divide: activation_checkpointing, fused_loss, context_parallel, tensor_parallel or a shorter sequence "
                f"would."
            )
        )
    fastest = min(
        (p for p in plans if p.fits and p.step_seconds is not None),
        key=lambda p: p.step_seconds or 0,
        default=None,
    )
    if fastest is not None and any(p.bubble for p in plans):
        lines.append(
            f"Fastest that fits: {fastest.name} ({fastest.step_seconds:.3g} s a step); a pipeline's step includes its "
            f"bubble, not the time its activations take to cross the links between stages."
        )
    lines.append(f"Step times assume {configured.mfu:.0%} MFU of the dense peak.")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's flags, and the config overrides (``--key=value``) without their dashes."""
    parser = argparse.ArgumentParser(prog="plan.py", description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument(
        "--world_size", type=int, required=True, help=f"ranks (processes), 1 to {MAX_WORLD_SIZE:,}"
    )
    parser.add_argument("--device", choices=sorted(DEVICES), required=True)
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="assumed MFU for the step time")
    parser.add_argument("--json", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.world_size < 1:
        parser.error(f"--world_size={args.world_size} must be at least 1")
    if args.world_size > MAX_WORLD_SIZE:
        parser.error(f"--world_size={args.world_size} must be at most {MAX_WORLD_SIZE:,} (about a million ranks)")
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu={args.mfu} must be in (0, 1]")
    unknown = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if unknown:
        parser.error(f"{unknown[0]!r}: config overrides are --key=value")
    return args, [a[2:] for a in rest]


def main(argv: Optional[list[str]] = None) -> int:
    """``scripts/plan.py``: see the module's docstring."""
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = TrainConfig.load(args.config, overrides)
    # Before torch is imported: a refusal answers at once.
    check_layout(cfg.model.problems() + layout_problems(cfg, args.world_size), args.world_size, args.config)
    from .estimates import resolve_device

    device = resolve_device(DEVICES[args.device], cfg.speed_monitor.gpu_flops_available)
    plans = plan_meshes(cfg, args.world_size, device, args.mfu)
    if args.json:
        print(json.dumps([asdict(p) for p in plans], indent=1))
    else:
        print(format_plans(plans, device, args.world_size))
    return 0
