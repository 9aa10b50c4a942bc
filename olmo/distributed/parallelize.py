"""Everything applied to a built model from the outside: materialization, activation checkpointing,
torch.compile and FSDP2 sharding. The model itself knows nothing of this.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..config import (
    ActivationCheckpointingStrategy,
    CompilerConfig,
    DDPConfig,
    DDPGradSyncMode,
    DistributedStrategy,
    Float8Config,
    FSDPConfig,
    FSDPPrecision,
    ModelConfig,
    ShardingStrategy,
    TrainConfig,
)
from ..model import OLMo
from ..model.compile_guards import install_compile_guards
from .collectives import DistEnv
from .expert_parallel import shard_experts
from .float8 import check_float8_device, convert_float8
from .layout import ParallelLayout
from .tensor_parallel import apply_tensor_parallel, order_fused_rows

log = logging.getLogger(__name__)

__all__ = [
    "ParallelizeOptions",
    "build_model",
    "apply_activation_checkpointing",
    "defer_replica_all_reduce",
    "autocast_dtype",
    "model_config_fingerprint",
]


@dataclass(frozen=True, kw_only=True)
class ParallelizeOptions:
    """What :func:`build_model` applies to the model from the outside: top-level keys of OLMo's config, taken from a
    config by :meth:`from_train_config`. Where the model is split (the meshes) is the layout's
    (:class:`~olmo.distributed.layout.ParallelLayout`)."""

    distributed_strategy: Optional[DistributedStrategy]
    """``distributed_strategy``: ``ddp`` replicates the parameters; ``fsdp`` shards them as ``fsdp`` says."""
    fsdp: Optional[FSDPConfig]
    """``fsdp``: sharding and wrapping strategies, precision (null: the defaults)."""
    activation_checkpointing: Optional[ActivationCheckpointingStrategy]
    """``activation_checkpointing``: which blocks recompute their activations in the backward pass."""
    compile: Optional[CompilerConfig]
    """``compile``: compile each block (null: eager)."""
    autocast_precision: Optional[str]
    """The autocast dtype's name on GPU (``TrainConfig.autocast_precision``; None: fp32)."""
    float32_matmul_precision: str
    """``float32_matmul_precision``, set for the process on GPU."""
    float8: Optional[Float8Config] = None
    """``model.float8``, for a model that trains (None: no float8)."""

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, training: bool = False) -> ParallelizeOptions:
        """The options of ``cfg``; ``training``: for the model the run trains, which alone takes ``model.float8``
        (a frozen reference, evaluation, generation and conversion compute in their usual precision)."""
        return cls(
            distributed_strategy=cfg.distributed_strategy,
            fsdp=cfg.fsdp,
            activation_checkpointing=cfg.activation_checkpointing,
            compile=cfg.compile,
            autocast_precision=cfg.autocast_precision,
            float32_matmul_precision=cfg.float32_matmul_precision,
            float8=cfg.model.float8 if training and cfg.model.trains_float8 else None,
        )


