"""Optimizers that can skip a step without asking the host: the update is computed on the device with a *step
factor* (a 0-dim tensor, 1 to apply the step, 0 to skip it), so a skip decided on the device from the step's loss
and gradient norm (:class:`olmo.train.stability.SpikeDetector`) costs no synchronization.

A skipped step leaves everything as it was, bitwise: the parameters, the moments and the step count (non-finite
gradients never reach them). :class:`SkipStepAdamW` is torch's own fused AdamW driven through its ``found_inf``
input; :class:`SkipStepLionW` computes :class:`~olmo.optim.LionW`'s update with the factor. The state is the plain
optimizer's, so checkpoints move between the plain and the skip-step optimizer (turning ``stability.skip_spikes``
on or off when resuming works).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch

from .lion import LionW
from .local import local_tensor

__all__ = ["SkipStepAdamW", "SkipStepLionW", "StepFactorMixin"]


class StepFactorMixin:
    """``step_factor``: None (apply every step, as the plain optimizer) or a 0-dim float tensor on the parameters'
    device that the next :meth:`step` multiplies its update by (set before every step)."""

    step_factor: Optional[torch.Tensor] = None

    def _factor(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        factor = self.step_factor
        if factor is None:
            factor = torch.ones((), device=device)
        factor = factor.to(device=device, dtype=torch.float32)
        return factor, factor > 0


class SkipStepAdamW(StepFactorMixin, torch.optim.AdamW):
    """torch's fused AdamW (the same kernel a CUDA run uses without skipping), skipped through the ``found_inf`` input
    that its fused kernel takes for mixed-precision loss scaling: with ``found_inf`` 1 the kernel leaves parameters
    and moments as they are and the step count is put back, all on the device. :attr:`step_factor` 0 sets it."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if self.step_factor is not None:
            self.found_inf = 1.0 - self.step_factor.float()  # read by torch's fused AdamW
        return super().step(closure)


class SkipStepLionW(StepFactorMixin, LionW):
    """:class:`~olmo.optim.LionW` (without ``selective_updates``) whose update is scaled by :attr:`step_factor`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, group: dict[str, Any]) -> None:
        lr, weight_decay = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        param, grad, exp_avg = local_tensor(p), local_tensor(grad), local_tensor(exp_avg)
        factor, keep = self._factor(param.device)
        grad = torch.where(keep, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
        param.mul_(1.0 - lr * weight_decay * factor)
        update = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
        param.sub_(update * (lr * factor))
        exp_avg.lerp_(grad, (1.0 - beta2) * factor)
