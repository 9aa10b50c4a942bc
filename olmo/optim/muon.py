"""Muon: orthogonalized momentum for the hidden weight matrices, AdamW for everything else.

For each 2-D weight of a transformer block (attention and MLP projections), Muon keeps a momentum of the gradient
and replaces the update by the nearest semi-orthogonal matrix to it, computed with a quintic Newton-Schulz
iteration (Jordan et al., 2024): ``O = NS(nesterov(momentum))``, then ``W -= lr * (scale * O + wd * W)``. The
embedding, the output layer, norms and biases take AdamW steps, as Muon practice does. ``scale`` is
``rms_scale * sqrt(max(rows, cols))`` (Moonshot AI's "Muon is scalable", 2025): it gives Muon's update the RMS of a
typical AdamW update, so one ``optimizer.learning_rate`` and one schedule serve both parts, and AdamW's tuned rate
is a good start. A fused matrix (``att_proj``: Q, K and V; ``ff_proj``: the SwiGLU halves) is orthogonalized as one.

Under FSDP2 a matrix is a DTensor sharded along its rows. Each rank gathers the whole momentum-corrected gradient
of each matrix (one all-gather per matrix, the size of the weight), runs Newton-Schulz on it (every rank
redundantly, in float32, so all ranks get the same bits and 2 ranks train as 1 process), and applies its own rows
of the result. The cost over AdamW is that all-gather plus ``2 * ns_steps`` matrix products of the weight's size per
matrix and step on every rank; a distributed variant that gives each rank a share of the matrices is future work.
The state is ``momentum_buffer`` (Muon matrices) and ``step``, ``exp_avg``, ``exp_avg_sq`` (AdamW parameters), each
sharded like its parameter, so checkpoints reshard and convert to unsharded like AdamW's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from .local import local_tensor

__all__ = ["Muon", "newton_schulz", "NS_COEFFICIENTS"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic iteration's (a, b, c): ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` (Jordan et al., 2024)."""


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """An approximately semi-orthogonal matrix with the singular vectors of ``g`` (a 2-D tensor), in float32."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon for the param groups with ``use_muon=True``, AdamW for the others (see the module docstring).

    :param params: param groups; each sets ``use_muon`` (default False).
    :param lr: the learning rate of both parts (Muon's is scaled to AdamW's update RMS).
    :param betas: AdamW's betas.
    :param eps: AdamW's epsilon.
    :param weight_decay: decoupled weight decay of both parts (a group's own value wins).
    :param momentum: Muon's momentum.
    :param nesterov: Muon's Nesterov momentum.
    :param ns_steps: Newton-Schulz iterations.
    :param rms_scale: Muon's update is ``rms_scale * sqrt(max(rows, cols))`` times the orthogonalized matrix.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        rms_scale: float = 0.2,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            rms_scale=rms_scale,
            use_muon=False,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon_update(p, group)
                else:
                    self._adamw_update(p, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if p.dim() != 2:
            raise ValueError(
                f"Muon updates 2-D weights only; a parameter of shape {tuple(p.shape)} is in a Muon group"
            )
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf, mu = state["momentum_buffer"], group["momentum"]
        grad = p.grad
        assert grad is not None
        local_tensor(buf).mul_(mu).add_(local_tensor(grad))
        direction = grad.add(buf, alpha=mu) if group["nesterov"] else buf
        update: torch.Tensor
        if isinstance(direction, DTensor):
            full = newton_schulz(direction.full_tensor(), group["ns_steps"])
            update = distribute_tensor(full, direction.device_mesh, direction.placements, src_data_rank=None)
        else:
            update = newton_schulz(direction, group["ns_steps"])
        lr, wd = group["lr"], group["weight_decay"]
        scale = group["rms_scale"] * math.sqrt(max(p.shape[0], p.shape[1]))
        param = local_tensor(p)
        param.mul_(1.0 - lr * wd)
        param.add_(local_tensor(update).to(param.dtype), alpha=-lr * scale)

    def _adamw_update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        assert p.grad is not None
        param, grad = local_tensor(p), local_tensor(p.grad)
        exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        param.mul_(1.0 - lr * wd)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
