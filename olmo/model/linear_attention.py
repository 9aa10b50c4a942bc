"""Gated DeltaNet as a block's sequence mixer (:class:`GatedDeltaNetMixer`), OLMo Hybrid's linear-attention layer:
a recurrence whose state does not grow with the sequence, computed chunk by chunk in pure PyTorch
(:mod:`olmo.model.delta_rule`).

Like :class:`~olmo.model.attention_mixer.AttentionMixer` it is a part of a block's class
(:func:`olmo.model.block.block_class`, for the layers ``model.layer_types`` makes ``linear_attention``): its layers
are the block's own attributes. Their names are transformers' (``OlmoHybridGatedDeltaNet``), so a checkpoint maps
one to one: ``transformer.blocks.{i}.{name}`` is ``model.layers.{i}.linear_attn.{name}`` for ``q_proj``, ``k_proj``,
``v_proj``, ``a_proj``, ``b_proj``, ``g_proj``, ``o_proj``, ``conv1d``, ``A_log``, ``dt_bias`` and ``o_norm``; the
block's ``attn_norm`` is the layer's ``input_layernorm`` and ``ff_norm`` its ``post_attention_layernorm`` (the
layer is pre-norm), ``ff_proj`` the MLP's ``up_proj`` and ``gate_proj`` stacked, ``ff_out`` its ``down_proj``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LinearAttentionConfig, ModelConfig
from ..exceptions import OLMoConfigurationError
from .attention import DocumentSpans
from .context_attention import ContextAttention
from .delta_rule_kernels import CHUNK_SIZE, gated_delta_rule
from .init import assign_full, init_normal
from .layers import RotaryTables
from .recurrent_cache import LayerCache, RecurrentState, conv_window

__all__ = ["GatedDeltaNetMixer", "GatedRMSNorm", "causal_conv", "CHUNK_SIZE"]

A_LOG_RANGE = (0.0, 16.0)
"""``A`` (the decay rate per head) is drawn uniformly from this range; ``A_log`` holds its log (transformers)."""
DT_RANGE, DT_FLOOR = (0.001, 0.1), 1e-4
"""The step ``dt`` (softplus of ``a_proj(x) + dt_bias``) starts log-uniform in this range, at least the floor."""
OUTPUT_NORM_EPS = 1e-5
"""Epsilon of the gated output norm (flash-linear-attention's ``FusedRMSNormGated``, as transformers keeps it)."""


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, scaled by a learned weight shared by the heads, then times ``silu(gate)``
    (in fp32; the result in the input's dtype).

    :param size: The head size the norm runs over.
    """

    def __init__(self, size: int, eps: float = OUTPUT_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x and gate (..., size) -> (..., size)."""
        dtype = x.dtype
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, resets: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution of (B, T, D) ``x`` with the (D, 1, K) ``weight``: position t mixes t - K + 1 .. t
    of its own channel. With ``resets`` ((B, T) bool, True at each document's first token), positions of an earlier
    document count as zeros, as the first positions of a sequence do."""
    K, T = weight.shape[-1], x.shape[1]
    if resets is None:
        return F.conv1d(x.transpose(1, 2), weight, padding=K - 1, groups=x.shape[-1])[..., :T].transpose(1, 2)
    document = resets.to(torch.int32).cumsum(dim=1)  # (B, T) index of each position's document
    out = x * weight[:, 0, K - 1]
    for lag in range(1, min(K, T)):
        same = (document[:, lag:] == document[:, :-lag]).unsqueeze(-1)  # (B, T - lag, 1)
        earlier = x[:, :-lag] * same * weight[:, 0, K - 1 - lag]  # (B, T - lag, D)
        out = out + F.pad(earlier, (0, 0, lag, 0))
    return out


class GatedDeltaNetMixer(nn.Module):
    """Gated DeltaNet (OLMo Hybrid's linear attention): q, k and v projected from the residual stream, each through a
    short causal convolution and SiLU; q and k L2-normalised (q then scaled by ``key_head_dim ** -0.5``); per value
    head a decay ``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)`` and a write strength
    ``beta = sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``); the delta rule; each head's output through
    the gated RMSNorm with ``g_proj(x)`` as the gate; ``o_proj``. Without biases, as transformers has it.

    Value heads outnumbering key heads share them in groups (head h reads key head ``h // (values / keys)``).
    """

    config: ModelConfig
    layer_id: int
    is_recurrent = True

    def _build_mixer(self, layer_id: int, config: ModelConfig) -> None:
        """Create the layer's projections, convolution, decay parameters and output norm."""
        la = config.linear_attention
        assert la is not None, "validation requires model.linear_attention with linear_attention layers"
        self.linear_attention: LinearAttentionConfig = la
        self.num_key_heads, self.num_value_heads = la.key_heads(config), la.value_heads(config)
        self.key_head_dim, self.value_head_dim = la.key_dim(config), la.value_dim(config)
        key_dim = self.num_key_heads * self.key_head_dim
        value_dim = self.num_value_heads * self.value_head_dim
        d = config.d_model
        self.window: int | None = None
        self.q_proj = nn.Linear(d, key_dim, bias=False)
        self.k_proj = nn.Linear(d, key_dim, bias=False)
        self.v_proj = nn.Linear(d, value_dim, bias=False)
        self.a_proj = nn.Linear(d, self.num_value_heads, bias=False)
        self.b_proj = nn.Linear(d, self.num_value_heads, bias=False)
        self.g_proj = nn.Linear(d, value_dim, bias=False)
        self.o_proj = nn.Linear(value_dim, d, bias=False)
        channels = 2 * key_dim + value_dim
        kernel = la.conv_kernel_size
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_value_heads))
        self.o_norm = GatedRMSNorm(self.value_head_dim)

    def _reset_mixer_inputs(self, std: float, cutoff: float | None) -> None:
        """Draw the projections that read the residual stream and the convolution from N(0, std) (transformers
        draws every matrix of the layer so), then ``A_log`` and ``dt_bias`` as transformers does (every draw from
        the CPU generator, as :func:`~olmo.model.init.init_tensor` does, so a seed gives the same weights anywhere)."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj, self.g_proj):
            init_normal(proj, std, cutoff)
        init_normal(self.conv1d, std, cutoff)  # type: ignore[arg-type]
        n = self.num_value_heads
        low, high = A_LOG_RANGE
        assign_full(self.A_log, torch.empty(n).uniform_(low, high).log())  # a sharded parameter keeps its slice
        log_min, log_max = math.log(DT_RANGE[0]), math.log(DT_RANGE[1])
        dt = torch.exp(torch.rand(n) * (log_max - log_min) + log_min).clamp(min=DT_FLOOR)
        assign_full(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.o_norm.reset_parameters()

    def _reset_mixer_outputs(self, out_std: Callable[[int], float], cutoff: float | None) -> None:
        """Draw the output projection (``o_proj``) with the std ``out_std`` gives its fan-in."""
        init_normal(self.o_proj, out_std(self.o_proj.in_features), cutoff)

    def attention(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None = None,
        rope: object = None,
        doc_spans: object = None,
        context_parallel: object = None,
    ) -> torch.Tensor:
        """The mixer, (B, T, C) -> (B, T, C). For this mixer ``attn_bias`` is the (B, T) bool mask of document
        starts (True at each document's first token), where the recurrent state and the convolution's window reset;
        None: one sequence per row. It takes no RoPE; doc spans and context parallelism are refused before here."""
        del rope, doc_spans
        if context_parallel is not None:
            raise OLMoConfigurationError(
                "context_parallel.degree > 1 is not implemented for linear_attention layers (model.layer_types)."
            )
        return self.mix(x, attn_bias)

    def _attend(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None,
        rope: RotaryTables | None,
        doc_spans: DocumentSpans | None,
        layer_past: LayerCache | None,
        context_parallel: ContextAttention | None = None,
    ) -> tuple[torch.Tensor, LayerCache]:
        """The mixer (B, T, C) -> (B, T, C) after the cached state ``layer_past`` (None: from the start), and the
        state after these T positions; ``attn_bias`` is the (B, T) bool mask of document starts, or None."""
        del rope, doc_spans, context_parallel
        assert layer_past is None or isinstance(layer_past, RecurrentState), "an attention layer's cache"
        out, state = self.mix_with_state(x, attn_bias, layer_past)
        assert state is not None, "mix_with_state keeps the state unless told not to"
        return out, state

    def mix(self, x: torch.Tensor, resets: torch.Tensor | None = None) -> torch.Tensor:
        """Gated DeltaNet over (B, T, C) ``x``; ``resets`` (B, T) bool marks document starts."""
        return self.mix_with_state(x, resets, keep_state=False)[0]

    def mix_with_state(
        self,
        x: torch.Tensor,
        resets: torch.Tensor | None = None,
        past: RecurrentState | None = None,
        keep_state: bool = True,
    ) -> tuple[torch.Tensor, RecurrentState | None]:
        """:meth:`mix` continuing from ``past`` (the state after earlier positions; None: the sequence's start),
        and the state after ``x`` (without ``keep_state``, training's forward, its delta-rule state is not kept,
        which lets the kernels run)."""
        B, T, _ = x.shape
        initial = None if past is None else past.state  # (B, Hv, dk, dv)
        Hk, Hv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)  # (B, T, 2 Hk dk + Hv dv)
        qkv, window = self._convolve(qkv, resets, past)
        qkv = F.silu(qkv)
        q, k, v = qkv.split((Hk * dk, Hk * dk, Hv * dv), dim=-1)
        v = v.reshape(B, T, Hv, dv)
        beta = self.b_proj(x).float().sigmoid()  # (B, T, Hv)
        if self.linear_attention.allow_neg_eigval:
            beta = beta * 2.0
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())  # (B, T, Hv)
        q, k = q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk)
        out, state = gated_delta_rule(q, k, v, g, beta, resets, initial_state=initial, keep_state=keep_state)
        out = out.to(x.dtype)  # (B, T, Hv, dv)
        gate = self.g_proj(x).reshape(B, T, Hv, dv)
        out = self.o_proj(self.o_norm(out, gate).reshape(B, T, Hv * dv))
        if state is None:
            return out, None
        return out, RecurrentState(window, state, T if past is None else past.length + T)

    def _convolve(
        self, qkv: torch.Tensor, resets: torch.Tensor | None, past: RecurrentState | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The short convolution of the (B, T, D) ``qkv`` after the window cached in ``past``, and the window after
        them (the next position's)."""
        size = self.conv1d.weight.shape[-1] - 1
        if past is not None:
            qkv = torch.cat((past.conv, qkv), dim=1)  # (B, K - 1 + T, D)
            resets = None if resets is None else F.pad(resets, (size, 0))
        out = causal_conv(qkv, self.conv1d.weight, resets)
        return out if past is None else out[:, size:], conv_window(qkv, resets, size)
