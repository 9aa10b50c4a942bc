"""The run planner: what a validated :class:`~olmo.config.TrainConfig` will do on ``world_size`` devices, worked
out without building a process group, touching data or allocating a parameter.

Parameter counts and FLOPs come from the model's own code (``OLMo(cfg.model)`` built on the meta device, and
:meth:`~olmo.model.OLMo.num_flops_per_token`, the rule the trainer's MFU uses); batch, accumulation and steps from
the config's own rules (:meth:`~olmo.config.TrainConfig.grad_accum_steps`, :meth:`~olmo.config.TrainConfig.max_steps`).
The memory estimate (:func:`olmo.ladder.estimates.estimate_memory`) counts what our training step keeps per device, and the wall
time is the training FLOPs at an assumed MFU. ``scripts/train.py CONFIG --dry_run`` prints a plan; the scaling
ladder (:mod:`olmo.ladder`) plans every rung with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..config import (
    DEFAULT_MAX_DURATION,
    DPOConfig,
    FSDPConfig,
    ModelConfig,
    RLConfig,
    SchedulerUnits,
    TrainConfig,
)
from ..config.layout_checks import smallest_world_size
from ..distributed.launch_memory import state_bytes_per_param
from ..distributed.run_shape import RunShape
from ..train.stages import StagePlan, plan_stages
from .estimates import (
    DeviceSpec,
    MemoryEstimate,
    ModelFacts,
    estimate_memory,
    model_facts,
    resolve_device,
    shard_degree,
)

__all__ = ["DEFAULT_MFU", "DeviceSpec", "ModelFacts", "MemoryEstimate", "RunPlan", "resolve_device", "model_facts"]
__all__ += ["estimate_memory", "plan_run", "format_plan", "format_count"]

DEFAULT_MFU = 0.4
"""MFU assumed for the wall-time estimate: what a well-tuned bf16 FSDP run of a mid-size OLMo reaches on H100s."""


@dataclass
class RunPlan:
    """What a training config will do: the numbers ``scripts/train.py --dry_run`` prints. Counts are per run
    unless named per device; None where the plan cannot know (an epoch-long run without the dataset's size, a
    device of unknown peak FLOP/s)."""

    run_name: Optional[str]
    num_params: int
    num_non_embedding_params: int
    num_active_params: int
    d_model: int
    n_layers: int
    n_heads: int
    sequence_length: int
    num_devices: int
    dp_world_size: int
    global_batch_size_instances: int
    global_batch_size_tokens: int
    device_batch_instances: int
    rank_microbatch_instances: int
    grad_accum_steps: int
    max_duration: str
    max_steps: Optional[int]
    total_tokens: Optional[int]
    learning_rate: float
    scheduler: str
    warmup_steps: int
    flops_per_token: int
    train_flops: Optional[float]
    distributed: str
    precision: str
    activation_checkpointing: Optional[str]
    fused_loss: bool
    device: str
    device_memory_gb: float
    memory_gb: dict[str, float]
    est_peak_memory_gb: float
    """Estimated peak per device, overhead included (see :class:`MemoryEstimate`)."""
    fits: bool
    """Whether ``est_peak_memory_gb`` fits ``device_memory_gb``."""
    peak_flops: Optional[float]
    peak_flops_source: str
    assumed_mfu: float
    est_wall_time_s: Optional[float]
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain JSON values."""
        return asdict(self)


def _distributed(run: RunShape, world_size: int, fewest: int) -> str:
    """How the run spreads over ``world_size`` processes; for one process, also the degrees it will need torchrun for
    (a dry run started as one process plans them elsewhere) and the ``fewest`` processes they launch on."""
    degrees = {
        "expert_parallel": run.expert_parallel.degree,
        "context_parallel": run.context_parallel.degree,
        "tensor_parallel": run.tensor_parallel.degree,
        "pipeline_parallel": run.pipeline_parallel.degree,
    }
    split = ", ".join(f"{key}.degree={d}" for key, d in degrees.items() if isinstance(d, int) and d > 1)
    if world_size == 1:
        if split:
            return (
                f"single process (no sharding); under torchrun: {split}, on a multiple of {fewest} processes "
                f"(scripts/plan.py --world_size N plans it)"
            )
        return "single process (no sharding)"
    suffix = f"; {split}" if split else ""
    if run.distributed_strategy == "ddp":
        return f"DDP over {world_size} ranks (replicated){suffix}"
    strategy = (run.fsdp or FSDPConfig()).sharding_strategy
    return f"FSDP {strategy} over {world_size} ranks (sharded {shard_degree(run, world_size)} ways){suffix}"


