"""OLMo's model building blocks under their original names, for code that imports them from ``olmo.model``:
:class:`RMSLayerNorm`, :class:`RotaryEmbedding` and the activations (:class:`Activation`, :class:`GELU`,
:class:`ReLU`, :class:`SwiGLU`). The transformer itself computes the same things inline (:mod:`olmo.model.layers`,
:class:`~olmo.model.OLMoBlock`); these modules are equal to those computations."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ActivationType, LayerNormType, ModelConfig
from ..exceptions import OLMoConfigurationError
from .layers import LayerNorm, apply_rotary, rotary_cos_sin

__all__ = ["RMSLayerNorm", "RotaryEmbedding", "Activation", "GELU", "ReLU", "SwiGLU"]


class RMSLayerNorm(LayerNorm):
    """RMSNorm (computed in fp32) of ``size`` (default ``d_model``), affine as ``config`` says unless given."""

    def __init__(
        self,
        config: ModelConfig,
        size: Optional[int] = None,
        elementwise_affine: Optional[bool] = None,
        eps: float = 1e-5,
    ):
        affine = config.layer_norm_with_affine if elementwise_affine is None else elementwise_affine
        super().__init__(
            size or config.d_model, LayerNormType.rms, eps, affine, bool(config.effective_bias_for_layer_norm)
        )


class RotaryEmbedding(nn.Module):
    """RoPE applied to queries (B, H, Tq, hd) and keys (B, KV, Tk, hd): the keys sit at positions ``0..Tk-1`` and
    the queries at the last ``Tq`` of them (a cache before them), as OLMo's module does.

    :param cache: OLMo's buffer cache; unused (tables are computed per call's device and length).
    """

    def __init__(self, config: ModelConfig, cache: Any = None):
        super().__init__()
        del cache
        self.config = config
        self.head_dim = config.d_model // config.n_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        query_len, key_len = q.shape[-2], k.shape[-2]
        cos, sin = rotary_cos_sin(key_len, self.head_dim, self.config.rope_theta, q.device)
        q_cos, q_sin = cos[key_len - query_len :], sin[key_len - query_len :]
        if self.config.rope_full_precision:
            dtype = q.dtype
            return apply_rotary(q.float(), q_cos, q_sin).to(dtype), apply_rotary(k.float(), cos, sin).to(dtype)
        return apply_rotary(q, q_cos.to(q.dtype), q_sin.to(q.dtype)), apply_rotary(
            k, cos.to(k.dtype), sin.to(k.dtype)
        )


class Activation(nn.Module):
    """An MLP activation; :attr:`output_multiplier` is its output width over its input width."""

    def __init__(self, config: Optional[ModelConfig] = None):
        super().__init__()
        self.config = config

    @property
    def output_multiplier(self) -> float:
        return 1.0

    @classmethod
    def build(cls, config: ModelConfig) -> Activation:
        """The activation ``config.activation_type`` names."""
        kinds = {ActivationType.gelu: GELU, ActivationType.relu: ReLU, ActivationType.swiglu: SwiGLU}
        if config.activation_type not in kinds:
            raise OLMoConfigurationError(f"model.activation_type={config.activation_type!r} is not an activation.")
        return kinds[config.activation_type](config)


class GELU(Activation):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class ReLU(Activation):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)


class SwiGLU(Activation):
    """``silu(gate) * x`` for ``x, gate`` the two halves of the last dimension (as OLMo's SwiGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x

    @property
    def output_multiplier(self) -> float:
        return 0.5
