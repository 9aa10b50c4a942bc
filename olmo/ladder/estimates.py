"""What a run needs of a device, worked out without allocating anything: the device's memory and peak FLOP/s
(:func:`resolve_device`), the model's counts from its own code built on the meta device (:func:`model_facts`), and
the memory our training step keeps per device (:func:`estimate_memory`). :mod:`olmo.ladder.run_planner` plans runs
with them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import LayerNormType, ModelConfig, ShardingStrategy
from ..distributed.launch_memory import meta_model, state_bytes_per_param
from ..distributed.parallelize import apply_activation_checkpointing
from ..distributed.run_shape import RunShape
from ..exceptions import OLMoConfigurationError
from ..model.flops import _MIN_CPU_SHARE, PeakFlops, cpu_peak_flops, gpu_peak_flops
from ..model.loss import FUSED_LOSS_CHUNK_TOKENS

__all__ = [
    "DeviceSpec",
    "ModelFacts",
    "MemoryEstimate",
    "resolve_device",
    "model_facts",
    "estimate_memory",
    "shard_degree",
]

GPUS_PER_NODE = 8
"""Devices per node assumed for hybrid sharding when ``fsdp.hybrid_sharding_num_model_replicas`` is not set."""
CUDA_CONTEXT_BYTES = 1 << 30
"""Device memory the CUDA context and NCCL take outside PyTorch's allocator (not in ``max_memory_allocated``)."""
COMPILED_ACTIVATIONS = 0.835
"""What compiled blocks save for the backward pass, as a share of what eager blocks save (H200, bf16: OLMo-300M 0.86,
OLMo-1B 0.81; RESEARCH_LOG 2026-11-26's table against this estimate)."""
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
        return DeviceSpec(name, False, memory, peak.flops, _cpu_peak_source(peak))
    flops = gpu_peak_flops(name)
    source = f"the dense bf16 peak of {name}" if flops else "unknown (set speed_monitor.gpu_flops_available)"
    return DeviceSpec(name, True, memory, flops, source)


MAX_PEAK_CACHE_BYTES = 1 << 20
"""The CPU peak cache holds a few entries of a hundred bytes; a larger file is not read."""


def _cpu_peak_source(peak: PeakFlops) -> str:
    """Where a CPU's peak FLOP/s came from and how it was measured: the best of short fp32 matmuls, taken when the
    machine was idle or, provisionally, while other work was running (then the peak is likely low and the time
    estimated from it long, until a run on an idle machine measures it again)."""
    entry: object = None
    path = peak.cache_file
    try:
        if path is not None and path.is_file() and path.stat().st_size <= MAX_PEAK_CACHE_BYTES:
            entry = json.loads(path.read_text()).get(peak.cache_key)
    except (OSError, ValueError, AttributeError):
        entry = None
    how = f"{peak.source}: the best of a few 1-2k fp32 matmuls"
    if not isinstance(entry, dict) or not isinstance(entry.get("cpu_share"), (int, float)):
        return how
    when = f" on {entry['measured']}" if isinstance(entry.get("measured"), str) else ""
    share = float(entry["cpu_share"])
    if entry.get("idle") is False or share < _MIN_CPU_SHARE:
        return (
            f"{how}, measured{when} while other work was running ({share:.0%} of its threads' time): provisional and "
            f"likely low, so the time is likely long; measured again by the next run on an idle machine, or pin "
            f"speed_monitor.gpu_flops_available"
        )
    return f"{how}, measured{when} on an idle machine"


@dataclass(frozen=True)
class ModelFacts:
    """Counts taken from the model's own code, built on the meta device (nothing allocated)."""

    num_params: int
    num_non_embedding_params: int
    num_active_params: int
    """Parameters that compute on each token (:meth:`OLMo.num_active_params`): ``num_params`` for a dense model."""
    expert_params: int
    """Parameters of the mixture-of-experts layers' experts, all blocks (0 for a dense model)."""
    block_params: int
    """Parameters of one transformer block (every block has the same)."""
    flops_per_token: int
    """Training FLOPs per token at the config's sequence length (:meth:`OLMo.num_flops_per_token`)."""
    checkpointed_blocks: int
    """Blocks whose activations are recomputed in the backward pass (``activation_checkpointing``)."""


