"""A mixture-of-experts feed-forward layer (OLMoE's): dropless token-choice top-k routing over SwiGLU experts.

Built into every block by ``model.moe`` (:class:`~olmo.config.MoEConfig`).

- **Router**: a bias-free linear map to one logit per expert, computed in float32 whatever the autocast dtype
  (``router_logits``). Each token goes to its ``top_k`` most probable experts (softmax over all experts, then the
  top ``k``); with ``norm_topk_prob`` (not OLMoE's default) the ``k`` weights are rescaled to sum to 1.
- **Dropless**: every (token, expert) assignment is computed, whatever the imbalance; there is no capacity factor
  and no token is dropped. The assignments are sorted by expert and each expert's contiguous run goes through its
  weights in one grouped matrix multiply (``torch._grouped_mm``: no host synchronization, since the group sizes stay
  on the device); where that kernel cannot run (fp32 on CUDA, or rows that are not 16-byte multiples), a loop over
  the experts touches each expert's tokens once, reading the group sizes on the host.
- **The permutation both ways is gathers** (:func:`permutation`, :func:`dispatch`, :func:`combine`): into expert
  order, row ``i`` copies token ``token_of[i]``; back, each token gathers its ``k`` weighted rows and adds them in
  its experts' order. Each one's backward is the other's forward, so neither direction scatter-adds (atomics on a
  GPU, a sort in the backward of indexing), the sum has one fixed order (deterministic on a GPU too), and compiled,
  the gather, the combine weights and the sum fuse into one kernel. On a CPU the forward adds exactly as
  ``index_add_`` did, so fp32 values are bitwise unchanged; so is the input's gradient at ``top_k`` 1 and 2, while
  from 3 on (OLMoE's 8) the indexing backward it replaces added in another order (a difference of rounding).
- **Auxiliary losses** (per layer, from the same router output): the load-balancing loss of Switch/OLMoE as
  transformers computes it, ``E * sum_e f_e * P_e`` with ``f_e`` the assignments to expert ``e`` per token and
  ``P_e`` its mean router probability (1 for a perfectly balanced router with ``top_k = 1``, ``top_k`` in general),
  and the router z-loss of ST-MoE, the mean over tokens of ``logsumexp(logits)^2``. In training, each layer's
  ``lb_weight * load_balancing_loss / top_k + z_weight * router_z_loss`` (the weights already divided by the number of
  layers: a mean over layers, MegaBlocks' normalization, which OLMoE's published weights refer to) enters the
  backward pass through the layer's own output (:class:`_AttachAuxLoss`, scaled by :attr:`MoEFeedForward.aux_scale`),
  so that the gradient reaches the router while FSDP holds the layer's weights gathered, also under activation
  checkpointing; the training loss the trainer reports stays the cross entropy.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .compile_guards import eager_in_compiled

__all__ = [
    "MoEFeedForward",
    "MoELayerStats",
    "RouterOutput",
    "route",
    "Permutation",
    "permutation",
    "dispatch",
    "combine",
    "load_balancing_loss",
    "router_z_loss",
    "grouped_mm_runs",
    "swiglu_experts",
]


class RouterOutput(NamedTuple):
    """Where each of N tokens goes: ``experts`` (N, k) expert indices and ``weights`` (N, k) float32 combine weights;
    ``probs`` (N, E) and ``logits`` (N, E) float32, for the auxiliary losses."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = False) -> RouterOutput:
    """Token-choice top-k routing of (N, E) router logits (computed in float32)."""
    logits = logits.float()
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return RouterOutput(experts, weights, probs, logits)


def load_balancing_loss(routing: RouterOutput, groups: int = 1) -> torch.Tensor:
    """``E * sum_e (assignments to e / N) * mean_n probs[n, e]`` (transformers' OLMoE ``load_balancing_loss_func``
    for one layer): its minimum, ``top_k``, is reached when the router spreads both evenly. With ``groups`` > 1,
    the N tokens are that many equal consecutive groups (the instances of a batch), each balanced on its own, and
    the loss is the mean over the groups."""
    n_tokens, n_experts = routing.probs.shape
    per_group = n_tokens // groups
    group_of = torch.arange(n_tokens, device=routing.experts.device).div(per_group, rounding_mode="floor")
    slots = (group_of.unsqueeze(-1) * n_experts + routing.experts).flatten()
    counts = _count(slots, groups * n_experts).view(groups, n_experts).float()  # (G, E)
    probs = routing.probs.view(groups, per_group, n_experts).mean(dim=1)  # (G, E)
    return n_experts * torch.sum(counts / per_group * probs, dim=-1).mean()


