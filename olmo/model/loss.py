"""The language-model loss: summed next-token cross entropy and z-loss over labelled positions.

Two ways to compute the same sums (the trainer divides them by the global label count, see
:mod:`olmo.train`):

* :func:`cross_entropy_sums` takes the logits, as the original OLMo does.
* :func:`fused_output_loss` (``fused_loss: true``) takes the final hidden states and the output weight and
  never holds the logits of a whole micro-batch. It walks the tokens in chunks of ``chunk_size``; for each
  chunk it computes the logits, the loss and, right away, the gradients with respect to the hidden states
  and the weight (softmax minus one-hot, through the two backward matmuls). The backward pass then only
  scales those gradients. With a 50k vocabulary the plain path keeps several (N, V) tensors alive around
  the loss (the logits, their fp32 copy inside the loss, the gradient); the fused path keeps one
  (chunk, V) fp32 buffer plus gradients the size of the hidden states and of the weight, for the same
  three matmuls of FLOPs.

Both include every column of the (padded) embedding in the softmax, as OLMo does.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "FUSED_LOSS_CHUNK_TOKENS",
    "LossSums",
    "OutputHead",
    "cross_entropy_loss",
    "cross_entropy_sums",
    "fused_loss_fn",
    "fused_output_loss",
    "next_token_labels",
    "per_token_cross_entropy",
]

FUSED_LOSS_CHUNK_TOKENS = 2048
"""Tokens per chunk of the fused loss: a (2048, 50304) fp32 buffer is 0.4 GB, and 2048-row matmuls keep
a GPU's tensor cores busy."""


class LossSums(NamedTuple):
    total: torch.Tensor
    """``ce + z``, the tensor to call ``backward`` on (scaled as the trainer needs)."""
    ce: torch.Tensor
    """Summed cross entropy, detached (for metrics)."""
    z: Optional[torch.Tensor]
    """Summed z-loss (already times its multiplier), detached; None without z-loss."""
    kl: Optional[torch.Tensor] = None
    """Summed ``KL(policy || reference)`` over the labelled positions, detached; None without a reference."""
    ce_rows: Optional[torch.Tensor] = None
    """(B,) the cross entropy summed per row (instance), detached, when asked for (``per_row``); else None."""


def cross_entropy_sums(
    logits: torch.Tensor,
    labels: torch.Tensor,
    z_loss_multiplier: Optional[float],
    ce_weight: float = 1.0,
    per_row: bool = False,
) -> LossSums:
    """Summed cross entropy (and z-loss) of ``logits`` over labels that are not -100.

    :param logits: (..., V) predictions for the *next* token at each position.
    :param labels: (...) target ids, -100 where no loss is taken.
    :param z_loss_multiplier: weight of ``logsumexp(logits)**2``, or None for no z-loss.
    :param ce_weight: ``total`` is ``ce_weight * ce + z`` (``ce`` itself is reported unweighted).
    :param per_row: also return ``ce_rows``, the sums over the last dimension of ``labels`` (per instance).
    """
    flat_logits = logits.reshape(-1, logits.size(-1))  # (N, V)
    flat_labels = labels.reshape(-1)  # (N,)
    ce_rows = None
    if per_row:
        per_token = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="none")  # (N,)
        ce = per_token.sum()
        ce_rows = per_token.detach().reshape(-1, labels.size(-1)).sum(dim=-1)  # (B,)
    else:
        ce = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
    weighted = ce if ce_weight == 1.0 else ce * ce_weight
    if not z_loss_multiplier:
        return LossSums(weighted, ce.detach(), None, None, ce_rows)
    valid = flat_labels != -100
    upcast = flat_logits.to(torch.promote_types(flat_logits.dtype, torch.float32))
    z = z_loss_multiplier * (torch.logsumexp(upcast, dim=-1)[valid] ** 2).sum()
    return LossSums(weighted + z, ce.detach(), z.detach(), None, ce_rows)


