"""Parallelism beyond data parallelism: ``context_parallel`` (each instance's tokens split over ranks) and
``tensor_parallel`` (each layer's matrices split over ranks), top-level sections beside ``fsdp`` and
``expert_parallel``, with the checks of their values against the model and the processes launched (``problems``).

The ranks form one mesh, outermost first: data parallel (what ``fsdp`` shards and replicates over), then context
parallel, then tensor parallel; rank ``r`` is data-parallel rank ``r // (cp * tp)``. Ranks of one context- or
tensor-parallel group read the same instances, so the data order, ``global_indices.npy`` and the batch of every
step are those of a run on ``world_size / (cp * tp)`` ranks. FSDP shards parameters, gradients and optimizer state
over every rank but the tensor-parallel ones (which hold different parts of each block), and checkpoints hold the
canonical tensors, so a checkpoint does not depend on these degrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import BaseConfig

if TYPE_CHECKING:
    from .model_sections import ModelConfig

__all__ = ["ContextParallelConfig", "TensorParallelConfig"]


def _degree_problem(key: str, d: object) -> str | None:
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        return f"{key}={d!r} must be a whole number >= 1 (1 = none)."
    return None


def _split_problems(
    key: str, d: int, model: ModelConfig, strategy: str, world_size: int | None, how: str
) -> list[str]:
    """What neither context nor tensor parallelism does: one process (``single``), and ALiBi's bias, which would have
    to be ``how`` the same way."""
    out = []
    if strategy == "single" and world_size is not None:
        out.append(f"{key}={d} needs distributed_strategy=fsdp or ddp, not single.")
    if model.alibi:
        out.append(
            f"{key}={d} with model.alibi is not implemented (ALiBi's bias would have to be {how} the same way); "
            f"use RoPE, or {key}=1."
        )
    return out


@dataclass
class ContextParallelConfig(BaseConfig):
    """Context parallelism (OLMo-core's "llama3" scheme, load-balanced): each instance's ``T`` tokens are cut into
    ``2 * degree`` chunks and rank ``r`` of a group computes chunks ``r`` and ``2 * degree - 1 - r`` (one early,
    one late: equal causal work on every rank). Each attention layer all-gathers the keys and values of the whole
    sequence from the group; the queries, activations and logits stay local, so activation memory falls ~1/degree.
    Causal, document (``data.generate_doc_lengths``) and sliding-window masks and RoPE use each token's position in
    the instance, and the loss is normalized over every label of the batch: the same numbers as one process.
    (:mod:`olmo.distributed.context_parallel`.)"""

    degree: int = 1
    """Ranks that share each instance (1: none). Must divide the number of processes, and ``2 * degree`` must
    divide ``model.max_sequence_length``."""

    def problems(self, model: ModelConfig, strategy: str, world_size: int | None, expert_degree: int) -> list[str]:
        """One sentence per reason ``degree`` cannot work for ``model`` on ``world_size`` ranks (None: any number;
        ``--dry_run``)."""
        d = self.degree
        bad = _degree_problem("context_parallel.degree", d)
        if bad or d == 1:
            return [bad] if bad else []
        out = []
        if world_size is not None and world_size % d:
            out.append(
                f"context_parallel.degree={d} must divide the number of processes launched ({world_size}); launch "
                f"a multiple of {d} with torchrun --nproc_per_node, or change the degree."
            )
        if model.max_sequence_length % (2 * d):
            out.append(
                f"context_parallel.degree={d} cuts each instance into 2 x {d} = {2 * d} equal chunks, which "
                f"model.max_sequence_length={model.max_sequence_length} is not divisible into; use a length that "
                f"is a multiple of {2 * d}, or another degree."
            )
        out += _split_problems("context_parallel.degree", d, model, strategy, world_size, "cut")
        if model.has_linear_attention:
            out.append(
                f"context_parallel.degree={d} with linear_attention layers (model.layer_types) is not implemented: "
                f"their recurrent state would have to pass from each rank's chunk to the next (OLMo-core splits "
                f"their heads instead); use context_parallel.degree=1."
            )
        if model.is_moe or expert_degree > 1:
            out.append(
                f"context_parallel.degree={d} with a mixture of experts (model.moe) is not implemented: the "
                f"load-balancing loss balances each instance, whose tokens would be split over ranks; use "
                f"context_parallel.degree=1."
            )
        return out


@dataclass
class TensorParallelConfig(BaseConfig):
    """Tensor parallelism (Megatron's split, with DTensor): each block's ``att_proj`` and ``ff_proj`` are split by
    output rows (column-wise: each rank computes its own attention heads and its share of the MLP's hidden units)
    and ``attn_out`` and ``ff_out`` by input columns (row-wise, their outputs summed over the group), over
    ``degree`` consecutive ranks (innermost: with context parallelism a context-parallel group's ranks are ``degree``
    apart). OLMo 2's QK-norm sums its statistics over the group. Embeddings, the other norms
    and the output layer are replicated within the group and sharded by FSDP over the data-parallel ranks, as every
    parameter is. Checkpoints hold the usual (canonical) tensors, so they do not depend on ``degree``.
    (:mod:`olmo.distributed.tensor_parallel`.)"""

    degree: int = 1
    """Ranks that share each layer's matrices (1: none). Must divide the number of processes, ``model.n_heads``,
    the key/value heads and the MLP's hidden size."""

    def problems(
        self, model: ModelConfig, strategy: str, world_size: int | None, expert_degree: int, context_degree: int
    ) -> list[str]:
        """One sentence per reason ``degree`` cannot work for ``model`` on ``world_size`` ranks (None: any number;
        ``--dry_run``) beside ``expert_parallel.degree`` and ``context_parallel.degree``."""
        d = self.degree
        bad = _degree_problem("tensor_parallel.degree", d)
        if bad or d == 1:
            return [bad] if bad else []
        out = []
        cp = context_degree if isinstance(context_degree, int) and context_degree > 1 else 1
        if world_size is not None and world_size % (d * cp):
            both = f" x context_parallel.degree={cp} = {d * cp}" if cp > 1 else ""
            out.append(
                f"tensor_parallel.degree={d}{both} must divide the number of processes launched ({world_size}); "
                f"launch a multiple of {d * cp} with torchrun --nproc_per_node (one node's GPUs is the usual "
                f"tensor-parallel group), or change the degree."
            )
        if model.has_linear_attention:
            out.append(
                f"tensor_parallel.degree={d} with linear_attention layers (model.layer_types) is not implemented: the "
                f"tensor-parallel plan divides attention heads only, not Gated DeltaNet's; use "
                f"tensor_parallel.degree=1 (FSDP alone)."
            )
        hidden = model.effective_mlp_hidden_size
        mlp = hidden // 2 if str(model.activation_type) == "swiglu" else hidden
        sizes = {
            "model.n_heads": model.n_heads,
            "the key/value heads (model.n_kv_heads)": model.effective_n_kv_heads,
            "the MLP's hidden size (model.mlp_hidden_size / mlp_ratio)": mlp,
        }
        for what, size in sizes.items():
            if size % d:
                out.append(
                    f"tensor_parallel.degree={d} must divide {what} = {size}: each rank computes an equal share; "
                    f"use a degree that divides it."
                )
        out += _split_problems("tensor_parallel.degree", d, model, strategy, world_size, "split by heads")
        if model.is_moe:
            out.append(
                f"tensor_parallel.degree={d} with a mixture of experts (model.moe) is not implemented: split the "
                f"experts with expert_parallel.degree instead."
            )
        if isinstance(expert_degree, int) and expert_degree > 1:
            out.append(
                f"tensor_parallel.degree={d} together with expert_parallel.degree={expert_degree} is not "
                f"implemented; use one of the two (and FSDP across the rest of the ranks)."
            )
        return out