def _count(indices: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of ``0 .. size-1`` occurs in ``indices``: ``bincount`` of a fixed length (which compiles to a
    static shape; ``bincount`` itself is as long as the largest index)."""
    return torch.zeros(size, dtype=torch.int64, device=indices.device).index_add_(
        0, indices, torch.ones_like(indices)
    )


def router_z_loss(routing: RouterOutput) -> torch.Tensor:
    """The mean over tokens of ``logsumexp(logits)^2`` (ST-MoE): keeps the router's logits small."""
    return torch.logsumexp(routing.logits, dim=-1).square().mean()


def grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes (M, K) ``x`` against (E, K, N) ``weight`` here: rows of 16-byte multiples
    (K and N), as the kernel asks; on a CPU in any float dtype, on CUDA in bf16."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cpu", "cuda"):
        return False
    if x.device.type == "cuda" and not x.dtype == weight.dtype == torch.bfloat16:
        return False
    return (x.shape[-1] * x.element_size()) % 16 == 0 and (weight.shape[-1] * weight.element_size()) % 16 == 0


def swiglu_experts(
    rows: torch.Tensor, weights: tuple[torch.Tensor, ...], ends: torch.Tensor, grouped: bool
) -> torch.Tensor:
    """The SwiGLU experts ``(w1, w3, w2)`` on rows sorted by expert (expert ``e`` owning ``ends[e-1]:ends[e]``)."""
    w1, w3, w2 = weights
    hidden = F.silu(_expert_matmul(rows, w1, ends, grouped)) * _expert_matmul(rows, w3, ends, grouped)
    return _expert_matmul(hidden, w2, ends, grouped)


