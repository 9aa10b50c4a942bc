"""The building blocks of :mod:`olmo.model` that hold no block structure: OLMo's layer norms, RoPE and ALiBi,
and the output layer with its loss."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LayerNormType, ModelConfig, RopeScalingConfig
from .loss import LossSums, OutputHead, cross_entropy_sums, fused_output_loss

__all__ = [
    "LayerNorm",
    "OutputHeadFn",
    "OutputLayer",
    "RotaryTables",
    "alibi_bias",
    "apply_rotary",
    "lm_head",
    "make_dropout",
    "output_head_loss",
    "rotary_cos_sin",
    "scaled_inverse_frequencies",
]

RotaryTables = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin), each (T, head_dim) in fp32."""

OutputHeadFn = Callable[[OutputHead], Any]
"""Computes a model's output from its final hidden states and output layer, in place of the logits."""


def make_dropout(p: float) -> nn.Module:
    # Identity instead of Dropout(0) keeps p == 0 (the usual pretraining setting) free of any kernel launch.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class LayerNorm(nn.Module):
    """OLMo's norm variants over the last dimension.

    :param size: Normalized size.
    :param norm_type: ``default`` (F.layer_norm), ``low_precision`` (layer norm in the autocast dtype) or
        ``rms`` (RMSNorm computed in fp32, cast back, then scaled).
    :param eps: Added to the variance.
    :param elementwise_affine: Learnable ``weight``; without it the module has no parameters at all.
    :param bias: Learnable ``bias`` (only with ``elementwise_affine``).
    """

    def __init__(self, size: int, norm_type: LayerNormType, eps: float, elementwise_affine: bool, bias: bool):
        super().__init__()
        self.size = size
        self.norm_type = norm_type
        self.eps = eps
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(size))
            if bias:
                self.bias = nn.Parameter(torch.zeros(size))

    @classmethod
    def build(
        cls, config: ModelConfig, size: int | None = None, elementwise_affine: bool | None = None
    ) -> LayerNorm:
        """A norm configured from ``config``; ``size`` defaults to d_model."""
        return cls(
            size if size is not None else config.d_model,
            config.layer_norm_type,
            config.layer_norm_eps,
            config.layer_norm_with_affine if elementwise_affine is None else elementwise_affine,
            config.effective_bias_for_layer_norm,
        )

    def extra_repr(self) -> str:
        return f"{self.size}, type={self.norm_type}, eps={self.eps}, affine={self.weight is not None}"

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_type == LayerNormType.rms:
            with torch.autocast(x.device.type, enabled=False):
                x_fp32 = x.float()
                x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
                x = x_fp32.to(x.dtype)
            if self.weight is not None:
                x = self.weight * x
                if self.bias is not None:
                    x = x + self.bias
            return x
        weight: torch.Tensor | None = self.weight
        bias: torch.Tensor | None = self.bias
        if self.norm_type == LayerNormType.low_precision and torch.is_autocast_enabled(x.device.type):
            # Autocast would run layer_norm in fp32; cast everything down and run it in bf16/fp16 instead.
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            weight = None if weight is None else weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                return F.layer_norm(x, (self.size,), weight, bias, self.eps)
        return F.layer_norm(x, (self.size,), weight, bias, self.eps)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, scaling: RopeScalingConfig | None = None
) -> RotaryTables:
    """RoPE tables for positions ``0..seq_len-1`` in the NeoX layout: each (T, head_dim), fp32.

    Frequency ``i`` sits at both column ``i`` and column ``i + head_dim/2`` (``cat(freqs, freqs)``). With
    ``scaling`` the frequencies are :func:`scaled_inverse_frequencies` and both tables are multiplied by the
    scaling's attention factor (YaRN's; 1 for llama3), as transformers does.
    """
    if scaling is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float) / head_dim)
    else:
        inv_freq = scaled_inverse_frequencies(head_dim, theta, scaling).to(device)
    positions = torch.arange(seq_len, device=device, dtype=torch.float)
    freqs = torch.outer(positions, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    if scaling is None:
        return emb.cos(), emb.sin()
    factor = scaling.effective_attention_factor
    return emb.cos() * factor, emb.sin() * factor


def scaled_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig) -> torch.Tensor:
    """(head_dim/2,) fp32 RoPE frequencies after ``scaling``, by transformers' definitions (computed on the CPU).

    * ``yarn``: frequency ``i`` is ``theta^(-2i/d)`` blended with it divided by ``factor``; the blend ramps
      linearly from "keep" to "divide" between the dimensions that turn ``beta_fast`` and ``beta_slow`` times
      within ``old_context_len`` (the range floored/ceiled, as transformers does for OLMo 3).
    * ``llama3``: wavelengths longer than ``old_context_len / low_freq_factor`` are divided by ``factor``, those
      shorter than ``old_context_len / high_freq_factor`` kept, and those between smoothly interpolated.
    """
    base = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / theta**base  # (hd/2,)
    factor = scaling.factor
    old = scaling.old_context_len
    if scaling.name == "yarn":

        def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times within `old`
            return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(dimension(scaling.beta_fast)), 0)
        high: float = min(math.ceil(dimension(scaling.beta_slow)), head_dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: the frequency as it is (extrapolation), 0: divided by factor (interpolation)
        pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    assert scaling.name == "llama3", scaling.name
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    divided = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * divided / factor + smooth * divided
    between = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(between, smoothed, divided)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (..., T, head_dim) by the tables from :func:`rotary_cos_sin` ("rotate_half" form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def alibi_bias(n_heads: int, seq_len: int, bias_max: float, device: torch.device) -> torch.Tensor:
    """ALiBi as in OLMo: ``bias[h, i, j] = -|i - j| * 2^-((h+1) * bias_max / n_heads)``, shape (1, H, T, T)."""
    pos = torch.arange(seq_len, device=device, dtype=torch.float)
    distance = -(pos[None, :] - pos[:, None]).abs()  # (T, T)
    slopes = 2.0 ** -(torch.arange(1, n_heads + 1, device=device, dtype=torch.float) * (bias_max / n_heads))
    return (distance[None, :, :] * slopes[:, None, None])[None]  # (1, H, T, T)


def lm_head(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor | None,
    z_loss_multiplier: float | None,
    fused_loss: bool,
    logit_scale: float,
    head: OutputHeadFn | None = None,
) -> tuple[torch.Tensor | None, Any]:
    """Logits ``(x @ weight.T + bias) * logit_scale``, (B, T, C) -> (B, T, V), and with ``labels`` the loss
    sums; with ``fused_loss`` only the loss, computed without the logits. With ``head``, only what
    ``head(OutputHead(x, weight, bias, logit_scale))`` returns (see :meth:`olmo.model.OLMo.forward`)."""
    if head is not None:
        return None, head(OutputHead(x, weight, bias, logit_scale))
    if labels is not None and fused_loss:
        return None, fused_output_loss(x, weight, labels, z_loss_multiplier, logit_scale, bias)
    logits = F.linear(x, weight, bias)  # (B, T, V)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    return logits, None if labels is None else cross_entropy_sums(logits, labels, z_loss_multiplier)


class OutputLayer(nn.Linear):
    """The untied output layer, ``transformer.ff_out``. Its forward also computes the loss, so that FSDP
    gathers the weight for it even when the layer is sharded as a unit of its own."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        z_loss_multiplier: float | None = None,
        fused_loss: bool = False,
        logit_scale: float = 1.0,
        head: OutputHeadFn | None = None,
    ) -> tuple[torch.Tensor | None, Any]:
        return lm_head(x, self.weight, self.bias, labels, z_loss_multiplier, fused_loss, logit_scale, head)


def output_head_loss(
    out: OutputHead,
    labels: torch.Tensor,
    z_loss_multiplier: Optional[float],
    fused: bool,
    ce_weight: float = 1.0,
    reference: Optional[OutputHead] = None,
    kl_beta: float = 0.0,
    per_row: bool = False,
) -> LossSums:
    """The output layer's loss sums (as :func:`olmo.model.layers.lm_head` computes them) with the cross entropy weighted
    by ``ce_weight`` in ``total``; with a ``reference`` head, plus ``kl_beta`` times the exact KL to it (fused);
    ``per_row``: with each instance's cross entropy too (``ce_rows``)."""
    if fused or reference is not None:
        return fused_output_loss(
            out.hidden,
            out.weight,
            labels,
            z_loss_multiplier,
            out.logit_scale,
            out.bias,
            ce_weight=ce_weight,
            reference=reference,
            kl_beta=kl_beta,
            per_row=per_row,
        )
    logits, _ = lm_head(out.hidden, out.weight, out.bias, None, None, False, out.logit_scale)
    assert logits is not None
    return cross_entropy_sums(logits, labels, z_loss_multiplier, ce_weight, per_row)