def _in_epochs(durations: Sequence[object]) -> bool:
    """Whether a length (``max_duration`` or a stage's) is given in epochs."""
    return any(str(d).strip().endswith("ep") for d in durations if d is not None)


def _max_steps(stages: Optional[StagePlan], stop_at: Optional[int], notes: list[str]) -> tuple[Optional[int], int]:
    """The run's optimizer steps by the trainer's own rule (its :func:`olmo.train.stages.plan_stages`:
    ``max_duration``, or the sum of the ``stages``), None for a length in epochs when the dataset's size is not given
    (then ``stages`` is None); and how many of them train with a KL penalty (each also runs the reference model forward)."""
    if stages is None:
        notes.append("The length is given in epochs: its steps need the dataset's size.")
        return None, 0
    if stages.staged:
        notes.append(stages.describe())
    if stop_at is not None and stop_at < stages.total_steps:
        notes.append(f"stop_at={stop_at} ends the run before its last step ({stages.total_steps:,}).")
    return stages.total_steps, sum(s.num_steps for s in stages.stages if s.kl_beta)


def _dpo_note(dpo: DPOConfig, batch: int, instances: Optional[int], max_steps: Optional[int]) -> str:
    """The plan's line about DPO: pairs per step (of ``batch`` instances) and in the data, the loss, and what the
    reference costs."""
    data = f"{instances // 2:,} pairs in the data ({instances:,} instances), " if instances is not None else ""
    seen = f"{max_steps * batch // 2:,} pairs trained; " if max_steps is not None else ""
    return (
        f"DPO ({dpo.loss}, beta {dpo.beta:g}): {batch // 2:,} pairs per step, "
        f"{data}{seen}the frozen reference ({dpo.reference_path or 'the model the run starts from'}) adds a "
        f"forward pass per micro-batch (in FLOPs) and its weights (in memory: reference)."
    )


def _rl_note(rl: RLConfig, prompts: int) -> str:
    """The plan's line about an RL run (``prompts`` per step): what a step samples and trains, and what the plan's
    numbers count of it."""
    reference = (
        f"; the frozen reference {rl.reference_path} (beta {rl.beta:g}) adds a forward pass per group"
        if rl.beta > 0
        else ""
    )
    n = rl.num_iterations * rl.num_mini_batches
    updates = (
        "one optimizer step"
        if n == 1
        else f"{n} optimizer steps on them (rl.num_iterations {rl.num_iterations} x rl.num_mini_batches "
        f"{rl.num_mini_batches})"
    )
    return (
        f"RL ({rl.loss}): {prompts:,} prompts per step x {rl.group_size} completions of up to {rl.max_new_tokens} new "
        f"tokens ({prompts * rl.group_size:,}), {updates}; each forward and backward is one prompt's group, "
        f"so the memory above is that of {rl.group_size} full-length instances (an upper bound). The FLOPs and time "
        f"count the prompts' instances, not the sampling (about 2N FLOPs per sampled token more){reference}."
    )


def pipeline_note(run: RunShape, accumulation: int) -> str:
    """The plan's line about a pipeline (``accumulation``: the micro-batches gradient accumulation would cut each
    rank's batch into): its stages' blocks, schedule, micro-batches and bubble."""
    from ..distributed.pipeline_plan import block_flops, bubble_fraction, split_layers

    pp = run.pipeline_parallel
    stages = pp.degree * pp.stages_per_rank
    costs, head = block_flops(run.model, run.model.max_sequence_length)
    split = split_layers(costs, head, stages)
    blocks = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}" for r in split)
    microbatches = pp.microbatches or accumulation
    bubble = bubble_fraction(str(pp.schedule), pp.degree, microbatches, pp.stages_per_rank)
    return (
        f"Pipeline ({pp.schedule}, {pp.degree} ranks x {pp.stages_per_rank} stage(s)): blocks {blocks} (balanced by "
        f"FLOPs; the embedding on the first stage, the output layer on the last), {microbatches} micro-batches a "
        f"step, an ideal bubble of {bubble:.0%} of the step."
    )


def _float8_note(m: ModelConfig) -> Optional[str]:
    """The plan's line about float8 training (None without it)."""
    if not (m.trains_float8 and m.float8 is not None):
        return None
    return (
        f"float8 ({m.float8.recipe}{', emulated' if m.float8.emulate else ''}) on the blocks' linear layers at "
        f"least {m.float8.min_features:,} wide: the time above assumes the bf16 MFU (OLMo-core and torchtitan "
        f"measure float8 1.2-1.3x faster on H100s: docs/throughput.md), the memory the same weights and optimizer "
        f"state."
    )


