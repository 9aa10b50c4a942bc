"""The OLMo transformer: plain ``nn.Module`` code, no parallelism.

Module and parameter names follow the original OLMo (``transformer.wte``, ``transformer.blocks.{i}.att_proj``,
...) so that its unsharded checkpoints load with ``load_state_dict(strict=True)``. FSDP, activation
checkpointing and ``torch.compile`` are applied from outside, per entry of ``model.transformer.blocks``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ActivationType, InitFnType, ModelConfig
from ..exceptions import OLMoConfigurationError
from .attention import (
    DocumentSpans,
    check_doc_lens,
    describe_attention,
    document_ids,
    document_spans,
    flash_varlen_attention,
)
from .attention import attention_bias as build_attention_bias
from .beam_search import Constraint, FinalSequenceScorer, Sampler
from .generation import OLMoGenerateOutput, generate
from .layers import (
    LayerNorm,
    OutputHeadFn,
    OutputLayer,
    RotaryTables,
    apply_rotary,
    lm_head,
    make_dropout,
    rotary_cos_sin,
)
from .loss import LossSums

__all__ = [
    "OLMo",
    "OLMoBlock",
    "OLMoSequentialBlock",
    "OLMoLlamaBlock",
    "BufferCache",
    "OLMoOutput",
    "OLMoGenerateOutput",
    "KVCache",
    "describe_attention",
]

log = logging.getLogger(__name__)


KVCache = list[tuple[torch.Tensor, torch.Tensor]]
"""Per block, its keys and values so far: (B, n_kv_heads, T, head_dim) each, keys already rotated by RoPE."""


class OLMoOutput(NamedTuple):
    logits: torch.Tensor | None
    """(batch, seq, embedding_size), or (batch, 1, embedding_size) with ``last_logits_only``; the columns past
    vocab_size belong to padding rows of the embedding. None when the loss was computed with ``fused_loss``, which
    never holds all the logits."""
    attn_key_values: KVCache | None
    """With ``use_cache``: every block's keys and values, the cached ones included (the next call's
    ``past_key_values``); else None."""
    hidden_states: tuple[torch.Tensor, ...] | None
    """With ``output_hidden_states``: the input of every block, then the output of ``ln_f``."""
    loss: LossSums | Any = None
    """With ``labels``: the summed cross entropy and z-loss over the labelled positions (a
    :class:`~olmo.model.loss.LossSums`); with ``head``, what the head returned."""


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


class _FlashAttn(NamedTuple):
    """The flash-attn kernels the model calls (functions, not the module, so that the model can be deep-copied)."""

    func: Callable[..., torch.Tensor]
    varlen_func: Callable[..., torch.Tensor]


def _load_flash_attn() -> _FlashAttn | None:
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError:
        _warn_once("model.flash_attention is set but the flash-attn package is not installed; using PyTorch SDPA.")
        return None
    return _FlashAttn(flash_attn_func, flash_attn_varlen_func)


def _flash_usable(flash_attn: _FlashAttn | None, device: torch.device, dtype: torch.dtype, has_bias: bool) -> bool:
    """Whether flash-attn can run attention for inputs of this device and dtype, with or without a mask."""
    if flash_attn is None:
        return False
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        _warn_once("flash-attn needs CUDA fp16/bf16 inputs (enable autocast); using PyTorch SDPA.")
        return False
    if has_bias:
        _warn_once("flash-attn cannot take an attention mask or ALiBi; using PyTorch SDPA for those batches.")
        return False
    return True


class OLMoBlock(nn.Module):
    """OLMo's sequential block: attention then MLP, each pre-norm (or post-norm with ``norm_after``).

    :param layer_id: Index of the block (used by the ``mitchell`` init).
    :param config: The model config.
    :param cache: OLMo's shared :class:`BufferCache`; accepted and unused (the RoPE tables live on the model).
    """

    def __init__(self, layer_id: int, config: ModelConfig, cache: Any = None):
        del cache  # OLMo's shared buffer cache: RoPE tables live on the model here
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.n_heads = config.n_heads
        self.n_kv_heads = config.effective_n_kv_heads
        self.head_dim = config.d_model // config.n_heads
        kv_dim = self.n_kv_heads * self.head_dim
        hidden = config.effective_mlp_hidden_size
        bias = config.include_bias

        # Creation order follows OLMo so that parameters are listed in the same order.
        self.dropout = make_dropout(config.residual_dropout)
        self.k_norm: LayerNorm | None = None
        self.q_norm: LayerNorm | None = None
        if config.attention_layer_norm:
            affine = config.attention_layer_norm_with_affine
            self.k_norm = LayerNorm.build(config, size=kv_dim, elementwise_affine=affine)
            self.q_norm = LayerNorm.build(config, elementwise_affine=affine)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=bias)
        ff_in = hidden // 2 if config.activation_type == ActivationType.swiglu else hidden
        self.ff_out = nn.Linear(ff_in, config.d_model, bias=bias)
        self.attn_norm = LayerNorm.build(config)
        self.ff_norm = LayerNorm.build(config)
        self.att_proj = nn.Linear(config.d_model, config.d_model + 2 * kv_dim, bias=bias)
        self.ff_proj = nn.Linear(config.d_model, hidden, bias=bias)
        self._flash_attn = _load_flash_attn() if config.flash_attention else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize this block's weights per ``config.init_fn`` (as :meth:`OLMo.reset_parameters` does for every
        block, in the same order of draws); biases 0, norm weights 1."""
        cfg = self.config
        cutoff, std, _ = _init_scales(cfg)
        for module in self.modules():
            if isinstance(module, LayerNorm):
                module.reset_parameters()
        _init_normal(self.att_proj, std, cutoff)
        _init_normal(self.ff_proj, std, cutoff)
        if cfg.init_fn == InitFnType.mitchell:
            attn_out_std = 1 / math.sqrt(2 * cfg.d_model * (self.layer_id + 1))
            ff_out_std = 1 / math.sqrt(2 * self.ff_out.in_features * (self.layer_id + 1))
        elif cfg.init_fn == InitFnType.full_megatron:
            attn_out_std = ff_out_std = std / math.sqrt(2 * cfg.n_layers)
        else:
            attn_out_std = ff_out_std = std
        _init_normal(self.attn_out, attn_out_std, cutoff)
        _init_normal(self.ff_out, ff_out_std, cutoff)

    def forward(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None = None,
        rope: RotaryTables | None = None,
        doc_spans: DocumentSpans | None = None,
        layer_past: tuple[torch.Tensor, torch.Tensor] | None = None,
        use_cache: bool = False,
    ) -> Any:
        """
        :param x: (B, T, C) residual stream.
        :param attn_bias: Additive attention bias broadcastable to (B, H, T, T) (T + cached keys with
            ``layer_past``), causal part included; None means plain causal attention (with ``layer_past``: one query
            that sees every key).
        :param rope: (cos, sin) tables of these T positions when the model uses RoPE.
        :param doc_spans: Run flash-attn's varlen kernel over these documents instead (``attn_bias`` is then None).
        :param layer_past: Cached (keys, values) of earlier positions, each (B, KV, past, hd).
        :param use_cache: Return ``(x, (keys, values))``, the keys and values of every position so far, instead
            of ``x`` alone.
        """
        if layer_past is None and not use_cache:  # training: the plain path
            if self.config.norm_after:
                x = x + self.dropout(self.attn_norm(self.attention(x, attn_bias, rope, doc_spans)))
                return x + self.dropout(self.ff_norm(self.feed_forward(x)))
            x = x + self.dropout(self.attention(self.attn_norm(x), attn_bias, rope, doc_spans))
            return x + self.dropout(self.feed_forward(self.ff_norm(x)))
        if self.config.norm_after:
            y, present = self._attend(x, attn_bias, rope, doc_spans, layer_past)
            x = x + self.dropout(self.attn_norm(y))
            x = x + self.dropout(self.ff_norm(self.feed_forward(x)))
        else:
            y, present = self._attend(self.attn_norm(x), attn_bias, rope, doc_spans, layer_past)
            x = x + self.dropout(y)
            x = x + self.dropout(self.feed_forward(self.ff_norm(x)))
        return (x, present) if use_cache else x

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP: ``ff_out(act(ff_proj(x)))``, (B, T, C) -> (B, T, C)."""
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

    def attention(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None = None,
        rope: RotaryTables | None = None,
        doc_spans: DocumentSpans | None = None,
    ) -> torch.Tensor:
        """Self-attention including the output projection, (B, T, C) -> (B, T, C)."""
        return self._attend(x, attn_bias, rope, doc_spans, None)[0]

    def _attend(
        self,
        x: torch.Tensor,
        attn_bias: torch.Tensor | None,
        rope: RotaryTables | None,
        doc_spans: DocumentSpans | None,
        layer_past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Self-attention (B, T, C) -> (B, T, C) after the cached keys and values ``layer_past``, and the keys and
        values of every position so far."""
        B, T, C = x.shape
        kv_dim = self.n_kv_heads * self.head_dim
        qkv = self.att_proj(x)  # (B, T, C + 2 * kv_dim)
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(-self.config.clip_qkv, self.config.clip_qkv)
        q, k, v = qkv.split((C, kv_dim, kv_dim), dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            dtype = k.dtype  # under autocast the norms return fp32; keep the projection's dtype
            q = self.q_norm(q).to(dtype)
            k = self.k_norm(k).to(dtype)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        if rope is not None:
            q, k = self._rotate(q, k, rope)
        if layer_past is not None:
            k = torch.cat((layer_past[0], k), dim=-2)  # (B, KV, past + T, hd)
            v = torch.cat((layer_past[1], v), dim=-2)
        y = self._scaled_dot_product(q, k, v, attn_bias, doc_spans, causal=layer_past is None)  # (B, T, H, hd)
        return self.attn_out(y.reshape(B, T, C)), (k, v)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rope: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        dtype = q.dtype
        if self.config.rope_full_precision:
            with torch.autocast(q.device.type, enabled=False):
                return apply_rotary(q.float(), cos, sin).to(dtype), apply_rotary(k.float(), cos, sin).to(dtype)
        cos, sin = cos.to(dtype), sin.to(dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def _scaled_dot_product(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_bias: torch.Tensor | None,
        doc_spans: DocumentSpans | None,
        causal: bool = True,
    ) -> torch.Tensor:
        """q (B, H, T, hd), k/v (B, KV, S, hd) -> (B, T, H, hd). Without ``attn_bias``: causal attention, or with
        ``causal=False`` (one query after cached keys) attention to every key."""
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if doc_spans is not None:
            assert self._flash_attn is not None, "OLMo.forward passes doc_spans only when flash-attn runs"
            return flash_varlen_attention(self._flash_attn.varlen_func, q, k, v, doc_spans, dropout_p)
        if _flash_usable(self._flash_attn, q.device, q.dtype, attn_bias is not None):
            assert self._flash_attn is not None
            # flash-attn takes (B, T, heads, hd) and handles GQA itself.
            return self._flash_attn.func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, causal=True
            )
        if self.n_kv_heads != self.n_heads:
            # Query head h reads kv head h // (H / KV), as in OLMo and flash-attn.
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, T, hd)
        if attn_bias is not None:
            # Finite minimum: a row with every key masked (a left-pad query) must give a uniform softmax, not NaN.
            attn_bias = attn_bias.to(q.dtype).clamp(min=torch.finfo(q.dtype).min)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, is_causal=causal and attn_bias is None
        )  # (B, H, T, hd)
        return y.transpose(1, 2)


