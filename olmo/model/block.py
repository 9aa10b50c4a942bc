"""The OLMo block (:class:`OLMoBlock`): a sequence mixer then a feed-forward, each with its norm and residual, and
the KV cache of incremental decoding; OLMo's other block names.

A block's parts are classes of their own, mixed into its class per layer by :func:`block_class`: the mixer
(:class:`~olmo.model.attention_mixer.AttentionMixer`) and the feed-forward
(:class:`~olmo.model.feed_forward.DenseFeedForward` or, with ``model.moe``,
:class:`~olmo.model.feed_forward.RoutedFeedForward`). The parts create their layers as the block's own attributes,
so parameter names are OLMo's (``transformer.blocks.0.att_proj.weight``) whatever the parts. The block knows nothing
of parallelism: tensor parallelism gives each mixer its share of the heads from outside
(:mod:`olmo.distributed.tensor_parallel`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import InitFnType, ModelConfig
from ..exceptions import OLMoConfigurationError
from .attention import DocumentSpans
from .attention_mixer import AttentionMixer
from .context_attention import ContextAttention
from .feed_forward import DenseFeedForward, RoutedFeedForward
from .init import init_normal, init_scales, init_tensor
from .layers import LayerNorm, RotaryTables, make_dropout
from .linear_attention import GatedDeltaNetMixer
from .moe import MoEFeedForward
from .recurrent_cache import LayerCache

__all__ = [
    "OLMoBlock",
    "OLMoSequentialBlock",
    "OLMoLlamaBlock",
    "BufferCache",
    "block_class",
    "init_scales",
    "init_normal",
    "init_tensor",
]

_OLMO_ORDER = ("dropout", "k_norm", "q_norm", "attn_out", "ff_out", "attn_norm", "ff_norm", "att_proj", "ff_proj")
"""OLMo's creation order of a block's modules: parameters are listed in this order (then any others, such as
``moe``), which the optimizer state of a checkpoint and the order of FSDP's parameters follow."""