def _experts_note(run: RunShape, facts: ModelFacts, world_size: int) -> str:
    """The plan's line about the experts' share of the model and of each rank's memory."""
    shard = shard_degree(run, world_size)
    state = sum(state_bytes_per_param(str(run.optimizer.name)))
    return (
        f"Experts: {facts.expert_params:,} parameters ({facts.expert_params / facts.num_params:.0%} of the model); "
        f"their weights, gradients and optimizer state take {state * facts.expert_params / shard / 1e9:.2f} GB "
        + (
            f"per rank, sharded by FSDP over {shard} ranks."
            if shard > 1
            else "in this one process (nothing is sharded)."
            if world_size == 1
            else "on every rank (not sharded)."
        )
    )


def plan_run(
    cfg: TrainConfig,
    world_size: int,
    instances_per_epoch: Optional[int] = None,
    device_type: Optional[str] = None,
    *,
    mfu: float = DEFAULT_MFU,
    facts: Optional[ModelFacts] = None,
) -> RunPlan:
    """Plan ``cfg`` (already validated for ``world_size``) on ``world_size`` devices.

    :param instances_per_epoch: the training data's size in instances, for a ``max_duration`` in epochs.
    :param device_type: the device to plan for (see :func:`resolve_device`); None for this machine's.
    :param mfu: model FLOPs utilization assumed for the wall-time estimate.
    :param facts: the model's counts, when the caller already has them (:func:`model_facts`).
    """
    run = RunShape.from_train_config(cfg)
    facts = facts or model_facts(run)
    device = resolve_device(device_type, cfg.speed_monitor.gpu_flops_available)
    m, notes = cfg.model, list[str]()
    durations = [cfg.max_duration, *(stage.max_duration for stage in cfg.stages or [])]
    in_epochs = instances_per_epoch is None and _in_epochs(durations)
    stages = None if in_epochs else plan_stages(cfg, lambda _data: instances_per_epoch or 0)
    max_steps, kl_steps = _max_steps(stages, cfg.stop_at, notes)
    total_tokens = None if max_steps is None else max_steps * cfg.tokens_per_batch
    train_flops = None if total_tokens is None else float(facts.flops_per_token) * total_tokens
    if train_flops is not None and kl_steps:
        # The reference's forward pass is a third of a training step's 6N (2N forward, 4N backward).
        reference = facts.flops_per_token / 3 * kl_steps * cfg.tokens_per_batch
        train_flops += reference
        notes.append(
            f"FLOPs include the KL reference's forward passes ({kl_steps:,} steps, {format_count(reference)})."
        )
    if cfg.dpo.enabled:
        notes.append(_dpo_note(cfg.dpo, cfg.global_train_batch_size, instances_per_epoch, max_steps))
        if train_flops is not None:  # the reference's forward pass: a third of a training step's 6N
            train_flops += facts.flops_per_token / 3 * (total_tokens or 0)
    if cfg.rl.enabled:
        notes.append(_rl_note(cfg.rl, cfg.global_train_batch_size))
    if cfg.pipeline_parallel.degree > 1:
        notes.append(pipeline_note(run, cfg.grad_accum_steps(max(world_size, smallest_world_size(cfg)))))
    if (float8 := _float8_note(m)) is not None:
        notes.append(float8)
    micro = cfg.rl.group_size if cfg.rl.enabled else cfg.device_train_microbatch_size  # RL: a group per forward
    memory = estimate_memory(run, facts, world_size, device, micro)
    capacity, rate = device.memory_bytes, world_size * (device.peak_flops or 0.0) * mfu
    wall = train_flops / rate if train_flops is not None and rate else None
    in_tokens = cfg.scheduler.units == SchedulerUnits.tokens
    autocast = device.is_gpu and cfg.autocast_precision is not None
    duration = (
        cfg.max_duration if cfg.max_duration is not None else "stages" if cfg.stages else DEFAULT_MAX_DURATION
    )
    overhead = "10% allocator headroom and 1 GiB CUDA context" if device.is_gpu else "a 0.35 GB process baseline"
    notes.append(f"Memory: weights, gradients, optimizer state, one micro-batch's activations, {overhead}.")
    if facts.expert_params:
        notes.append(_experts_note(run, facts, world_size))
    gb = 1e9
    return RunPlan(
        run_name=cfg.run_name,
        num_params=facts.num_params,
        num_non_embedding_params=facts.num_non_embedding_params,
        num_active_params=facts.num_active_params,
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        sequence_length=m.max_sequence_length,
        num_devices=world_size,
        dp_world_size=world_size,
        global_batch_size_instances=cfg.global_train_batch_size,
        global_batch_size_tokens=cfg.tokens_per_batch,
        device_batch_instances=cfg.device_batch_size(world_size),
        rank_microbatch_instances=cfg.device_train_microbatch_size,
        grad_accum_steps=cfg.grad_accum_steps(world_size),
        max_duration=str(duration),
        max_steps=max_steps,
        total_tokens=total_tokens,
        learning_rate=cfg.optimizer.learning_rate,
        scheduler=str(cfg.scheduler.name),
        warmup_steps=math.ceil(cfg.scheduler.t_warmup / (cfg.tokens_per_batch if in_tokens else 1)),
        flops_per_token=facts.flops_per_token,
        train_flops=train_flops,
        distributed=_distributed(run, world_size, smallest_world_size(cfg)),
        precision=(cfg.precision or "fp32") + ("" if autocast or not cfg.autocast_precision else " (fp32 here)"),
        activation_checkpointing=cfg.activation_checkpointing and str(cfg.activation_checkpointing),
        fused_loss=bool(cfg.fused_loss),
        device=device.name,
        device_memory_gb=round(capacity / gb, 2),
        memory_gb={k: round(v / gb, 3) for k, v in asdict(memory).items()},
        est_peak_memory_gb=round(memory.total / gb, 3),
        fits=memory.total <= capacity,
        peak_flops=device.peak_flops,
        peak_flops_source=device.peak_flops_source,
        assumed_mfu=mfu,
        est_wall_time_s=wall,
        notes=notes,
    )