def model_facts(run: RunShape) -> ModelFacts:
    """Build ``OLMo(run.model)`` on the meta device, apply the run's activation checkpointing to it (as training
    does), and count."""
    model = meta_model(run.model)
    blocks = model.transformer.typed_blocks()
    checkpointed = 0
    if run.activation_checkpointing is not None:
        apply_activation_checkpointing(model, run.activation_checkpointing)
        # A checkpointed block has its forward (or attention and MLP) replaced by an instance attribute.
        checkpointed = sum(1 for b in blocks if {"forward", "attention", "feed_forward"} & vars(b).keys())
    return ModelFacts(
        num_params=model.num_params(),
        num_non_embedding_params=model.num_params(include_embedding=False),
        num_active_params=model.num_active_params(),
        expert_params=model.num_expert_params(),
        block_params=sum(p.numel() for p in blocks[0].parameters()) if blocks else 0,
        flops_per_token=model.num_flops_per_token(run.model.max_sequence_length),
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
    reference: float = 0.0
    """The frozen reference model's fp32 parameters, this rank's shard (``dpo``; 0 otherwise)."""

    @property
    def tensors(self) -> float:
        """Everything but the overhead, at the step's peak (the loss, or later a recomputed block): comparable to
        ``torch.cuda.max_memory_allocated``."""
        state = self.params + self.grads + self.optimizer + self.gathered_params + self.reference
        return state + self.activations + max(self.loss, self.recompute)

    @property
    def total(self) -> float:
        return self.tensors + self.overhead


def shard_degree(run: RunShape, world_size: int) -> int:
    """Over how many ranks FSDP splits parameters, gradients and optimizer state (a tensor-parallel group's ranks
    hold different parts of a block and the same copy of the rest: FSDP shards over the data-parallel ranks)."""
    return run.layout(world_size, GPUS_PER_NODE).shard


def _block_activation_bytes(m: ModelConfig, compute: int, residual: int, tp: int = 1) -> tuple[float, float]:
    """Bytes one block saves for backward per token: (attention part, MLP part), read off ``OLMoBlock``; with
    tensor parallelism of degree ``tp`` the heads' and hidden units' share of one rank (the residual stream and the
    norms' outputs are whole on every rank)."""
    d, head_dim = m.d_model // tp, m.d_model // m.n_heads  # d: the width of this rank's heads
    kv = m.effective_n_kv_heads * head_dim // tp
    hidden = m.effective_mlp_hidden_size // tp
    # Pre-norm input (residual stream) with its per-token statistics, and the projection's copy of the norm output.
    attention = (residual + compute) * m.d_model + 8
    if m.effective_n_kv_heads != m.n_heads and not m.flash_attention:
        # SDPA gets k and v repeated to every query head, and q: rotated, or a view keeping the fused output alive.
        attention += compute * (2 * d + (d if m.rope else d + 2 * kv))
    else:
        attention += compute * (d + 2 * kv)  # the fused q/k/v output (v, a view of it, keeps it alive)
        attention += compute * (d + kv) if m.rope else 0  # the rotated q and k are new tensors
    attention += compute * d + 4 * m.n_heads // tp  # SDPA's output (attn_out's input, a view); log-sum-exp in fp32
    mlp = (residual + compute) * m.d_model + 8
    # ff_proj's output (for SwiGLU kept alive by its two halves, views of it), then the activation's output (SwiGLU:
    # silu of the gate half, and its product with the other half), which ff_out saves: twice the hidden width.
    if m.is_moe and m.moe is not None:
        # Each token's k rows gathered for the experts, their gate and up outputs, silu(gate) and its product with up
        # (w2's input), the expert outputs, and the router's float32 logits and probabilities.
        k, h = m.moe.top_k, m.moe.expert_hidden_size(m)
        mlp += compute * k * (2 * m.d_model + 4 * h) + 4 * 2 * m.moe.num_experts
        shared = m.moe.shared_expert_hidden_size
        hidden = 0 if shared is None else 2 * shared
    mlp += compute * 2 * hidden
    return attention, mlp


@dataclass(frozen=True)
class StageShare:
    """What one pipeline rank holds of the model (:func:`estimate_memory` with pipeline parallelism)."""

    blocks: int
    """Blocks over the rank's stages."""
    root_params: int
    """Parameters outside the blocks: the embedding on the first stage's rank, the final norm and output layer on
    the last's."""
    last: bool
    """Whether the rank computes the loss (it holds the last stage)."""
    held: int
    """Micro-batches whose activations the rank holds at once (:func:`olmo.distributed.pipeline_plan.held_microbatches`)."""


def pipeline_shares(run: RunShape, facts: ModelFacts, world_size: int) -> list[StageShare]:
    """Each pipeline rank's share of the model and of the in-flight micro-batches (see :class:`StageShare`)."""
    from ..distributed.pipeline_plan import block_flops, held_microbatches, split_layers, stage_ranks

    m, pp = run.model, run.pipeline_parallel
    stages = pp.degree * pp.stages_per_rank
    costs, head = block_flops(m, m.max_sequence_length)
    split = split_layers(costs, head, stages)
    ranks = stage_ranks(stages, pp.degree, str(pp.schedule))
    root = facts.num_params - m.n_layers * facts.block_params
    embedding = m.effective_embedding_size * m.d_model + (
        0 if (m.rope or m.alibi or m.nope) else m.max_sequence_length * m.d_model
    )
    microbatches = pp.microbatches or run.grad_accum_steps(world_size)
    shares = []
    for r in range(pp.degree):
        mine = [s for s in range(stages) if ranks[s] == r]
        root_here = (embedding if 0 in mine else 0) + ((root - embedding) if stages - 1 in mine else 0)
        held = held_microbatches(str(pp.schedule), pp.degree, microbatches, r)
        shares.append(StageShare(sum(len(split[s]) for s in mine), root_here, stages - 1 in mine, held))
    return shares


def estimate_memory(
    run: RunShape,
    facts: ModelFacts,
    world_size: int,
    device: DeviceSpec,
    micro_batch: Optional[int] = None,
    stage: Optional[StageShare] = None,
) -> MemoryEstimate:
    """Peak memory of one device for ``run`` on ``world_size`` ranks of ``device``.

    Counts fp32 parameters, gradients and optimizer state split over the ranks that shard them (FULL_SHARD and
    SHARD_GRAD_OP over all ranks, HYBRID_SHARD within a node of :data:`GPUS_PER_NODE`, NO_SHARD and DDP not at
    all); the gathered bf16 copies FSDP computes with (the root unit, plus two blocks for FULL_SHARD or every
    block for SHARD_GRAD_OP); the activations one micro-batch saves (per block, as ``OLMoBlock`` computes, only
    block inputs under activation checkpointing); and the larger of the logits' peak (or, with ``fused_loss``,
    one chunk's) and a checkpointed block rebuilt in the backward pass. Dropout masks and the attention bias of ``generate_doc_lengths`` / ALiBi are not counted.

    With pipeline parallelism, the largest of the pipeline ranks' estimates, each for its share of the model
    (:func:`pipeline_shares`): its blocks and its part of the embedding and output layer, the activations of the
    micro-batches it holds at once, and the loss on the last stage's rank alone.

    :param micro_batch: instances per forward pass; ``device_train_microbatch_size`` by default.
    :param stage: one pipeline rank's share (None: the whole model, or every rank's with pipeline parallelism).
    """
    m = run.model
    if stage is None and run.pipeline_parallel.degree > 1 and world_size > 1:
        pp = run.pipeline_parallel
        if micro_batch is None and pp.microbatches:  # the device batch over the pipeline's micro-batches
            device_batch = run.global_train_batch_size // max(1, run.layout(world_size).data_parallel_size)
            micro_batch = max(1, device_batch // pp.microbatches)
        estimates = [
            estimate_memory(run, facts, world_size, device, micro_batch, share)
            for share in pipeline_shares(run, facts, world_size)
        ]
        return max(estimates, key=lambda e: e.total)
    n_layers = m.n_layers if stage is None else stage.blocks
    micro = micro_batch or run.device_train_microbatch_size
    layout = run.layout(world_size, GPUS_PER_NODE)
    cp = layout.context if world_size % layout.context == 0 else 1
    tokens = micro * m.max_sequence_length // cp  # this rank's tokens (context parallelism: a share of each)
    autocast = device.is_gpu and run.autocast_precision is not None
    compute = 2 if autocast else 4
    shard, tp = layout.shard, layout.tensor
    # FSDP gathers each unit even over one data-parallel rank (tensor parallelism on every rank): copies all the same.
    fsdp_units = world_size > 1 and (shard > 1 or tp > 1)
    mixed = fsdp_units and autocast and run.fsdp is not None and run.fsdp.precision is not None
    residual = compute if mixed else 4  # FSDP's bf16 parameters make the embedding output bf16
    # A rank's copy of the model: a tensor-parallel rank holds 1/tp of each block (biases and QK-norm included).
    P = facts.num_params - m.n_layers * facts.block_params * (1 - 1 / tp)
    if stage is not None:
        P = stage.root_params + n_layers * facts.block_params / tp
    params, grads = 4 * P / shard, 4 * P / shard
    if device.is_gpu and run.grad_accum_steps(world_size) == 1:
        grads = 0.0  # the peak is the first backward's start: no gradient exists yet (zero_grad frees them)
    optimizer = state_bytes_per_param(str(run.optimizer.name))[2] * P / shard

    gathered = 0.0
    if fsdp_units:
        unit = compute if mixed else 4
        root = facts.num_params - m.n_layers * facts.block_params if stage is None else stage.root_params
        keep_all = run.fsdp is not None and run.fsdp.sharding_strategy in GATHERED_STRATEGIES
        blocks = n_layers if keep_all else min(2, n_layers)
        block = float(facts.block_params) / tp
        if layout.expert > 1:  # each rank gathers only its own share of the experts
            block -= facts.expert_params / m.n_layers * (1 - 1 / layout.expert)
        # The unsharded gradient of the block being reduced, in the reduce dtype (fp32 unless pure bf16).
        gathered = unit * (root + blocks * block) + 4 * block
    elif autocast:
        gathered = compute * P  # autocast caches a low-precision copy of every weight during the forward pass

    attention, mlp = _block_activation_bytes(m, compute, residual, tp)
    full_block = attention + mlp
    if run.activation_checkpointing == "fine_grained":
        # The norms stay outside the checkpoints; each checkpoint saves its (fp32 under autocast) input.
        norm_out = 4 if autocast and m.layer_norm_type != LayerNormType.low_precision else compute
        kept = 2 * (residual + norm_out) * m.d_model
        if device.is_gpu and run.compile is not None:
            # Compiled, the partitioner recomputes the norms too: the block keeps its input alone, as with
            # whole_layer (OLMo-1B at micro-batch 32 on the H200: 54,148 MiB measured, 80,688 estimated before).
            kept = residual * m.d_model
        recompute = max(attention, mlp)
    else:
        kept, recompute = residual * m.d_model, full_block  # a checkpointed block saves only its input
    checkpointed = facts.checkpointed_blocks
    if stage is not None:  # the stage's share of the checkpointed blocks
        checkpointed = round(checkpointed * n_layers / m.n_layers)
    if device.is_gpu and run.compile is not None:
        # Compiled blocks fuse the elementwise work (norms, RoPE, SwiGLU), whose intermediates eager mode saves.
        full_block *= COMPILED_ACTIVATIONS
    activations = tokens * ((n_layers - checkpointed) * full_block + checkpointed * kept)
    if stage is None or stage.last:
        activations += tokens * m.d_model * (residual + compute)  # ln_f's input and the output layer's
    gathered_kv = 0.0
    if cp > 1:
        # Each attention layer keeps the gathered keys and values of the whole sequence (its own share is counted
        # above; a checkpointed block gathers them again in the backward pass). Each of a rank's two chunks attends
        # to the prefix ending with it, under a mask in the compute dtype shared by the layers (c x c(2 cp + 1)
        # elements for chunks of c tokens; per instance with documents): one per window size, and one for full
        # attention unless it is plain causal on a GPU (which needs none).
        seq = m.max_sequence_length
        heads = m.effective_n_kv_heads // tp  # this rank's key/value heads
        gathered_kv = micro * 2 * heads * (m.d_model // m.n_heads) * compute * (seq - seq // cp)
        activations += (m.n_layers - checkpointed) * gathered_kv
        chunk = seq // (2 * cp)
        documents = run.data.generate_doc_lengths
        masks = len({w for w in m.layer_windows() if w is not None and w < seq})
        masks += 1 if documents or not device.is_gpu else 0
        activations += masks * (micro if documents else 1) * chunk * chunk * (2 * cp + 1) * compute

    vocab = m.effective_embedding_size
    kept_by_loss = 0  # what the loss keeps for the backward pass, beside a recomputed block
    if run.fused_loss and not run.dpo:  # DPO needs each answer's log-probability: the logits exist
        chunk = min(tokens, FUSED_LOSS_CHUNK_TOKENS)
        # One chunk's fp32 logits, their softmax and its gradient; the hidden states' and the weight's gradients.
        kept_by_loss = 4 * tokens * m.d_model + 4 * vocab * m.d_model
        loss = 3 * 4 * chunk * vocab + kept_by_loss
    else:
        # The logits (in the compute dtype), then cross entropy's fp32 log-probabilities and their gradient (the
        # same compiled: measured on the H200).
        loss = tokens * vocab * (compute + 2 * 4)
    recompute = tokens * recompute + kept_by_loss + gathered_kv if checkpointed else 0.0
    if stage is not None:  # the micro-batches in flight each keep their activations; the loss is the last's
        activations *= stage.held
        if not stage.last:
            loss, recompute = 0, recompute - kept_by_loss if checkpointed else 0.0

    reference = 4 * P / shard if run.dpo else 0.0
    estimate = MemoryEstimate(params, grads, optimizer, gathered, activations, loss, recompute, 0.0, reference)
    overhead = FRAGMENTATION * estimate.tensors + CUDA_CONTEXT_BYTES if device.is_gpu else CPU_BASELINE_BYTES
    return dataclasses.replace(estimate, overhead=overhead)