class OLMoBlock(nn.Module):
    """OLMo's sequential block: the sequence mixer then the feed-forward, each pre-norm (or post-norm with
    ``norm_after``), each added to the residual stream after dropout.

    ``OLMoBlock(layer_id, config)`` builds the block class :func:`block_class` chooses for the layer (a subclass);
    those classes provide what this one leaves to its parts: ``_build_mixer``, ``attention``, ``_attend`` and the
    mixer's draws; ``_build_feed_forward``, ``feed_forward`` and the feed-forward's draws.

    :param layer_id: Index of the block (its window, the ``mitchell`` init).
    :param config: The model config.
    :param cache: OLMo's shared :class:`BufferCache`; accepted and unused (the RoPE tables live on the model).
    """

    # What the parts create, under OLMo's names (for the code that reads a block's layers from outside).
    window: int | None
    """The attention's window (``model.sliding_window``), None for full attention."""
    n_heads: int
    n_kv_heads: int
    att_proj: nn.Linear
    attn_out: nn.Linear
    q_norm: LayerNorm | None
    k_norm: LayerNorm | None
    ff_proj: nn.Linear | None
    ff_out: nn.Linear | None
    moe: MoEFeedForward | None
    is_recurrent = False
    """Whether the mixer is a recurrence (``linear_attention``), whose block is pre-norm whatever ``norm_after``
    says and which takes the document starts in place of an attention bias."""

    def __new__(cls, layer_id: int = 0, config: ModelConfig | None = None, cache: Any = None) -> OLMoBlock:
        del cache
        if cls is OLMoBlock:  # OLMo's way to build a block: the layer's class, chosen from the config
            assert config is not None, "OLMoBlock(layer_id, config)"
            return super().__new__(block_class(layer_id, config))
        return super().__new__(cls)

    def __init__(self, layer_id: int, config: ModelConfig, cache: Any = None):
        del cache  # OLMo's shared buffer cache: RoPE tables live on the model here
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.norm_after = config.norm_after and not self.is_recurrent
        """Normalize each part's output (OLMo 2) rather than its input; linear-attention layers are always pre-norm,
        as transformers' OlmoHybrid has them."""
        self.dropout = make_dropout(config.residual_dropout)
        self._build_mixer(layer_id, config)
        self._build_feed_forward(config)
        self.attn_norm = LayerNorm.build(config)
        self.ff_norm = LayerNorm.build(config)
        rank = {name: i for i, name in enumerate(_OLMO_ORDER)}
        self._modules = dict(sorted(self._modules.items(), key=lambda item: rank.get(item[0], len(rank))))

    def _build_mixer(self, layer_id: int, config: ModelConfig) -> None:
        """Create the sequence mixer's layers as attributes of this block."""
        raise NotImplementedError

    def _build_feed_forward(self, config: ModelConfig) -> None:
        """Create the feed-forward's layers as attributes of this block."""
        raise NotImplementedError

    def _reset_mixer_inputs(self, std: float, cutoff: float | None) -> None:
        """Draw the mixer's weights that read the residual stream."""
        raise NotImplementedError

    def _reset_mixer_outputs(self, out_std: Callable[[int], float], cutoff: float | None) -> None:
        """Draw the mixer's weights that write to the residual stream."""
        raise NotImplementedError

    def _reset_feed_forward_inputs(self, std: float, cutoff: float | None) -> None:
        """Draw the feed-forward's weights that read the residual stream."""
        raise NotImplementedError

    def _reset_feed_forward_outputs(self, out_std: Callable[[int], float], cutoff: float | None) -> None:
        """Draw the feed-forward's weights that write to the residual stream."""
        raise NotImplementedError

    def attention(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None = None,
        rope: RotaryTables | None = None,
        doc_spans: DocumentSpans | None = None,
        context_parallel: ContextAttention | None = None,
    ) -> torch.Tensor:
        """The sequence mixer, (B, T, C) -> (B, T, C) (activation checkpointing's ``fine_grained`` wraps it)."""
        raise NotImplementedError

    def _attend(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None,
        rope: RotaryTables | None,
        doc_spans: DocumentSpans | None,
        layer_past: LayerCache | None,
        context_parallel: ContextAttention | None = None,
    ) -> tuple[torch.Tensor, LayerCache]:
        """The sequence mixer after the cache ``layer_past``, and the cache of every position so far."""
        raise NotImplementedError

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward, (B, T, C) -> (B, T, C) (activation checkpointing's ``fine_grained`` wraps it)."""
        raise NotImplementedError

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize this block's weights per ``config.init_fn`` (as :meth:`OLMo.reset_parameters` does for every
        block, in the same order of draws: the weights that read the residual stream, then those that write to it);
        biases 0, norm weights 1."""
        cfg = self.config
        cutoff, std, _ = init_scales(cfg)
        for module in self.modules():
            if isinstance(module, LayerNorm):
                module.reset_parameters()

        def out_std(fan_in: int) -> float:
            if cfg.init_fn == InitFnType.mitchell:
                return 1 / math.sqrt(2 * fan_in * (self.layer_id + 1))
            return std / math.sqrt(2 * cfg.n_layers) if cfg.init_fn == InitFnType.full_megatron else std

        self._reset_mixer_inputs(std, cutoff)
        self._reset_feed_forward_inputs(std, cutoff)
        self._reset_mixer_outputs(out_std, cutoff)
        self._reset_feed_forward_outputs(out_std, cutoff)

    def forward(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None = None,
        rope: RotaryTables | None = None,
        doc_spans: DocumentSpans | None = None,
        layer_past: LayerCache | None = None,
        use_cache: bool = False,
        context_parallel: ContextAttention | None = None,
    ) -> Any:
        """
        :param x: (B, T, C) residual stream.
        :param attn_bias: Additive attention bias broadcastable to (B, H, T, T) (T + cached keys with
            ``layer_past``), causal part included; None means plain causal attention (with ``layer_past``: one query
            that sees every key). For a linear-attention layer (``is_recurrent``): the (B, T) bool document starts,
            where its state resets, or None.
        :param rope: (cos, sin) tables of these T positions when the model uses RoPE.
        :param doc_spans: Run flash-attn's varlen kernel over these documents instead (``attn_bias`` is then None).
        :param layer_past: The cache of earlier positions: (keys, values), each (B, KV, past, hd), or a
            linear-attention layer's :class:`~olmo.model.recurrent_cache.RecurrentState`.
        :param use_cache: Return ``(x, (keys, values))``, the keys and values of every position so far, instead
            of ``x`` alone.
        :param context_parallel: ``x`` is this rank's share of each instance; the attention gathers every rank's
            keys and values and attends as this says (``attn_bias`` is then None).
        """
        if layer_past is None and not use_cache:  # training: the plain path
            cp = context_parallel
            if self.norm_after:
                x = x + self.dropout(self.attn_norm(self.attention(x, attn_bias, rope, doc_spans, cp)))
                return x + self.dropout(self.ff_norm(self.feed_forward(x)))
            x = x + self.dropout(self.attention(self.attn_norm(x), attn_bias, rope, doc_spans, cp))
            return x + self.dropout(self.feed_forward(self.ff_norm(x)))
        if self.norm_after:
            y, present = self._attend(x, attn_bias, rope, doc_spans, layer_past)
            x = x + self.dropout(self.attn_norm(y))
            x = x + self.dropout(self.ff_norm(self.feed_forward(x)))
        else:
            y, present = self._attend(self.attn_norm(x), attn_bias, rope, doc_spans, layer_past)
            x = x + self.dropout(y)
            x = x + self.dropout(self.feed_forward(self.ff_norm(x)))
        return (x, present) if use_cache else x


class AttentionBlock(AttentionMixer, DenseFeedForward, OLMoBlock):
    """Attention, then the dense MLP."""


class AttentionMoEBlock(AttentionMixer, RoutedFeedForward, OLMoBlock):
    """Attention, then the mixture of experts (``model.moe``)."""


class GatedDeltaNetBlock(GatedDeltaNetMixer, DenseFeedForward, OLMoBlock):
    """Gated DeltaNet (a ``linear_attention`` layer), then the dense MLP."""


class GatedDeltaNetMoEBlock(GatedDeltaNetMixer, RoutedFeedForward, OLMoBlock):
    """Gated DeltaNet (a ``linear_attention`` layer), then the mixture of experts (``model.moe``)."""


def block_class(layer_id: int, config: ModelConfig) -> type[OLMoBlock]:
    """The block class of layer ``layer_id``: its sequence mixer from ``model.layer_types`` (attention, or Gated
    DeltaNet for ``linear_attention``), then the mixture of experts when ``model.moe`` sets one, else the dense
    MLP."""
    if config.layer_kinds()[layer_id] == "linear_attention":
        return GatedDeltaNetMoEBlock if config.is_moe else GatedDeltaNetBlock
    return AttentionMoEBlock if config.is_moe else AttentionBlock


OLMoSequentialBlock = OLMoBlock
"""OLMo's name for the sequential block, the only block type there is here."""


class BufferCache(dict):  # type: ignore[type-arg]
    """OLMo's cache of non-persistent buffers shared by the blocks; accepted by :class:`OLMoBlock` for code written
    against the original, never needed (the model keeps its RoPE tables itself)."""


class OLMoLlamaBlock(OLMoBlock):
    """OLMo's ``block_type: llama`` (separate q, k and v projections). Not implemented: validation refuses the block
    type, and building one says so."""

    def __init__(self, layer_id: int, config: ModelConfig, cache: Any = None):
        raise OLMoConfigurationError(
            "OLMoLlamaBlock (model.block_type=llama) is not implemented; use the sequential block "
            "(model.block_type=sequential), whose fused att_proj computes the same attention."
        )