def build_model(
    cfg: ModelConfig, layout: ParallelLayout, options: ParallelizeOptions, init_params: bool = True
) -> OLMo:
    """Build ``OLMo(cfg)`` on the meta device, apply activation checkpointing, compile and (with several ranks)
    tensor, expert and FSDP2 sharding over ``layout``'s meshes from the outside as ``options`` say, then materialize
    and initialize the parameters directly on the training device, so no rank ever holds a full copy it does not
    need.

    :param layout: the launch's layout (``ParallelLayout.of_run(train_config, env)``; one process:
        ``ParallelLayout.single(env)``).
    :param options: ``ParallelizeOptions.from_train_config(train_config)``.
    :param init_params: initialize the parameters; without it they are left uninitialized (for weights about to
        be loaded or copied in) and no random numbers are drawn.
    """
    if isinstance(layout, DistEnv):  # the signature before the layout: fine for one process, ambiguous for more
        if layout.world_size > 1:
            raise TypeError(
                "build_model takes the launch's ParallelLayout, not a DistEnv, with several processes: pass "
                "ParallelLayout.of_run(train_config, env), which says how the ranks share the model."
            )
        layout = ParallelLayout.single(layout)
    env = layout.launch
    model = meta_build(cfg, layout, options)
    tp_mesh = layout.tensor_mesh
    fsdp_mesh = layout.fsdp_mesh
    if options.float8 is not None and options.float8.enabled:  # before compile and FSDP, as torchao asks
        check_float8_device(options.float8, env.device)
        if cfg.is_moe:
            log.warning(
                "model.float8 converts the attention and shared-expert linear layers only: the routed experts' "
                "grouped products stay in their usual precision (torchao's float8 grouped products are not wired)."
            )
        # Float8 all-gathers on NCCL only: gloo has no float8 type (a unit of float8 weights alone cannot gather).
        convert_float8(model, options.float8, fsdp=fsdp_mesh is not None and env.device.type == "cuda")
    if options.activation_checkpointing is not None:
        apply_activation_checkpointing(model, options.activation_checkpointing)
    if options.compile is not None:
        compile_blocks(model, _moe_compile_options(cfg, options, layout))
    experts: set[torch.nn.Parameter] = set()
    expert_mesh = layout.expert_mesh if cfg.is_moe else None
    if expert_mesh is not None:
        experts = set(shard_experts(model, expert_mesh))
    elif layout.expert > 1:
        # Training refuses this before it starts; evaluating or converting a checkpoint in fewer processes than it was
        # trained on runs every expert on every rank instead.
        log.warning(
            f"expert_parallel.degree={layout.expert} is not used here ({env.world_size} process(es)): each rank holds "
            f"every expert."
        )
    if layout.context > 1 and cfg.flash_attention:
        log.warning(
            "model.flash_attention is not used with context_parallel.degree=%d: each rank attends to the gathered "
            "keys with a mask of positions, which runs on PyTorch SDPA.",
            layout.context,
        )
    if fsdp_mesh is not None:
        _shard(model, options, env, experts, fsdp_mesh)
    model.to_empty(device=env.device)
    if init_params:
        model.reset_parameters()
        if tp_mesh is not None:  # drawn in the canonical order, as one process draws them
            order_fused_rows(model)
    return model


def meta_build(cfg: ModelConfig, layout: ParallelLayout, options: ParallelizeOptions) -> OLMo:
    """``OLMo(cfg)`` on the meta device for the launch of ``layout``, each block split over its tensor-parallel group
    when the layout has one (on CUDA the fp32 matmul precision is set first)."""
    if layout.launch.device.type == "cuda":
        # Process-wide, so set before the first matmul; "high" lets fp32 matmuls use TF32.
        torch.set_float32_matmul_precision(options.float32_matmul_precision)
    with torch.device("meta"):
        model = OLMo(cfg)
    tp_mesh = layout.tensor_mesh
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    return model


def apply_activation_checkpointing(model: OLMo, strategy: ActivationCheckpointingStrategy) -> None:
    """Recompute the chosen blocks' activations in the backward pass instead of storing them.

    Implemented by wrapping each chosen block's ``forward`` (or, for ``fine_grained``, its ``attention``
    and ``feed_forward``) with non-reentrant ``torch.utils.checkpoint``, so module names and state-dict
    keys do not change. RNG state is preserved when any dropout is active, so recomputation draws the
    same dropout masks.
    """
    cfg = model.config
    preserve_rng = max(cfg.attention_dropout, cfg.residual_dropout, cfg.embedding_dropout) > 0
    selectors = {
        "whole_layer": lambda i: True,
        "one_in_two": lambda i: i % 2 == 0,
        "one_in_three": lambda i: i % 3 == 0,
        "one_in_four": lambda i: i % 4 == 0,
        "one_in_eight": lambda i: i % 8 == 0,
        "two_in_three": lambda i: i % 3 != 0,
        "three_in_four": lambda i: i % 4 != 0,
        "fine_grained": lambda i: True,
    }
    names = ("attention", "feed_forward") if strategy == "fine_grained" else ("forward",)
    for block in model.transformer.typed_blocks():
        if selectors[str(strategy)](block.layer_id):
            for name in names:
                setattr(block, name, _checkpointed(getattr(block, name), preserve_rng))