def fused_output_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    z_loss_multiplier: Optional[float],
    logit_scale: float = 1.0,
    bias: Optional[torch.Tensor] = None,
    chunk_size: int = FUSED_LOSS_CHUNK_TOKENS,
    ce_weight: float = 1.0,
    reference: Optional[OutputHead] = None,
    kl_beta: float = 0.0,
    per_row: bool = False,
) -> LossSums:
    """The sums of :func:`cross_entropy_sums` for ``logits = (hidden @ weight.T + bias) * logit_scale``,
    computed chunk by chunk without keeping the logits.

    Under autocast the matmuls run in the autocast dtype (as ``F.linear`` would) and the softmax in fp32.
    The returned ``total`` supports one backward pass.

    :param hidden: (..., C) final hidden states.
    :param weight: (V, C) output projection (the embedding matrix when weights are tied).
    :param bias: (V,) output bias, or None.
    :param labels: (...) target ids, -100 where no loss is taken.
    :param ce_weight: ``total`` is ``ce_weight * ce + z (+ kl_beta * kl)``.
    :param reference: a frozen reference model's output head on the same tokens; then the sum over labelled
        positions of the exact ``KL(softmax(logits) || softmax(reference logits))`` is computed in the same
        chunks (``kl``; each position's KL is clamped at 0 against rounding), and ``kl_beta`` times it is added
        to ``total``. The reference's logits are computed one chunk at a time, too.
    """
    device_type = hidden.device.type
    ref = None if reference is None else (reference.hidden, reference.weight, reference.bias)
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        if ref is not None:
            ref = (ref[0].to(dtype), ref[1].to(dtype), None if ref[2] is None else ref[2].to(dtype))
    row_length = labels.size(-1) if per_row else 0
    hidden = hidden.reshape(-1, hidden.size(-1))  # (N, C)
    labels = labels.reshape(-1)  # (N,)
    if ref is not None:
        ref = (ref[0].reshape(-1, ref[0].size(-1)), ref[1], ref[2])
    need_grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    options = (z_loss_multiplier or 0.0, float(logit_scale), chunk_size, need_grads, float(ce_weight), kl_beta)
    with torch.autocast(device_type, enabled=False):
        total, ce, z, kl, ce_rows = _FusedOutputLoss.apply(hidden, weight, bias, labels, ref, *options, row_length)
    return LossSums(
        total,
        ce,
        z if z_loss_multiplier else None,
        None if reference is None else kl,
        ce_rows if per_row else None,
    )


class OutputHead(NamedTuple):
    """What the output layer of a model computes logits from: ``(hidden @ weight.T + bias) * logit_scale``."""

    hidden: torch.Tensor
    """(..., C) final hidden states."""
    weight: torch.Tensor
    """(V, C)"""
    bias: Optional[torch.Tensor]
    logit_scale: float = 1.0


class _FusedOutputLoss(torch.autograd.Function):
    """Forward computes the loss sums and, when asked, their gradients (for an upstream gradient of 1);
    backward multiplies those by the actual upstream gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        labels: torch.Tensor,
        ref: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]],
        z_mult: float,
        logit_scale: float,
        chunk_size: int,
        need_grads: bool,
        ce_weight: float = 1.0,
        kl_beta: float = 0.0,
        row_length: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = torch.promote_types(hidden.dtype, torch.float32)  # softmax and sums: fp32, or fp64 for fp64
        ce = torch.zeros((), dtype=acc, device=hidden.device)
        # Per row (instance) sums when row_length is given: each chunk's per-token losses are added to their rows.
        n_rows = hidden.size(0) // row_length if row_length else 0
        ce_rows = torch.zeros(n_rows, dtype=acc, device=hidden.device)
        z = torch.zeros_like(ce)
        kl = torch.zeros_like(ce)
        # Gradients are kept in fp32 (fp64 for fp64) until backward has scaled them: scaling a bf16 gradient
        # by a rounded factor would bias every gradient of the step, and summing a 50k-row weight gradient
        # over chunks in fp16 could overflow. One big matmul would also accumulate in fp32 internally.
        grad_hidden = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_grads else None  # (N, C)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_grads else None
        grad_bias = (
            None if bias is None or not need_grads else torch.zeros(bias.shape, dtype=acc, device=bias.device)
        )
        for start in range(0, hidden.size(0), chunk_size):
            h = hidden[start : start + chunk_size]  # (n, C)
            y = labels[start : start + chunk_size]  # (n,)
            logits = (torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())).to(
                acc
            )  # (n, V)
            if logit_scale != 1.0:
                logits.mul_(logit_scale)
            lse = torch.logsumexp(logits, dim=-1)  # (n,)
            mask = (y != -100).to(acc)  # (n,)
            target = y.clamp(min=0)[:, None]  # (n, 1); masked rows point at column 0 and are zeroed by mask
            token_ce = (lse - logits.gather(1, target).squeeze(1)) * mask  # (n,)
            ce += token_ce.sum()
            if row_length:
                rows = torch.arange(start, start + y.size(0), device=hidden.device) // row_length
                ce_rows.index_add_(0, rows, token_ce)
            if z_mult:
                z += z_mult * (lse.square() * mask).sum()
            grad_kl = None
            if ref is not None:
                kl_rows, grad_kl = _kl_chunk(logits, lse, ref, start, chunk_size, logit_scale, acc)
                kl += (kl_rows.clamp(min=0.0) * mask).sum()
            if grad_hidden is None or grad_weight is None:
                continue
            # d(ce + z)/d(logits) = softmax * (1 + 2 * z_mult * lse) - onehot(target), on labelled rows; with
            # ce_weight w and a reference, softmax * (w + 2 * z_mult * lse) - w * onehot + kl_beta * d(kl)/d(logits).
            if grad_kl is None:
                grad_logits = logits.sub_(lse[:, None]).exp_()  # (n, V) softmax, in place of the logits
            else:
                grad_logits = logits  # _kl_chunk left the softmax there
            row_scale = mask * (ce_weight + 2.0 * z_mult * lse) if z_mult or ce_weight != 1.0 else mask
            grad_logits.mul_(row_scale[:, None])
            grad_logits.scatter_add_(1, target, -mask[:, None] if ce_weight == 1.0 else -ce_weight * mask[:, None])
            if grad_kl is not None:
                grad_logits.add_(grad_kl.mul_((kl_beta * mask)[:, None]))
                del grad_kl
            if logit_scale != 1.0:
                grad_logits.mul_(logit_scale)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0)
            g = grad_logits.to(hidden.dtype)  # the matmuls run in the compute dtype, as F.linear's backward would
            if g.dtype == acc:
                torch.mm(g, weight, out=grad_hidden[start : start + chunk_size])
                grad_weight.addmm_(g.t(), h)
            else:
                grad_hidden[start : start + chunk_size] = torch.mm(g, weight)
                grad_weight += torch.mm(g.t(), h)  # promoted element by element, no fp32 copy of the product
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(ce, z, kl, ce_rows)
        total = ce + z if ce_weight == 1.0 else ce_weight * ce + z
        return (total if ref is None else total + kl_beta * kl), ce, z, kl, ce_rows

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, *_: Any) -> tuple[Optional[torch.Tensor], ...]:
        grad_hidden, grad_weight, grad_bias = ctx.grads
        if grad_hidden is None or grad_weight is None:
            raise RuntimeError("fused_output_loss was called without gradients enabled, or backward ran twice.")
        ctx.grads = (None, None, None)  # the stored gradients are handed over, not kept
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        return (
            grad_hidden.mul_(grad_total).to(hidden_dtype),
            grad_weight.mul_(grad_total).to(weight_dtype),
            None if grad_bias is None else grad_bias.mul_(grad_total).to(bias_dtype),
            *([None] * 9),
        )


def _kl_chunk(
    logits: torch.Tensor,
    lse: torch.Tensor,
    ref: tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
    start: int,
    chunk_size: int,
    logit_scale: float,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For one chunk of the fused loss: each row's ``KL(p || r)`` and its gradient with respect to the policy's
    logits, ``p * (log p - log r - KL)``, where ``r`` comes from the reference's hidden states of the same rows.
    Turns ``logits`` (n, V) into the softmax ``p`` in place; allocates one more (n, V) buffer."""
    ref_hidden, ref_weight, ref_bias = ref
    h = ref_hidden[start : start + chunk_size]  # (n, C)
    r = torch.mm(h, ref_weight.t()) if ref_bias is None else torch.addmm(ref_bias, h, ref_weight.t())
    r = r.to(acc)  # (n, V)
    if logit_scale != 1.0:
        r.mul_(logit_scale)
    r.sub_(torch.logsumexp(r, dim=-1, keepdim=True))  # log r
    logits.sub_(lse[:, None])  # log p
    r.neg_().add_(logits)  # log p - log r
    p = logits.exp_()  # (n, V), in place of log p
    r.mul_(p)  # p * (log p - log r)
    kl_rows = r.sum(dim=-1)  # (n,)
    return kl_rows, r.addcmul_(p, kl_rows[:, None], value=-1.0)