def format_count(n: Optional[float], unit: str = "") -> str:
    """``n`` with an SI prefix (``1.2M``, ``3.4G FLOP/s``)."""
    if n is None:
        return "unknown"
    for scale, prefix in (
        (1e24, "Y"),
        (1e21, "Z"),
        (1e18, "E"),
        (1e15, "P"),
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
    ):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{prefix}{unit}"
    return f"{n:.3g}{unit}"


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "unknown"
    for limit, scale, unit in ((120, 1, "s"), (7200, 60, "min"), (3 * 86400, 3600, "h")):
        if seconds < limit:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 86400:.3g} days"


def format_plan(plan: RunPlan) -> str:
    """The plan as aligned ``name: value`` lines for a terminal."""
    p = plan
    breakdown = ", ".join(f"{k} {v:.2f}" for k, v in p.memory_gb.items() if v)
    steps = f"{p.max_steps:,} steps, {format_count(p.total_tokens)} tokens, " if p.max_steps is not None else ""
    rows = [
        ("run", p.run_name or "(unnamed)"),
        (
            "parameters",
            f"{p.num_params:,} total, {p.num_non_embedding_params:,} non-embedding"
            + (f", {p.num_active_params:,} active per token" if p.num_active_params != p.num_params else "")
            + f" (d_model {p.d_model}, {p.n_layers} layers, {p.n_heads} heads)",
        ),
        ("devices", f"{p.num_devices} x {p.device}; {p.distributed}"),
        (
            "batch",
            f"{p.global_batch_size_instances:,} instances x {p.sequence_length} = {p.global_batch_size_tokens:,} "
            f"tokens per step; {p.device_batch_instances} per device in micro-batches of {p.rank_microbatch_instances} "
            f"({p.grad_accum_steps} accumulation step(s))",
        ),
        ("duration", f"{steps}max_duration={p.max_duration}"),
        ("learning rate", f"{p.learning_rate:.4g} peak, {p.scheduler}, {p.warmup_steps:,} warmup steps"),
        ("FLOPs", f"{format_count(p.flops_per_token)} per token; {format_count(p.train_flops)} in the run"),
        (
            "precision",
            f"{p.precision}; activation checkpointing {p.activation_checkpointing or 'off'}; fused_loss "
            f"{p.fused_loss}",
        ),
        (
            "memory / device",
            f"~{p.est_peak_memory_gb:.2f} GB of {p.device_memory_gb:.1f} GB "
            f"({'fits' if p.fits else 'DOES NOT FIT'}): {breakdown}",
        ),
        (
            "time",
            f"~{_duration(p.est_wall_time_s)} at {p.assumed_mfu:.0%} MFU of "
            f"{format_count(p.peak_flops, ' FLOP/s')} per device ({p.peak_flops_source})",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(
        [f"{name:>{width}}: {value}" for name, value in rows] + [f"{'note':>{width}}: {n}" for n in p.notes]
    )
