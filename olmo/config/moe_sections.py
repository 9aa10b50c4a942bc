"""The model's mixture-of-experts option (``model.moe``): OLMoE's sparse feed-forward layer in place of the dense MLP
of every block, with the checks of its values (``problems``). The layer itself is :mod:`olmo.model.moe`.

Absent (or ``num_experts: 0``) the model is dense and computes exactly what it computed before the option existed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .base import BaseConfig

if TYPE_CHECKING:
    from .model_sections import ModelConfig

__all__ = ["MoEConfig", "ExpertParallelConfig", "MAX_EXPERTS", "LB_GRANULARITIES"]

LB_GRANULARITIES = ("instance", "micro_batch")
"""The values of ``model.moe.lb_loss_granularity``."""

MAX_EXPERTS = 4096
"""More experts than any released model has by an order of magnitude (DeepSeek-V3: 256; OLMoE: 64)."""


@dataclass
class MoEConfig(BaseConfig):
    """A mixture of SwiGLU experts in every block (OLMoE-1B-7B: ``{num_experts: 64, top_k: 8, hidden_size: 1024}``).

    Routing is dropless token choice: each token goes to its ``top_k`` most probable experts (softmax over all
    experts in float32), every assignment is computed, and the expert outputs are summed with those probabilities
    as weights. There is no capacity factor, so no token is ever dropped.
    """

    num_experts: int = 0
    """Experts per block; 0 means a dense model (the same as leaving ``model.moe`` out)."""
    top_k: int = 8
    """Experts each token goes to."""
    hidden_size: Optional[int] = None
    """Hidden width of each expert (the size of its gate and up projections); None = half of
    ``model.mlp_hidden_size`` (the width of the dense SwiGLU the same config would build)."""
    norm_topk_prob: bool = False
    """Rescale each token's ``top_k`` weights to sum to 1 (OLMoE: false, the softmax probabilities as they are)."""
    lb_loss_weight: float = 0.01
    """Weight of the load-balancing loss in the training loss (OLMoE: 0.01); 0 leaves it out. The loss of a layer is
    ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the layer's assignments that went to expert ``e`` and
    ``P_e`` its mean router probability (1 when the router spreads both evenly), averaged over the layers, as in the
    MegaBlocks code OLMoE was trained with."""
    lb_loss_granularity: str = "instance"
    """Over which tokens the load-balancing loss balances the experts: ``instance`` (each instance on its own, the loss
    their mean: the same number whatever the micro-batch size and world size, so a run matches itself on any layout)
    or ``micro_batch`` (each micro-batch on each rank as a whole, as MegaBlocks did for OLMoE: a looser constraint,
    which changes with the layout)."""
    z_loss_weight: float = 0.001
    """Weight of the router z-loss (the mean of ``logsumexp(router logits)^2``, averaged over the layers; OLMoE:
    0.001); 0 leaves it out."""
    shared_expert_hidden_size: Optional[int] = None
    """Hidden width of a shared expert every token goes through, added to the routed experts' output (DeepSeek-MoE
    style); None = none (OLMoE, FlexOlmo). Its weights are the block's ``ff_proj`` and ``ff_out``."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def expert_hidden_size(self, model: ModelConfig) -> int:
        return self.hidden_size if self.hidden_size is not None else model.effective_mlp_hidden_size // 2

    def problems(self, model: ModelConfig) -> list[str]:
        """One sentence per bad value of ``model.moe`` in ``model``, each naming the key and the fix."""
        if self.num_experts == 0:
            return []
        out: list[str] = []
        if not 0 < self.num_experts <= MAX_EXPERTS:
            out.append(
                f"model.moe.num_experts={self.num_experts} must be between 1 and {MAX_EXPERTS:,} (0 = a dense model)."
            )
            return out
        if not 1 <= self.top_k <= self.num_experts:
            out.append(
                f"model.moe.top_k={self.top_k} must be between 1 and model.moe.num_experts={self.num_experts} "
                f"(OLMoE: 8 of 64)."
            )
        for name in ("hidden_size", "shared_expert_hidden_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                out.append(f"model.moe.{name}={value} must be positive (or null).")
        if self.hidden_size is None and model.effective_mlp_hidden_size < 2:
            out.append("model.moe.hidden_size is null and model.mlp_hidden_size gives no width; set hidden_size.")
        for name in ("lb_loss_weight", "z_loss_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                out.append(f"model.moe.{name}={value} must be a finite number >= 0 (0 leaves the loss out).")
        if self.lb_loss_granularity not in LB_GRANULARITIES:
            out.append(
                f"model.moe.lb_loss_granularity={self.lb_loss_granularity!r} is not one of "
                f"{', '.join(LB_GRANULARITIES)}."
            )
        if model.activation_type != "swiglu":
            out.append(
                f"model.moe needs model.activation_type=swiglu (the experts are SwiGLU MLPs); it is "
                f"{model.activation_type}."
            )
        if model.include_bias:
            out.append(
                "model.moe with model.include_bias=true: the router and the experts have no biases (as in OLMoE and "
                "FlexOlmo); set --model.include_bias=false."
            )
        return out


@dataclass
class ExpertParallelConfig(BaseConfig):
    """Expert parallelism (top-level ``expert_parallel``, beside ``fsdp``): the experts of every ``model.moe`` layer
    split over ``degree`` ranks, tokens sent to their experts' rank and back (``olmo.distributed.expert_parallel``);
    FSDP shards everything else over all ranks as without it."""

    degree: int = 1
    """Ranks that share each layer's experts (1: none; every rank computes every expert on its own tokens). Must
    divide the world size and ``model.moe.num_experts``."""

    def problems(self, model: ModelConfig, strategy: str, sharding: str, world_size: Optional[int]) -> list[str]:
        """One sentence per reason ``degree`` cannot work for ``model`` on ``world_size`` ranks (None: any number;
        ``--dry_run`` started as one process)."""
        d = self.degree
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            return [f"expert_parallel.degree={d!r} must be a whole number >= 1 (1 = no expert parallelism)."]
        if d == 1:
            return []
        out = []
        if not model.is_moe or model.moe is None:
            return [
                f"expert_parallel.degree={d} needs model.moe (a mixture of experts); set it to 1 for a dense model."
            ]
        if model.moe.num_experts % d:
            out.append(
                f"expert_parallel.degree={d} must divide model.moe.num_experts={model.moe.num_experts} (each rank "
                f"holds num_experts / degree experts)."
            )
        if world_size is not None and world_size % d:
            out.append(
                f"expert_parallel.degree={d} must divide the number of processes launched ({world_size}); launch a "
                f"multiple of {d} with torchrun --nproc_per_node, or change the degree."
            )
        if strategy != "fsdp" or sharding not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            out.append(
                f"expert_parallel.degree={d} works with distributed_strategy=fsdp and fsdp.sharding_strategy "
                f"FULL_SHARD or SHARD_GRAD_OP (got {strategy}, {sharding}); hybrid sharding and DDP with experts "
                f"in parallel are not implemented."
            )
        return out
