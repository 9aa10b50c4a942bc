"""The run planner: what a validated :class:`~olmo.config.TrainConfig` will do on ``world_size`` devices, worked
out without building a process group, touching data or allocating a parameter.

Parameter counts and FLOPs come from the model's own code (``OLMo(cfg.model)`` built on the meta device, and
:meth:`~olmo.model.OLMo.num_flops_per_token`, the rule the trainer's MFU uses); batch, accumulation and steps from
the config's own rules (:meth:`~olmo.config.TrainConfig.grad_accum_steps`, :meth:`~olmo.config.TrainConfig.max_steps`).
The memory estimate (:func:`estimate_memory`) counts what our training step keeps per device, and the wall
time is the training FLOPs at an assumed MFU. ``scripts/train.py CONFIG --dry_run`` prints a plan; the scaling
ladder (:mod:`olmo.ladder`) plans every rung with it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from ..config import (
    DEFAULT_MAX_DURATION,
    FSDPConfig,
    LayerNormType,
    SchedulerUnits,
    ShardingStrategy,
    TrainConfig,
)
from ..distributed.parallelize import apply_activation_checkpointing
from ..exceptions import OLMoConfigurationError
from ..model import OLMo
from ..model.flops import cpu_peak_flops, gpu_peak_flops
from ..model.loss import FUSED_LOSS_CHUNK_TOKENS
from ..train.stages import plan_stages

__all__ = ["DEFAULT_MFU", "DeviceSpec", "ModelFacts", "MemoryEstimate", "RunPlan", "resolve_device", "model_facts"]
__all__ += ["estimate_memory", "plan_run", "format_plan", "format_count"]

DEFAULT_MFU = 0.4
"""MFU assumed for the wall-time estimate: what a well-tuned bf16 FSDP run of a mid-size OLMo reaches on H100s."""
GPUS_PER_NODE = 8
"""Devices per node assumed for hybrid sharding when ``fsdp.hybrid_sharding_num_model_replicas`` is not set."""
CUDA_CONTEXT_BYTES = 1 << 30
"""Device memory the CUDA context and NCCL take outside PyTorch's allocator (not in ``max_memory_allocated``)."""
FRAGMENTATION = 0.10
"""Allocator headroom on a GPU: a plan fits when its estimate plus 10% plus the CUDA context fits the device."""
CPU_BASELINE_BYTES = 350 << 20
"""A training process's resident memory besides its tensors (Python, torch, the data loader): 0.33 GB on our
CPU machines. Its peak is this plus the tensors when glibc returns freed blocks (``MALLOC_MMAP_THRESHOLD_=65536``);
with glibc's default, which keeps them, up to 2x more."""

GATHERED_STRATEGIES = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
"""Sharding strategies that keep every block's parameters gathered from the forward to the backward pass."""
# Device memory in GiB by name, for names that do not state it ("H100 80GB" does). Longest match first.
_GPU_MEMORY_GIB = {"H100 NVL": 94, "H100": 80, "GH200": 96, "H200": 141, "A100": 80, "L40S": 48, "A10G": 24}


@dataclass(frozen=True)
class DeviceSpec:
    """One training device as the planner sees it.

    :param name: as given (``H100 80GB``) or detected (``cpu``, ``torch.cuda.get_device_name``).
    :param is_gpu: whether training runs with CUDA (autocast and FSDP mixed precision apply).
    :param memory_bytes: memory available to one rank.
    :param peak_flops: dense peak FLOP/s of one device (bf16 on a GPU, the measured fp32 matmul rate on a CPU),
        or None when unknown.
    :param peak_flops_source: where ``peak_flops`` came from.
    """

    name: str
    is_gpu: bool
    memory_bytes: float
    peak_flops: Optional[float]
    peak_flops_source: str


def resolve_device(device_type: Optional[str] = None, peak_flops_override: Optional[float] = None) -> DeviceSpec:
    """The device named by ``device_type``: ``cpu``, a GPU name (``H100``, ``H100 80GB``, ``A100 40GB``, ...),
    or None for this machine's (its first GPU, else its CPU).

    :param peak_flops_override: ``speed_monitor.gpu_flops_available``, which wins over any table, as in training.
    :raises OLMoConfigurationError: for a GPU whose memory is neither in the name nor known.
    """
    if device_type is None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return _device(props.name, float(props.total_memory), peak_flops_override)
    if device_type is None or device_type.strip().lower() == "cpu":
        return _device("cpu", float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), peak_flops_override)
    stated = re.search(r"(\d+(?:\.\d+)?)\s*GB", device_type, re.IGNORECASE)
    known = [g for k, g in _GPU_MEMORY_GIB.items() if k in device_type]
    gib = float(stated.group(1)) if stated else (known[0] if known else None)
    if gib is None:
        raise OLMoConfigurationError(
            f"device_type={device_type!r}: its memory is unknown. Name a known GPU "
            f"({', '.join(_GPU_MEMORY_GIB)}) or state the memory in the name, e.g. "
            f"'{device_type} 80GB'; or use cpu."
        )
    return _device(device_type, gib * 2**30, peak_flops_override)


