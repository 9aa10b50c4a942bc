"""LionW: the Lion optimizer with decoupled weight decay, as in OLMo."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["LionW"]


class LionW(torch.optim.Optimizer):
    """Lion with decoupled weight decay (Chen et al., 2023), as in OLMo.

    Per parameter with a gradient ``g`` and momentum ``m``: ``p *= 1 - lr*wd``;
    ``p -= lr * sign(beta1*m + (1-beta1)*g)``; ``m = beta2*m + (1-beta2)*g``.
    Parameters without a gradient are skipped.

    :param params: Parameters or param groups.
    :param lr: Learning rate.
    :param betas: ``(beta1, beta2)``: the interpolation for the update and the momentum decay.
    :param weight_decay: Decoupled weight decay.
    :param selective_updates: Entries whose gradient is exactly zero get no decay, no update, and keep
        their momentum.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        selective_updates: bool = False,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.selective_updates = selective_updates

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one update to every parameter that has a gradient.

        :param closure: Optional; re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                # By key, not ``len(state)``: the state may already hold clip_grads' grad-norm average.
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self._update(p, p.grad, state["exp_avg"], group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, group: dict[str, Any]) -> None:
        """One parameter's update, in place on ``p`` and its momentum ``exp_avg``, with ``group``'s settings."""
        lr, weight_decay = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        mask = (grad != 0).to(p.dtype) if self.selective_updates else 1.0
        p.mul_(1.0 - mask * (lr * weight_decay))
        update = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
        if self.selective_updates:
            update.mul_(mask)
        p.add_(update, alpha=-lr)
        exp_avg.mul_(1.0 - mask * (1.0 - beta2))
        exp_avg.add_(grad, alpha=1.0 - beta2)
