"""The arithmetic of pipeline parallelism (issue 54): which layers each stage holds, which rank holds each stage,
and what a schedule costs in idle time and in held activations. No process group is needed: ``scripts/plan.py``
and ``--dry_run`` size a cluster's pipeline with the same functions the launch uses.

**The split** (:func:`split_layers`): the blocks are cut into ``stages`` runs of consecutive blocks (each at least
one) that minimise the largest stage's training FLOPs per token, counting each block's matrices and attention as
:meth:`olmo.model.OLMo.num_flops_per_token` does (a windowed layer counts its window) and the output layer's matrix
on the last stage; the embedding (a lookup, no FLOPs) goes to the first stage. Of the splits with that largest
stage, the most even one is taken (the least sum of squared stage costs).

**The placement** (:func:`stage_ranks`): ``1f1b`` puts stage ``s`` on pipeline rank ``s``; the interleaved schedules
put stage ``s`` on rank ``s % degree`` (each rank's stages ``degree`` apart); ``zbv`` places two stages per rank in a
V: rank ``r`` holds stages ``r`` and ``2 * degree - 1 - r``, so the first and the last are on rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ModelConfig

__all__ = ["bubble_fraction", "block_flops", "held_microbatches", "split_layers", "stage_ranks"]


def block_flops(model: ModelConfig, seq_len: int) -> tuple[list[int], int]:
    """Each block's training FLOPs per token at context ``seq_len``, and the output layer's."""
    import torch

    from ..config.linear_attention_sections import LINEAR_ATTENTION
    from ..model import OLMo

    with torch.device("meta"):
        built = OLMo(model, init_params=False)
    head_dim = model.d_model // model.n_heads
    out = []
    for block, kind, window in zip(built.transformer.typed_blocks(), model.layer_kinds(), model.layer_windows()):
        params = sum(p.numel() for p in block.parameters())
        if model.is_moe:  # the active experts only, as the MFU counts them
            params -= (built.num_expert_params() - built.num_expert_params(active=True)) // model.n_layers
        flops = 6 * params
        if kind == LINEAR_ATTENTION:
            la = model.linear_attention
            assert la is not None
            flops += 18 * la.value_heads(model) * la.key_dim(model) * la.value_dim(model)
        else:
            flops += 12 * model.n_heads * head_dim * min(window or seq_len, seq_len)
        out.append(flops)
    return out, 6 * model.effective_embedding_size * model.d_model


def split_layers(costs: list[int], head_cost: int, stages: int) -> list[range]:
    """The blocks of each of ``stages`` stages (see the module's docstring): ``costs[i]`` is block ``i``'s, and
    ``head_cost`` is added to the last stage's.

    :raises ValueError: with fewer blocks than stages.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"{stages} stages need at least as many blocks ({n})")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> int:  # blocks i..j-1, with the head when they end the model
        return prefix[j] - prefix[i] + (head_cost if j == n else 0)

    def best_split(score):  # the split minimising the sum of score(stage cost) over its stages (None: impossible)
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(stages + 1)]
        start = [[0] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = 0
        for k in range(1, stages + 1):
            for j in range(k, n + 1):
                for i in range(k - 1, j):
                    value = best[k - 1][i] + score(cost(i, j))
                    if value < best[k][j]:
                        best[k][j], start[k][j] = value, i
        bounds, j = [], n
        for k in range(stages, 0, -1):
            bounds.append(range(start[k][j], j))
            j = start[k][j]
        return bounds[::-1]

    def stages_needed(limit: int) -> float:  # filling stages from the last one, each up to ``limit``
        count, j, i = 0, n, n
        while j > 0:
            i = j - 1
            if cost(i, j) > limit:
                return float("inf")
            while i > 0 and cost(i - 1, j) <= limit:
                i -= 1
            count, j = count + 1, i
        return count

    # First the smallest largest stage: the least candidate stage cost under which the blocks fit in ``stages``
    # stages (fewer can always be split further); then, of the splits under it, the most even one (least sum of
    # squared stage costs).
    candidates = sorted({cost(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    low, high = 0, len(candidates) - 1
    while low < high:
        mid = (low + high) // 2
        if stages_needed(candidates[mid]) <= stages:
            high = mid
        else:
            low = mid + 1
    limit = candidates[low]
    return best_split(lambda c: c * c if c <= limit else float("inf"))


def stage_ranks(stages: int, degree: int, schedule: str) -> list[int]:
    """The pipeline rank (0 .. ``degree - 1``) holding each stage (see the module's docstring)."""
    if schedule == "zbv":
        return [s if s < degree else 2 * degree - 1 - s for s in range(stages)]
    return [s % degree for s in range(stages)]


def bubble_fraction(schedule: str, degree: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step a rank idles in the pipeline's fill and drain, for equal stages whose input-gradient and
    weight-gradient halves of the backward each take a forward's time: ``(p - 1) / (v m + p - 1)`` for 1F1B (``v = 1``)
    and interleaved 1F1B; the zero-bubble schedules run the weight gradients in the bubble, leaving a third of it,
    ``(p - 1) / (3 v m + p - 1)`` (ZB-H1; for ``zbv`` an upper bound: its V needs less filling). These are the
    schedules' ideal figures (``p`` = degree, ``m`` = micro-batches, ``v`` = stages per rank), not measurements."""
    p, m, v = degree, microbatches, stages_per_rank
    if p <= 1:
        return 0.0
    if schedule in ("1f1b", "interleaved_1f1b"):
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * v * m + p - 1)


def held_microbatches(schedule: str, degree: int, microbatches: int, pipeline_rank: int) -> int:
    """The most micro-batches whose activations pipeline rank ``pipeline_rank`` holds at once (over all its stages):
    1F1B's warm-up keeps ``degree - rank`` of them; the interleaved and zero-bubble schedules about ``degree`` more
    than that on the first rank; never more than the step's micro-batches."""
    held = degree - pipeline_rank
    if schedule != "1f1b":
        held += degree
    return max(1, min(held, microbatches if schedule == "1f1b" else 2 * microbatches))