def _device(name: str, memory: float, peak_flops_override: Optional[float]) -> DeviceSpec:
    is_gpu = name != "cpu"
    if peak_flops_override:
        return DeviceSpec(name, is_gpu, memory, float(peak_flops_override), "speed_monitor.gpu_flops_available")
    if not is_gpu:
        peak = cpu_peak_flops()
        return DeviceSpec(name, False, memory, peak.flops, peak.source)
    flops = gpu_peak_flops(name)
    source = f"the dense bf16 peak of {name}" if flops else "unknown (set speed_monitor.gpu_flops_available)"
    return DeviceSpec(name, True, memory, flops, source)


@dataclass(frozen=True)
class ModelFacts:
    """Counts taken from the model's own code, built on the meta device (nothing allocated)."""

    num_params: int
    num_non_embedding_params: int
    block_params: int
    """Parameters of one transformer block (every block has the same)."""
    flops_per_token: int
    """Training FLOPs per token at the config's sequence length (:meth:`OLMo.num_flops_per_token`)."""
    checkpointed_blocks: int
    """Blocks whose activations are recomputed in the backward pass (``activation_checkpointing``)."""


def model_facts(cfg: TrainConfig) -> ModelFacts:
    """Build ``OLMo(cfg.model)`` on the meta device, apply the config's activation checkpointing to it (as
    training does), and count."""
    with torch.device("meta"):
        model = OLMo(cfg.model)
    blocks = model.transformer.typed_blocks()
    checkpointed = 0
    if cfg.activation_checkpointing is not None:
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
        # A checkpointed block has its forward (or attention and MLP) replaced by an instance attribute.
        checkpointed = sum(1 for b in blocks if {"forward", "attention", "feed_forward"} & vars(b).keys())
    return ModelFacts(
        num_params=model.num_params(),
        num_non_embedding_params=model.num_params(include_embedding=False),
        block_params=sum(p.numel() for p in blocks[0].parameters()) if blocks else 0,
        flops_per_token=model.num_flops_per_token(cfg.model.max_sequence_length),
        checkpointed_blocks=checkpointed,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds at the peak of a training step (the start of the backward pass of a micro-batch,
    after the first optimizer step), by kind."""

    params: float
    """fp32 parameters, this rank's shard."""
    grads: float
    """fp32 gradients, this rank's shard."""
    optimizer: float
    """Optimizer state: AdamW's two fp32 moments, LionW's one."""
    gathered_params: float
    """Full parameters FSDP gathers for compute (the root unit, the blocks in use), or autocast's cached copies."""
    activations: float
    """What the blocks (and the final norm) save for the backward pass of one micro-batch."""
    loss: float
    """The output layer and loss at their peak: logits and their gradient, or the fused loss's chunk buffers."""
    recompute: float
    """A checkpointed block's activations, rebuilt in the backward pass once the loss's buffers are freed."""
    overhead: float
    """Outside the tensors: allocator headroom and the CUDA context on a GPU, the process baseline on a CPU."""

    @property
    def tensors(self) -> float:
        """Everything but the overhead, at the step's peak (the loss, or later a recomputed block): comparable to
        ``torch.cuda.max_memory_allocated``."""
        state = self.params + self.grads + self.optimizer + self.gathered_params
        return state + self.activations + max(self.loss, self.recompute)

    @property
    def total(self) -> float:
        return self.tensors + self.overhead


def _shard_degree(cfg: TrainConfig, world_size: int) -> int:
    """Over how many ranks parameters, gradients and optimizer state are split."""
    fsdp = cfg.fsdp or FSDPConfig()
    if world_size == 1 or cfg.distributed_strategy in ("ddp", "single") or fsdp.sharding_strategy == "NO_SHARD":
        return 1
    if fsdp.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        replicas = fsdp.hybrid_sharding_num_model_replicas or max(1, world_size // GPUS_PER_NODE)
        return max(1, world_size // replicas)
    return world_size


def _block_activation_bytes(cfg: TrainConfig, compute: int, residual: int) -> tuple[float, float]:
    """Bytes one block saves for backward per token: (attention part, MLP part), read off ``OLMoBlock``."""
    m = cfg.model
    d, head_dim = m.d_model, m.d_model // m.n_heads
    kv = m.effective_n_kv_heads * head_dim
    hidden = m.effective_mlp_hidden_size
    # Pre-norm input (residual stream) with its per-token statistics, and the projection's copy of the norm output.
    attention = residual * d + 8 + compute * d
    if m.effective_n_kv_heads != m.n_heads and not m.flash_attention:
        # SDPA gets k and v repeated to every query head, and q: rotated, or a view keeping the fused output alive.
        attention += compute * (2 * d + (d if m.rope else d + 2 * kv))
    else:
        attention += compute * (d + 2 * kv)  # the fused q/k/v output (v, a view of it, keeps it alive)
        attention += compute * (d + kv) if m.rope else 0  # the rotated q and k are new tensors
    attention += compute * d + 4 * m.n_heads  # SDPA's output (attn_out's input, a view of it); log-sum-exp in fp32
    mlp = residual * d + 8 + compute * d
    # ff_proj's output (for SwiGLU kept alive by its two halves, views of it), then the activation's output (SwiGLU:
    # silu of the gate half, and its product with the other half), which ff_out saves: twice the hidden width.
    mlp += compute * 2 * hidden
    return attention, mlp


def estimate_memory(
    cfg: TrainConfig, facts: ModelFacts, world_size: int, device: DeviceSpec, micro_batch: Optional[int] = None
) -> MemoryEstimate:
    """Peak memory of one device for ``cfg`` on ``world_size`` ranks of ``device``.

    Counts fp32 parameters, gradients and optimizer state split over the ranks that shard them (FULL_SHARD and
    SHARD_GRAD_OP over all ranks, HYBRID_SHARD within a node of :data:`GPUS_PER_NODE`, NO_SHARD and DDP not at
    all); the gathered bf16 copies FSDP computes with (the root unit, plus two blocks for FULL_SHARD or every
    block for SHARD_GRAD_OP); the activations one micro-batch saves (per block, as ``OLMoBlock`` computes, only
    block inputs under activation checkpointing); and the larger of the logits' peak (or, with ``fused_loss``,
    one chunk's) and a checkpointed block rebuilt in the backward pass. Dropout masks and the attention bias of ``generate_doc_lengths`` / ALiBi are not counted.

    :param micro_batch: instances per forward pass; ``device_train_microbatch_size`` by default.
    """
    m = cfg.model
    micro = micro_batch or cfg.device_train_microbatch_size
    tokens = micro * m.max_sequence_length
    autocast = device.is_gpu and cfg.autocast_precision is not None
    compute = 2 if autocast else 4
    shard = _shard_degree(cfg, world_size)
    fsdp_units = world_size > 1 and shard > 1
    mixed = fsdp_units and autocast and cfg.fsdp is not None and cfg.fsdp.precision is not None
    residual = compute if mixed else 4  # FSDP's bf16 parameters make the embedding output bf16
    P = facts.num_params
    params, grads = 4 * P / shard, 4 * P / shard
    optimizer = (8 if cfg.optimizer.name == "adamw" else 4) * P / shard

    gathered = 0.0
    if fsdp_units:
        unit = compute if mixed else 4
        root = P - m.n_layers * facts.block_params
        keep_all = cfg.fsdp is not None and cfg.fsdp.sharding_strategy in GATHERED_STRATEGIES
        blocks = m.n_layers if keep_all else min(2, m.n_layers)
        # The unsharded gradient of the block being reduced, in the reduce dtype (fp32 unless pure bf16).
        gathered = unit * (root + blocks * facts.block_params) + 4 * facts.block_params
    elif autocast:
        gathered = compute * P  # autocast caches a low-precision copy of every weight during the forward pass

    attention, mlp = _block_activation_bytes(cfg, compute, residual)
    full_block = attention + mlp
    if cfg.activation_checkpointing == "fine_grained":
        # The norms stay outside the checkpoints; each checkpoint saves its (fp32 under autocast) input.
        norm_out = 4 if autocast and m.layer_norm_type != LayerNormType.low_precision else compute
        kept = 2 * (residual + norm_out) * m.d_model
        recompute = max(attention, mlp)
    else:
        kept, recompute = residual * m.d_model, full_block  # a checkpointed block saves only its input
    checkpointed = facts.checkpointed_blocks
    activations = tokens * ((m.n_layers - checkpointed) * full_block + checkpointed * kept)
    activations += tokens * m.d_model * (residual + compute)  # ln_f's input and the output layer's

    vocab = m.effective_embedding_size
    kept_by_loss = 0  # what the loss keeps for the backward pass, beside a recomputed block
    if cfg.fused_loss:
        chunk = min(tokens, FUSED_LOSS_CHUNK_TOKENS)
        # One chunk's fp32 logits, their softmax and its gradient; the hidden states' and the weight's gradients.
        kept_by_loss = 4 * tokens * m.d_model + 4 * vocab * m.d_model
        loss = 3 * 4 * chunk * vocab + kept_by_loss
    else:
        # The logits (in the compute dtype), then cross entropy's fp32 log-probabilities and their gradient.
        loss = tokens * vocab * (compute + 2 * 4)
    recompute = tokens * recompute + kept_by_loss if checkpointed else 0.0

    estimate = MemoryEstimate(params, grads, optimizer, gathered, activations, loss, recompute, 0.0)
    overhead = FRAGMENTATION * estimate.tensors + CUDA_CONTEXT_BYTES if device.is_gpu else CPU_BASELINE_BYTES
    return dataclasses.replace(estimate, overhead=overhead)


@dataclass
class RunPlan:
    """What a training config will do: the numbers ``scripts/train.py --dry_run`` prints. Counts are per run
    unless named per device; None where the plan cannot know (an epoch-long run without the dataset's size, a
    device of unknown peak FLOP/s)."""

    run_name: Optional[str]
    num_params: int
    num_non_embedding_params: int
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


def _distributed(cfg: TrainConfig, world_size: int) -> str:
    if world_size == 1 or cfg.distributed_strategy == "ddp":
        return "single process (no sharding)" if world_size == 1 else f"DDP over {world_size} ranks (replicated)"
    strategy = (cfg.fsdp or FSDPConfig()).sharding_strategy
    return f"FSDP {strategy} over {world_size} ranks (sharded {_shard_degree(cfg, world_size)} ways)"


def _max_steps(
    cfg: TrainConfig, instances_per_epoch: Optional[int], notes: list[str]
) -> tuple[Optional[int], int]:
    """The run's optimizer steps by the trainer's own rule (:func:`olmo.train.stages.plan_stages`: ``max_duration``, or
    the sum of the ``stages``), None for a length in epochs when the dataset's size is not given; and how many of
    them train with a KL penalty (each also runs the reference model forward)."""
    durations = [cfg.max_duration, *(stage.max_duration for stage in cfg.stages or [])]
    if instances_per_epoch is None and any(str(d).strip().endswith("ep") for d in durations if d is not None):
        notes.append("The length is given in epochs: its steps need the dataset's size.")
        return None, 0
    stages = plan_stages(cfg, lambda _data: instances_per_epoch or 0)
    if stages.staged:
        notes.append(stages.describe())
    if cfg.stop_at is not None and cfg.stop_at < stages.total_steps:
        notes.append(f"stop_at={cfg.stop_at} ends the run before its last step ({stages.total_steps:,}).")
    return stages.total_steps, sum(s.num_steps for s in stages.stages if s.kl_beta)


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
    facts = facts or model_facts(cfg)
    device = resolve_device(device_type, cfg.speed_monitor.gpu_flops_available)
    m, notes = cfg.model, list[str]()
    max_steps, kl_steps = _max_steps(cfg, instances_per_epoch, notes)
    total_tokens = None if max_steps is None else max_steps * cfg.tokens_per_batch
    train_flops = None if total_tokens is None else float(facts.flops_per_token) * total_tokens
    if train_flops is not None and kl_steps:
        # The reference's forward pass is a third of a training step's 6N (2N forward, 4N backward).
        reference = facts.flops_per_token / 3 * kl_steps * cfg.tokens_per_batch
        train_flops += reference
        notes.append(
            f"FLOPs include the KL reference's forward passes ({kl_steps:,} steps, {format_count(reference)})."
        )
    memory = estimate_memory(cfg, facts, world_size, device, cfg.device_train_microbatch_size)
    capacity, rate = device.memory_bytes, world_size * (device.peak_flops or 0.0) * mfu
    wall = train_flops / rate if train_flops is not None and rate else None
    in_tokens = cfg.scheduler.units == SchedulerUnits.tokens
    autocast = device.is_gpu and cfg.autocast_precision is not None
    duration = (
        cfg.max_duration if cfg.max_duration is not None else "stages" if cfg.stages else DEFAULT_MAX_DURATION
    )
    overhead = "10% allocator headroom and 1 GiB CUDA context" if device.is_gpu else "a 0.35 GB process baseline"
    notes.append(f"Memory: weights, gradients, optimizer state, one micro-batch's activations, {overhead}.")
    gb = 1e9
    return RunPlan(
        run_name=cfg.run_name,
        num_params=facts.num_params,
        num_non_embedding_params=facts.num_non_embedding_params,
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
        distributed=_distributed(cfg, world_size),
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
            f"{p.num_params:,} total, {p.num_non_embedding_params:,} non-embedding (d_model "
            f"{p.d_model}, {p.n_layers} layers, {p.n_heads} heads)",
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