def _checkpointed(fn: Callable[..., torch.Tensor], preserve_rng: bool) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng, **kwargs)

    return wrapper


def defer_replica_all_reduce(options: ParallelizeOptions, ddp: Optional[DDPConfig], env: DistEnv) -> bool:
    """Whether the gradient all-reduce over the ``replicate`` mesh dimension (DDP, NO_SHARD, hybrid sharding)
    should wait for the last micro-batch of a step, as OLMo's ``ddp.grad_sync_mode: batch`` does.

    Not with ``ddp.grad_sync_mode: micro_batch``, and not when gradients are reduced in a low-precision dtype
    (``fsdp.precision: pure`` under autocast): FSDP sums the waiting micro-batches in the reduce dtype, where
    per-micro-batch all-reduces are summed into the fp32 gradient.
    """
    fsdp = options.fsdp or FSDPConfig()
    replicated = options.distributed_strategy == DistributedStrategy.ddp or fsdp.sharding_strategy in (
        ShardingStrategy.NO_SHARD,
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy._HYBRID_SHARD_ZERO2,
    )
    per_micro_batch = ddp is not None and ddp.grad_sync_mode == DDPGradSyncMode.micro_batch
    low_precision_reduce = autocast_dtype(options, env.device) is not None and fsdp.precision == FSDPPrecision.pure
    return env.world_size > 1 and replicated and not per_micro_batch and not low_precision_reduce


def _shard(
    model: OLMo, cfg: ParallelizeOptions, env: DistEnv, experts: set[torch.nn.Parameter], mesh: DeviceMesh
) -> None:
    """Apply FSDP2 per the OLMo options.

    * ``fsdp.sharding_strategy``: FULL_SHARD and HYBRID_SHARD reshard parameters after the forward pass;
      SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 keep them gathered until the backward pass (more memory,
      fewer all-gathers); NO_SHARD and ``distributed_strategy: ddp`` replicate the parameters on every
      rank and all-reduce gradients.
    * ``fsdp.wrapping_strategy``: ``by_block`` (and null, OLMo's single unit, which would all-gather the
      whole model at once) shards every block as its own unit; ``by_block_and_size`` also the embedding
      and output layer (with tied weights the embedding stays in the root unit); ``one_in_N`` only blocks
      ``i % N == 0``, the rest joining the root unit.
    * ``fsdp.precision`` on GPU: ``pure`` computes and reduces in the autocast dtype, ``mixed`` reduces
      gradients in fp32. Parameters are always kept in fp32 for the optimizer.
    * ``experts``: expert-parallel weights, which FSDP leaves to their own mesh.
    * ``mesh``: the layout's FSDP mesh (:attr:`~olmo.distributed.layout.ParallelLayout.fsdp_mesh`).
    """
    from torch.distributed.fsdp import fully_shard

    fsdp = cfg.fsdp or FSDPConfig()
    wrap = str(fsdp.wrapping_strategy or "by_block")
    every = {"one_in_two": 2, "one_in_three": 3, "one_in_four": 4, "one_in_five": 5}.get(wrap, 1)
    kwargs = fsdp_unit_options(cfg, env, mesh)
    if experts:  # expert-parallel weights are sharded over their own mesh (olmo.distributed.expert_parallel)
        kwargs["ignored_params"] = experts
    for block in model.transformer.typed_blocks():
        if block.layer_id % every == 0:
            fully_shard(block, **kwargs)
    if wrap in ("by_block_and_size", "by_block_group_and_size"):
        if model.transformer.ff_out is not None:
            fully_shard(model.transformer.ff_out, **kwargs)
            # A tied embedding stays in the root unit: the output layer reads its weight outside its forward.
            fully_shard(model.transformer.wte, **kwargs)
    # The root unit holds what is left; it is needed right away in backward, so never reshard it.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})