def cross_entropy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    compute_z_loss: bool = False,
    z_loss_multiplier: float = 1e-4,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """OLMo's ``olmo.train.cross_entropy_loss``: (N, V) logits and (N,) labels -> the cross entropy (``reduction``
    ``mean``, ``sum`` or ``none``) and, with ``compute_z_loss``, ``z_loss_multiplier * logsumexp(logits)**2`` over
    the labelled positions, reduced alike (its mean is over all N positions, as in OLMo); else None."""
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
    if not compute_z_loss:
        return loss, None
    z_squared = logits.float().logsumexp(dim=-1).pow(2) * (labels != ignore_index)
    if reduction == "mean":
        z_squared = z_squared.mean()
    elif reduction == "sum":
        z_squared = z_squared.sum()
    return loss, z_loss_multiplier * z_squared


fused_loss_fn = cross_entropy_loss
"""OLMo's name for its flash-attn Triton cross entropy; here the same computation as :func:`cross_entropy_loss`
(the memory-saving fused loss of this trainer is :func:`fused_output_loss`, which never builds the logits)."""


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy (B, T) of ``logits`` (B, T, V), in fp32, against ``labels`` (B, T); 0 where a label is -100."""
    flat = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), reduction="none")
    return flat.view(labels.shape)


def next_token_labels(batch: dict[str, Any]) -> torch.Tensor:
    """Next-token targets (B, T) of a batch: position t predicts token t+1; -100 where the label mask or the
    attention mask says no loss, in every row the instance filter dropped, and at the last position, which
    has no next token. A dropped row adds nothing to the loss or to its denominator, the number of labels
    (OLMo divides by B*T instead, so there a dropped row dilutes the batch's loss). Keeping T positions
    lets the loss use the logits as they are: slicing off the last position would make the backward pass
    zero-fill and copy a full (B, T, V) gradient."""
    labels = batch["input_ids"].clone()
    if "label_mask" in batch:
        labels.masked_fill_(~batch["label_mask"], -100)
    if "attention_mask" in batch:
        labels.masked_fill_(batch["attention_mask"] == 0, -100)
    if "instance_mask" in batch:
        labels.masked_fill_(~batch["instance_mask"][:, None], -100)
    return torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), -100)], dim=1)
