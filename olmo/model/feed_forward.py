"""A block's feed-forward parts: the dense MLP (:class:`DenseFeedForward`: ``ff_out(act(ff_proj(x)))``) and the
mixture of experts (:class:`RoutedFeedForward`: ``model.moe``'s routed experts, plus the dense MLP as its shared
expert when there is one).

Like the sequence mixers, a feed-forward is a part of a block's class (:func:`olmo.model.block.block_class`): its
layers are the block's own attributes (``ff_proj``, ``ff_out``, ``moe``), so that parameter names stay OLMo's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ActivationType, ModelConfig
from .init import init_normal, init_tensor
from .moe import MoEFeedForward

__all__ = ["DenseFeedForward", "RoutedFeedForward"]


class DenseFeedForward(nn.Module):
    """The dense MLP: ``ff_proj`` (for SwiGLU the up and gate halves stacked), the activation, ``ff_out``."""

    config: ModelConfig

    def _build_feed_forward(self, config: ModelConfig) -> None:
        """Create the MLP's layers (``model.mlp_ratio`` or ``model.mlp_hidden_size`` wide)."""
        self._build_dense_mlp(config, config.effective_mlp_hidden_size)
        self.moe: MoEFeedForward | None = None
        """The mixture of experts (``model.moe``), None in a dense block."""

    def _build_dense_mlp(self, config: ModelConfig, hidden: int) -> None:
        """``ff_out`` and ``ff_proj`` for ``hidden`` projected units (twice the activation's inputs for SwiGLU);
        both None when ``hidden`` is 0."""
        bias = config.include_bias
        ff_in = hidden // 2 if config.activation_type == ActivationType.swiglu else hidden
        self.ff_out: nn.Linear | None = nn.Linear(ff_in, config.d_model, bias=bias) if hidden else None
        self.ff_proj: nn.Linear | None = nn.Linear(config.d_model, hidden, bias=bias) if hidden else None

    def _reset_feed_forward_inputs(self, std: float, cutoff: float | None) -> None:
        """Draw the input projection (``ff_proj``)."""
        if self.ff_proj is not None:
            init_normal(self.ff_proj, std, cutoff)

    def _reset_feed_forward_outputs(self, out_std: Callable[[int], float], cutoff: float | None) -> None:
        """Draw the output projection (``ff_out``) with the std ``out_std`` gives its fan-in."""
        if self.ff_out is not None:
            init_normal(self.ff_out, out_std(self.ff_out.in_features), cutoff)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP: ``ff_out(act(ff_proj(x)))``, (B, T, C) -> (B, T, C)."""
        return self._dense_mlp(x)

    def _dense_mlp(self, x: torch.Tensor) -> torch.Tensor:
        assert self.ff_proj is not None and self.ff_out is not None
        h = self.ff_proj(x)  # (B, T, hidden)
        act = self.config.activation_type
        if act == ActivationType.swiglu:
            up, gate = h.chunk(2, dim=-1)  # 2 x (B, T, hidden/2)
            h = F.silu(gate) * up
        elif act == ActivationType.gelu:
            h = F.gelu(h)
        else:
            h = F.relu(h)
        return self.ff_out(h)


class RoutedFeedForward(DenseFeedForward):
    """The mixture of experts (``moe``, :class:`~olmo.model.moe.MoEFeedForward`), plus the dense MLP (``ff_proj``,
    ``ff_out``) as its shared expert when ``model.moe.shared_expert_hidden_size`` is set."""

    def _build_feed_forward(self, config: ModelConfig) -> None:
        """Create the shared expert, if any, and the routed experts."""
        moe = config.moe
        assert moe is not None and config.is_moe
        shared = moe.shared_expert_hidden_size
        self._build_dense_mlp(config, 0 if shared is None else 2 * shared)
        self.moe = MoEFeedForward(
            config.d_model,
            moe.num_experts,
            moe.top_k,
            moe.expert_hidden_size(config),
            moe.norm_topk_prob,
            lb_weight=moe.lb_loss_weight / config.n_layers,
            z_weight=moe.z_loss_weight / config.n_layers,
            lb_per_instance=moe.lb_loss_granularity == "instance",
        )

    def _reset_feed_forward_inputs(self, std: float, cutoff: float | None) -> None:
        """Draw the router and the experts' gate and up projections, then the shared expert's ``ff_proj``."""
        assert self.moe is not None
        for weight in (self.moe.router.weight, self.moe.w1, self.moe.w3):
            init_tensor(weight, std, cutoff)
        super()._reset_feed_forward_inputs(std, cutoff)

    def _reset_feed_forward_outputs(self, out_std: Callable[[int], float], cutoff: float | None) -> None:
        """Draw the experts' down projections (as ``ff_out``), then the shared expert's ``ff_out``."""
        assert self.moe is not None
        init_tensor(self.moe.w2, out_std(self.moe.w2.shape[1]), cutoff)
        super()._reset_feed_forward_outputs(out_std, cutoff)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts plus the shared expert, if any, (B, T, C) -> (B, T, C)."""
        assert self.moe is not None
        y = self.moe(x)
        return y if self.ff_proj is None else y + self._dense_mlp(x)