def fsdp_unit_options(cfg: ParallelizeOptions, env: DistEnv, mesh: DeviceMesh) -> dict[str, Any]:
    """The ``fully_shard`` options of a unit under the OLMo options (see :func:`_shard`): the mesh, whether to reshard
    after the forward pass (not for SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2) and the mixed-precision policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fsdp = cfg.fsdp or FSDPConfig()
    reshard = fsdp.sharding_strategy not in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
    dtype = autocast_dtype(cfg, env.device)
    policy = MixedPrecisionPolicy()
    if dtype is not None and fsdp.precision is not None:
        reduce_dtype = torch.float32 if fsdp.precision == FSDPPrecision.mixed else dtype
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    return {"mesh": mesh, "reshard_after_forward": reshard, "mp_policy": policy}


def _moe_compile_options(cfg: ModelConfig, options: ParallelizeOptions, layout: ParallelLayout) -> CompilerConfig:
    """``options.compile``, without ``fullgraph`` where part of each block runs in eager mode: context
    parallelism's all-gather of keys and values, and a mixture of experts that will not compute in bf16 on a GPU
    (there its experts run as a loop over host-side group sizes, which compiled code leaves to eager mode)."""
    compile_cfg = options.compile
    assert compile_cfg is not None
    bf16_gpu = layout.device_type == "cuda" and options.autocast_precision == "bfloat16"
    if compile_cfg.fullgraph and layout.context > 1:
        log.warning(
            "compile.fullgraph=true with context_parallel.degree=%d is not honoured: the keys' and values' all-gather "
            "in each attention layer runs in eager mode, which breaks the block's graph. Compiling with "
            "fullgraph=false.",
            layout.context,
        )
        return replace(compile_cfg, fullgraph=False)
    if compile_cfg.fullgraph and layout.tensor > 1 and cfg.attention_layer_norm:
        log.warning(
            "compile.fullgraph=true with tensor_parallel.degree=%d and model.attention_layer_norm is not honoured: "
            "the QK-norm's sums over the group run in eager mode, which breaks the block's graph. Compiling with "
            "fullgraph=false.",
            layout.tensor,
        )
        return replace(compile_cfg, fullgraph=False)
    if not (cfg.is_moe and compile_cfg.fullgraph and not bf16_gpu):
        return compile_cfg
    log.warning(
        "compile.fullgraph=true with model.moe is not honoured here: the experts' grouped multiply compiles in bf16 "
        "on a GPU only (precision amp_bf16 on CUDA); elsewhere they run as a loop over experts in eager mode, "
        "which breaks the block's graph. Compiling with fullgraph=false."
    )
    return replace(compile_cfg, fullgraph=False)


def compile_blocks(model: OLMo, cfg: CompilerConfig) -> None:
    """Compile each block separately: one small graph reused by every layer compiles fast."""
    install_compile_guards()  # the functions compiled blocks leave to eager mode
    for block in model.transformer.typed_blocks():
        block.compile(mode=cfg.mode, fullgraph=cfg.fullgraph, backend=cfg.backend, dynamic=cfg.dynamic)


_NEWER_MODEL_OPTIONS = ("sliding_window", "rope_scaling", "moe", "layer_types", "linear_attention", "nope")


def model_config_fingerprint(cfg: ModelConfig) -> str:
    """A short hash of the model config, stored in checkpoints to catch mismatched resumes. Options added since
    the hash was introduced are left out while unset, so a model without them keeps the hash it always had. Float8
    is always left out: it changes how training computes, not the model, and a checkpoint resumes with or without it."""
    fields = asdict(cfg)
    del fields["float8"]
    del fields["attention_backend"]  # how attention computes, as float8: not the model
    for name in _NEWER_MODEL_OPTIONS:
        if fields[name] in (None, False) or (name == "moe" and not cfg.is_moe):
            del fields[name]
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Precision(Protocol):
    @property
    def autocast_precision(self) -> Optional[str]: ...


def autocast_dtype(cfg: _Precision, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype for this device, or None for fp32 (``cfg``: anything with ``autocast_precision``, a
    ``TrainConfig`` or :class:`ParallelizeOptions`). CPUs always train in fp32."""
    name = cfg.autocast_precision
    if name is None or device.type != "cuda":
        return None
    return getattr(torch, name)