_checkpoint_loader: Callable[..., OLMo] | None = None
"""What ``OLMo.from_checkpoint`` calls: checkpoint formats are read by :mod:`olmo.checkpoint`, a layer above this one,
which registers its loader when imported (``import olmo.checkpoint``; ``from olmo import OLMo`` does it too)."""


def register_checkpoint_loader(loader: Callable[..., OLMo]) -> None:
    """Set the function behind ``OLMo.from_checkpoint(checkpoint_dir, device, checkpoint_type)``."""
    global _checkpoint_loader
    _checkpoint_loader = loader


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


class OLMoTransformer(nn.Module):
    """The modules of :class:`OLMo`, under the names of OLMo's ``transformer`` ModuleDict.

    Optional modules are None when the config leaves them out, so they have no state-dict keys.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        # Creation order follows OLMo so that parameters are listed in the same order.
        self.wte = nn.Embedding(config.effective_embedding_size, config.d_model)
        self.emb_drop = make_dropout(config.embedding_dropout)
        self.ln_f = LayerNorm.build(config)
        self.blocks = nn.ModuleList(OLMoBlock(i, config) for i in range(config.n_layers))
        self.wpe: nn.Embedding | None = None
        if not (config.alibi or config.rope):
            self.wpe = nn.Embedding(config.max_sequence_length, config.d_model)
        self.ff_out: OutputLayer | None = None
        if not config.weight_tying:
            self.ff_out = OutputLayer(config.d_model, config.effective_embedding_size, bias=config.include_bias)
        self.emb_norm: LayerNorm | None = None
        if config.embedding_layer_norm:
            self.emb_norm = LayerNorm.build(config)

    def typed_blocks(self) -> list[OLMoBlock]:
        return cast(list[OLMoBlock], list(self.blocks))


class OLMo(nn.Module):
    """The OLMo decoder-only transformer.

    Built directly, the parameters are initialized by :meth:`reset_parameters`. Built under
    ``with torch.device("meta"):`` nothing is allocated or initialized; call ``model.to_empty(device=...)``
    and then ``model.reset_parameters()``. Both paths give the same parameters for the same
    ``torch.manual_seed``.

    :param config: The model config (already validated).
    :param init_params: As in OLMo: False skips :meth:`reset_parameters`, for a model whose weights are loaded
        next (``model.load_state_dict(...)``). The parameters are then allocated on the default device but
        left uninitialized (they hold whatever that memory held, as ``torch.empty`` does), and no random
        numbers are drawn. Under the meta device nothing is allocated either way.
    """

    def __init__(self, config: ModelConfig, init_params: bool = True):
        super().__init__()
        if config.block_type != "sequential" or config.block_group_size != 1:
            # Validation explains these; a model built around validation must not silently differ.
            raise OLMoConfigurationError(
                f"model.block_type={config.block_type} with model.block_group_size={config.block_group_size} is "
                f"not implemented; only sequential blocks without groups are (see TrainConfig.validate)."
            )
        self.config = config
        self._flash_attn = _load_flash_attn() if config.flash_attention else None
        # RoPE tables per device, long enough for the longest sequence seen. A plain dict, not buffers: they stay
        # out of the state dict, and a meta build or ``to_empty`` cannot leave stale values behind.
        self._rope_cache: dict[torch.device, RotaryTables] = {}
        device = torch.get_default_device()
        # Build on meta and initialize once, so a direct build draws exactly what meta + reset_parameters draws.
        with torch.device("meta"):
            self.transformer = OLMoTransformer(config)
        if device.type != "meta":
            self.to_empty(device=device)
            if init_params:
                self.reset_parameters()

    def forward(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        labels: torch.Tensor | None = None,
        z_loss_multiplier: float | None = None,
        fused_loss: bool = False,
        doc_lens: torch.Tensor | None = None,
        max_doc_lens: Sequence[int] | None = None,
        head: OutputHeadFn | None = None,
        *,
        input_embeddings: torch.FloatTensor | None = None,
        attention_bias: torch.Tensor | None = None,
        past_key_values: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        use_cache: bool = False,
        last_logits_only: bool = False,
    ) -> OLMoOutput:
        """
        :param input_ids: (B, T) token ids.
        :param attention_mask: (B, T), 1 (or True) for real tokens and 0 for padding. Padding keys are hidden from
            every query; outputs at padding positions are meaningless. None attends to everything (causally).
        :param output_hidden_states: Also return every block's input and the final normalized hidden state.
        :param labels: (B, T) the token each position should predict, -100 for none: the output then carries
            the loss sums (:mod:`olmo.model.loss`). Computing the loss here, inside the model's forward, lets FSDP
            keep the output weight gathered for it.
        :param z_loss_multiplier: Weight of the z-loss, or None.
        :param fused_loss: Compute the loss chunk by chunk from the hidden states without the logits
            (:func:`olmo.model.loss.fused_output_loss`); ``logits`` is then None.
        :param doc_lens: (B, max_docs) lengths of the documents packed into each row, zero-padded on the right;
            each row's lengths sum to T (padding, if any, counted in some document). A token then attends only to
            earlier tokens of its own document, as OLMo's ``data.generate_doc_lengths`` does: flash-attn's varlen
            kernel when it runs (CUDA, fp16/bf16, ``model.flash_attention``, no ``attention_mask`` or ALiBi), else
            an SDPA mask built once per forward. Positions stay those of the packed row, as in OLMo: with RoPE or
            ALiBi (relative) a document gives the logits it would give alone, but with learned absolute positions
            (``wpe``) its logits depend on where in the row it sits.
        :param max_doc_lens: At least the longest document (OLMo passes each row's longest); only flash-attn uses
            it, and it saves a host sync there.
        :param head: Instead of the logits (and loss), compute ``head(OutputHead(final hidden states, output
            weight, output bias, logit scale))`` inside the forward, where FSDP holds the output weight gathered,
            and return it as ``loss`` (``logits`` is then None). :class:`olmo.train.kl.KLTrainModule` computes its
            penalty this way.

        Incremental decoding (OLMo's arguments, keyword-only here):

        :param input_embeddings: (B, T, C) used instead of ``wte(input_ids)`` (``input_ids`` may then be None).
        :param attention_bias: OLMo's (B or 1, 1 or H, >= L, >= L) bias over all L = past + T positions, which
            replaces the causal mask: bool/int8 (true: may attend) or additive float.
        :param past_key_values: The ``attn_key_values`` of an earlier call: these T tokens continue those
            sequences, at positions ``past ..``; ``attention_mask`` (when given) then covers all past + T positions.
        :param use_cache: Return every block's keys and values in ``attn_key_values``.
        :param last_logits_only: Compute the logits of the last position only: (B, 1, embedding_size).
        """
        cfg = self.config
        t = self.transformer
        past = 0 if not past_key_values else past_key_values[0][0].size(-2)
        self._check_decoding_inputs(input_ids, input_embeddings, attention_mask, past_key_values, past, doc_lens)
        if input_embeddings is not None:
            x = input_embeddings  # (B, T, C)
        else:
            x = t.wte(input_ids)  # (B, T, C)
        T = x.shape[1]
        if t.emb_norm is not None:
            x = t.emb_norm(x)
        if t.wpe is not None:
            if past + T > cfg.max_sequence_length:
                raise ValueError(
                    f"Position {past + T - 1} is past the {cfg.max_sequence_length} learned positions (model.wpe) "
                    f"of this model: shorten the prompt or generate fewer tokens."
                )
            x = x + t.wpe(torch.arange(past, past + T, device=x.device))  # (B, T, C)
        x = t.emb_drop(x)

        doc_ids: torch.Tensor | None = None
        doc_spans: DocumentSpans | None = None
        if doc_lens is not None:
            doc_lens = doc_lens.to(x.device)
            check_doc_lens(doc_lens, x.shape[:2], max_doc_lens)
            if self._flash_runs_documents(x, attention_mask):
                doc_spans = document_spans(doc_lens, max_doc_lens)
            else:
                doc_ids = document_ids(doc_lens, T)  # (B, T)
        # (B or 1, H or 1, T, past + T) or None
        attn_bias = build_attention_bias(cfg, T, x.device, attention_mask, doc_ids, past, attention_bias)
        rope = self._rope_tables(past + T, x.device) if cfg.rope else None
        if rope is not None and past:
            rope = (rope[0][past:], rope[1][past:])
        hidden_states: list[torch.Tensor] = []
        presents: KVCache = []
        for i, block in enumerate(t.blocks):
            if output_hidden_states:
                hidden_states.append(x)
            if past_key_values or use_cache:
                layer_past = past_key_values[i] if past_key_values else None
                x, present = block(x, attn_bias, rope, doc_spans, layer_past=layer_past, use_cache=True)
                presents.append(present)
            else:
                x = block(x, attn_bias, rope, doc_spans)  # (B, T, C)
        if last_logits_only:
            x = x[:, -1:, :]  # (B, 1, C)
        x = t.ln_f(x)
        if output_hidden_states:
            hidden_states.append(x)

        hidden = tuple(hidden_states) if output_hidden_states else None
        scale = 1 / math.sqrt(cfg.d_model) if cfg.scale_logits else 1.0
        options = (labels, z_loss_multiplier, fused_loss, scale, head)
        if t.ff_out is None:
            logits, loss = lm_head(x, t.wte.weight, None, *options)  # tied to the input embedding
        else:
            logits, loss = t.ff_out(x, *options)
        return OLMoOutput(logits, presents if use_cache else None, hidden, loss)

    @property
    def device(self) -> torch.device:
        """Where the parameters are (OLMo's property; the embedding's device, ``meta`` for a model not yet
        materialized)."""
        return self.transformer.wte.weight.device

    @classmethod
    def from_checkpoint(
        cls, checkpoint_dir: str, device: str | torch.device = "cpu", checkpoint_type: Any = None
    ) -> OLMo:
        """OLMo's constructor: the model of a checkpoint directory (ours sharded or unsharded, the original OLMo's,
        an import from transformers), weights only, on ``device``, in eval mode. ``checkpoint_type`` is accepted
        and not needed (the directory says which kind it is).

        :raises OLMoConfigurationError: when :mod:`olmo.checkpoint` was never imported (it reads the formats).
        """
        if _checkpoint_loader is None:
            raise OLMoConfigurationError(
                "OLMo.from_checkpoint reads checkpoints with olmo.checkpoint: `import olmo.checkpoint` first (or "
                "use `from olmo import OLMo`, which does)."
            )
        return _checkpoint_loader(checkpoint_dir, device, checkpoint_type)

    def generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        max_steps: int = 10,
        beam_size: int = 1,
        per_node_beam_size: int | None = None,
        sampler: Sampler | None = None,
        min_steps: int | None = None,
        final_sequence_scorer: FinalSequenceScorer | None = None,
        constraints: list[Constraint] | None = None,
    ) -> OLMoGenerateOutput:
        """Continue the (B, T) prompts ``input_ids`` by up to ``max_steps`` tokens with beam search over the KV cache
        (OLMo's signature; ``beam_size=1`` with the default sampler is greedy decoding). Call it in eval mode.

        :param attention_mask: (B, T), 0 for padding; pad prompts of different lengths on the left.
        :param attention_bias: (B, 1, T + max_steps, T + max_steps), as for :meth:`forward`.

        The search options are :class:`~olmo.model.beam_search.BeamSearch`'s; the sequences end at
        ``config.eos_token_id``. Returns the (B, beam_size, steps) generated token ids and the beams' scores,
        best first.
        """
        return generate(
            self,
            input_ids,
            attention_mask,
            attention_bias,
            max_steps,
            beam_size,
            per_node_beam_size,
            sampler,
            min_steps,
            final_sequence_scorer,
            constraints,
        )

    def _check_decoding_inputs(
        self,
        input_ids: torch.Tensor | None,
        input_embeddings: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        past_key_values: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
        past: int,
        doc_lens: torch.Tensor | None,
    ) -> None:
        """Refuse inputs the incremental-decoding arguments cannot combine with, naming the argument."""
        if (input_ids is None) == (input_embeddings is None):
            raise ValueError("OLMo.forward takes input_ids or input_embeddings: exactly one of them.")
        if past_key_values is None:
            return
        if len(past_key_values) != self.config.n_layers:
            raise ValueError(
                f"past_key_values has {len(past_key_values)} entries but the model has {self.config.n_layers} "
                f"blocks: pass the attn_key_values of an earlier call with use_cache=True."
            )
        if doc_lens is not None:
            raise ValueError("doc_lens cannot be combined with past_key_values: document masking is for training.")
        T = (input_ids if input_ids is not None else input_embeddings).shape[1]  # type: ignore[union-attr]
        if attention_mask is not None and attention_mask.shape[-1] != past + T:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[-1]} positions but past_key_values hold {past} and "
                f"input_ids {T}: with a cache the mask covers every position, past and new ({past + T})."
            )

    def _flash_runs_documents(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
        """Whether the blocks' attention for the embeddings ``x`` can run on flash-attn's varlen kernel."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype  # q's dtype
        return _flash_usable(self._flash_attn, x.device, dtype, attention_mask is not None or self.config.alibi)

    def _rope_tables(self, seq_len: int, device: torch.device) -> RotaryTables:
        cached = self._rope_cache.get(device)
        if cached is None or cached[0].shape[0] < seq_len:
            head_dim = self.config.d_model // self.config.n_heads
            cached = rotary_cos_sin(seq_len, head_dim, self.config.rope_theta, device)
            if torch.is_inference_mode_enabled():
                # Inference tensors cannot be saved for backward, so they must not leak into a later training step.
                return cached
            self._rope_cache[device] = cached
        cos, sin = cached
        return cos[:seq_len], sin[:seq_len]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize every parameter per ``config.init_fn`` (OLMo >= v0.4 scheme); biases 0, norm weights 1."""
        cfg = self.config
        d = cfg.d_model
        cutoff, std, emb_std = _init_scales(cfg)
        t = self.transformer
        _init_normal(t.wte, emb_std, cutoff)
        if t.wpe is not None:
            _init_normal(t.wpe, std, cutoff)
        if t.ff_out is not None:
            _init_normal(t.ff_out, std if cfg.init_fn == InitFnType.normal else 1 / math.sqrt(d), cutoff)
        for module in self.modules():
            if isinstance(module, LayerNorm):
                module.reset_parameters()
        for block in t.typed_blocks():
            block.reset_parameters()

    def num_params(self, include_embedding: bool = True) -> int:
        """Number of parameters; ``include_embedding=False`` leaves out ``transformer.wte`` and ``transformer.wpe``."""
        return sum(
            p.numel()
            for name, p in self.named_parameters()
            if include_embedding or not name.startswith(("transformer.wte.", "transformer.wpe."))
        )

    def num_flops_per_token(self, seq_len: int | None = None) -> int:
        """Training (forward + backward) FLOPs per token, the nanoGPT / OLMo-core MFU convention.

        ``6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len``, where ``N_matmul`` is the non-embedding
        parameter count plus the output projection (``embedding_size * d_model``, counted even when tied, since the
        LM head is a matmul), and the second term is the attention scores and weighted sum (2 matmuls of
        ``2 * T * d`` FLOPs per token forward, times 3 for forward + backward). This is not OLMo's
        ``num_fwd_flops + num_bck_flops``, which counts embedding lookups in the backward pass.

        :param seq_len: Context length; defaults to ``max_sequence_length``.
        """
        cfg = self.config
        n_matmul = self.num_params(include_embedding=False)
        if cfg.weight_tying:
            n_matmul += cfg.effective_embedding_size * cfg.d_model
        seq_len = cfg.max_sequence_length if seq_len is None else seq_len
        head_dim = cfg.d_model // cfg.n_heads
        return 6 * n_matmul + 12 * cfg.n_layers * cfg.n_heads * head_dim * seq_len


def _init_scales(cfg: ModelConfig) -> tuple[float | None, float, float]:
    """``(cutoff factor, std, embedding std)`` of ``cfg.init_fn``."""
    d = cfg.d_model
    if cfg.init_fn == InitFnType.normal:
        return cfg.init_cutoff_factor, cfg.init_std, cfg.emb_init_std or cfg.init_std
    if cfg.init_fn == InitFnType.mitchell:
        std = 1 / math.sqrt(d)
        return cfg.init_cutoff_factor or 3.0, std, cfg.emb_init_std or std
    assert cfg.init_fn == InitFnType.full_megatron, cfg.init_fn
    std = cfg.init_std
    emb = cfg.emb_init_std or (std * math.sqrt(d) if cfg.scale_emb_init else std)
    return cfg.init_cutoff_factor or 3.0, std, emb


def _init_normal(module: nn.Linear | nn.Embedding, std: float, cutoff: float | None) -> None:
    """Draw ``module.weight`` from N(0, std), truncated at ``cutoff`` stds when given; zero ``module.bias``.

    The full tensor is always drawn from the CPU generator and then copied into the parameter (for a sharded
    parameter, each rank keeps its own slice). So a seed gives the same initial weights on CPU or GPU, with one
    process or many, which is what lets a sharded run reproduce a single-process run.
    """
    weight = module.weight
    full = torch.empty(weight.shape, dtype=torch.float32)
    if cutoff is None:
        nn.init.normal_(full, mean=0.0, std=std)
    else:
        nn.init.trunc_normal_(full, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)
    _assign(weight, full)
    bias = getattr(module, "bias", None)
    if bias is not None:
        nn.init.zeros_(bias)


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size tensor into ``param``, which may be a sharded DTensor (every rank holds ``full``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already has the same full tensor, so no communication is needed.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)