def _expert_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Rows of ``x`` sorted by expert, expert ``e`` owning rows ``ends[e-1]:ends[e]``, each times ``weight[e]``."""
    if grouped:
        return torch._grouped_mm(x, weight, offs=ends)
    return _loop_matmul(x, weight, ends)


@eager_in_compiled  # the group sizes on the host: compiled code breaks its graph here
def _loop_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    # The group sizes on the host: one synchronization per call on a GPU. split and unbind (not a slice per
    # expert) so that the backward pass assembles each gradient once instead of adding E full-size zero tensors.
    ends_list = ends.tolist()
    sizes = [end - start for start, end in zip([0, *ends_list[:-1]], ends_list)]
    return torch.cat([rows @ w for rows, w in zip(x.split(sizes), weight.unbind(0))])


class Permutation(NamedTuple):
    """Where the N * k (token, expert) assignments of N tokens go when sorted by expert (stably: within an expert,
    by token). ``order`` (N * k,): the assignment (``n * k + j``, token ``n``'s ``j``-th choice) of each sorted row;
    ``token_of`` (N * k,): the token of each sorted row; ``rows_of`` (N, k): each token's sorted rows, ascending
    (so in the order of its experts); ``counts`` (E,): rows per expert. All on the device: no host synchronization."""

    order: torch.Tensor
    token_of: torch.Tensor
    rows_of: torch.Tensor
    counts: torch.Tensor


def permutation(experts: torch.Tensor, num_experts: int) -> Permutation:
    """The sort by expert of (N, k) expert indices (:class:`Permutation`)."""
    n_tokens, top_k = experts.shape
    assignments = experts.flatten()
    order = torch.argsort(assignments, stable=True)
    token_of = order // top_k
    rows_of = torch.argsort(token_of, stable=True).view(n_tokens, top_k)
    return Permutation(order, token_of, rows_of, _count(assignments, num_experts))


def _gather_rows(x: torch.Tensor, token_of: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of the result is ``x[token_of[i]]``."""
    return x.index_select(0, token_of)


def _sum_rows(rows: torch.Tensor, rows_of: torch.Tensor) -> torch.Tensor:
    """Row ``n`` of the result is the sum of ``rows[rows_of[n, j]]`` over ``j``, added in that order (one after the
    other, as a scatter-add over the sorted rows adds them on a CPU)."""
    n_tokens, top_k = rows_of.shape
    picked = rows.index_select(0, rows_of.flatten()).view(n_tokens, top_k, rows.shape[-1])
    total = picked[:, 0]
    for j in range(1, top_k):
        total = total + picked[:, j]
    return total.contiguous()


class _Permute(torch.autograd.Function):
    """Into expert order (``to_experts``: tokens (N, C) -> their k copies sorted by expert (N * k, C), a gather) or
    back (rows sorted by expert -> each token's sum of its k rows). Each direction's backward is the other's forward:
    a gather and k - 1 additions, or a gather, where differentiating the indexing would scatter-add (atomics on a
    GPU, or a sort)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, token_of: torch.Tensor, rows_of: torch.Tensor, to_experts: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(token_of, rows_of)
        ctx.to_experts = to_experts
        return _gather_rows(x, token_of) if to_experts else _sum_rows(x, rows_of)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        token_of, rows_of = ctx.saved_tensors
        return (_sum_rows(grad, rows_of) if ctx.to_experts else _gather_rows(grad, token_of)), None, None, None


def dispatch(x: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Tokens (N, C) -> their k copies sorted by expert (N * k, C)."""
    return _Permute.apply(x, perm.token_of, perm.rows_of, True)


def combine(rows: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Rows sorted by expert (N * k, C) -> each token's sum of its k rows, added in its experts' order (N, C)."""
    return _Permute.apply(rows, perm.token_of, perm.rows_of, False)


class ExpertParallelGroup(Protocol):
    """What the layer uses of expert parallelism (``olmo.distributed.expert_parallel.ExpertGroup``)."""

    @property
    def degree(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def gather(self, weight: torch.Tensor) -> torch.Tensor: ...

    def exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor: ...

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor: ...


class MoELayerStats(NamedTuple):
    """What one training forward of a layer measured, detached: its load-balancing loss (normalized, 1 at best),
    router z-loss, and the (E,) float count of assignments per expert."""

    lb_loss: torch.Tensor
    z_loss: torch.Tensor
    counts: torch.Tensor


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also sends ``scale`` as the gradient of the scalar ``aux``: the auxiliary
    loss is differentiated when the layer's output gradient arrives, inside FSDP's window for the layer."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class MoEFeedForward(nn.Module):
    """``num_experts`` SwiGLU experts of hidden size ``hidden_size`` behind a top-``top_k`` router, (B, T, C) ->
    (B, T, C). After each forward, :attr:`routing` holds that forward's router output, detached (to inspect it).

    Weights: ``router`` (E, C); ``w1`` (E, C, H) gate and ``w3`` (E, C, H) up projections, ``w2`` (E, H, C) down
    projection, stacked over the experts so that one grouped multiply serves them all.
    """

    matrix_params = ("w1", "w3", "w2")
    """The stacked expert matrices: weight-decayed like linear weights (``olmo.optim.get_param_groups``)."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        norm_topk_prob: bool = False,
        device: torch.device | str | None = None,
        lb_weight: float = 0.0,
        z_weight: float = 0.0,
        lb_per_instance: bool = True,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(d_model, num_experts, bias=False, device=device)
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, hidden_size, device=device))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, hidden_size, device=device))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, d_model, device=device))
        self.use_grouped_mm = True
        """False: always the loop over experts (to compare the two paths)."""
        self.routing: RouterOutput | None = None
        self.lb_weight, self.z_weight = lb_weight, z_weight
        """The auxiliary losses' weights in the training loss (a layer's share: divided by the number of layers)."""
        self.lb_per_instance = lb_per_instance
        """Balance each instance of a (B, T, C) input on its own (a mean over instances: the same whatever the
        micro-batches and ranks), or else the whole input at once."""
        self.aux_scale = 1.0
        """The gradient of this layer's weighted auxiliary loss in the next backward: the micro-batch's share of the
        step (set by the train module before each micro-batch)."""
        self.expert_group: ExpertParallelGroup | None = None
        """Set by expert parallelism (``expert_parallel.degree`` > 1): this rank computes only its share of the
        experts, for the tokens of every rank of its group."""
        self.stats: MoELayerStats | None = None
        """The last training forward's measurements (None before one, or after :meth:`take_stats`)."""
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for weight in (self.router.weight, self.w1, self.w3, self.w2):
            nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, C)
        with torch.autocast(flat.device.type, enabled=False):  # the router in float32, also under autocast
            logits = F.linear(flat.float(), self.router.weight.float())  # (N, E)
        routing = route(logits, self.top_k, self.norm_topk_prob)
        self.routing = RouterOutput(*(t.detach() for t in routing))  # detached: the module stays copyable
        perm = permutation(routing.experts, self.num_experts)
        order, counts = perm.order, perm.counts
        ends = torch.cumsum(counts, dim=0).to(torch.int32)
        # The experts compute in the autocast dtype (autocast leaves 3-D weights and these ops alone, and the norm
        # before this layer returns float32 under autocast), so that bf16 training reaches the bf16 grouped kernel.
        device = flat.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else flat.dtype
        flat = flat.to(dtype)
        rows = dispatch(flat, perm)  # (N * k, C), sorted by expert
        if self.expert_group is None:
            weights = tuple(w.to(dtype) for w in (self.w1, self.w3, self.w2))
            out = swiglu_experts(rows, weights, ends, self._grouped(rows, weights))  # (N * k, C)
        else:
            out = self._experts_in_parallel(rows, counts, dtype)
        out = out * routing.weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        y = combine(out, perm).reshape(shape)
        if not (self.training and torch.is_grad_enabled()):
            return y
        groups = shape[0] if self.lb_per_instance and len(shape) == 3 else 1
        lb = load_balancing_loss(routing, groups) / self.top_k
        z = router_z_loss(routing)
        self.stats = MoELayerStats(lb.detach(), z.detach(), counts.float())
        if self.lb_weight == 0 and self.z_weight == 0:
            return y
        return _AttachAuxLoss.apply(y, self.lb_weight * lb + self.z_weight * z, self.aux_scale)

    def _grouped(self, rows: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> bool:
        """Whether the experts run as one grouped multiply here (else as the loop). Compiled, the grouped kernel
        traces in bf16 only (its shape function refuses other dtypes)."""
        traceable = rows.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
        return (
            self.use_grouped_mm
            and traceable
            and grouped_mm_runs(rows, weights[0])
            and grouped_mm_runs(rows, weights[2])
        )

    @eager_in_compiled  # host-side sizes and collectives: left to eager mode inside a compiled block
    def _experts_in_parallel(self, rows: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The experts' outputs for ``rows`` (sorted by expert; ``counts`` per expert), computed on the EP ranks that
        hold them: rows out by expert owner, this rank's experts over everyone's rows, and the results back."""
        group = self.expert_group
        assert group is not None
        local = self.num_experts // group.degree
        incoming = group.exchange_counts(counts)  # (degree, local): rows each rank sends for each of my experts
        send = counts.view(group.degree, local).sum(dim=1)
        sizes = torch.cat([send, incoming.sum(dim=1)]).tolist()  # one host sync for both
        send_list, recv_list = sizes[: group.degree], sizes[group.degree :]
        received = group.exchange(rows, send_list, recv_list)  # grouped by source rank, then by my expert
        expert_of = (
            torch.arange(local, device=rows.device).repeat(group.degree).repeat_interleave(incoming.flatten())
        )
        order = torch.argsort(expert_of, stable=True)  # by my expert, then by source rank
        weights = tuple(group.gather(w).to(dtype) for w in (self.w1, self.w3, self.w2))
        ends = torch.cumsum(incoming.sum(dim=0), dim=0).to(torch.int32)
        computed = swiglu_experts(received[order], weights, ends, self._grouped(received, weights))
        back = torch.empty_like(computed).index_copy_(0, order, computed)  # source rank order again
        return group.exchange(back, recv_list, send_list)

    def take_stats(self) -> MoELayerStats | None:
        """The last training forward's measurements, once (cleared, so a later eval cannot report stale ones)."""
        stats, self.stats = self.stats, None
        return stats
