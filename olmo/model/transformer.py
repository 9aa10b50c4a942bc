"""The OLMo transformer: plain ``nn.Module`` code, no parallelism.

Module and parameter names follow the original OLMo (``transformer.wte``, ``transformer.blocks.{i}.att_proj``,
...) so that its unsharded checkpoints load with ``load_state_dict(strict=True)``. FSDP, activation
checkpointing and ``torch.compile`` are applied from outside, per entry of ``model.transformer.blocks``. The block
is :mod:`olmo.model.block` (a sequence mixer and a feed-forward, chosen per layer), the shared parameter init
:mod:`olmo.model.init`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from ..config import InitFnType, ModelConfig
from ..exceptions import OLMoConfigurationError
from .attention import (
    DocumentSpans,
    check_doc_lens,
    check_forward_inputs,
    describe_attention,
    document_ids,
    document_spans,
)
from .attention import attention_bias as build_attention_bias
from .attention_mixer import _flash_usable, _load_flash_attn
from .beams import Constraint, FinalSequenceScorer, Sampler
from .block import BufferCache, OLMoBlock, OLMoLlamaBlock, OLMoSequentialBlock
from .context_attention import ContextAttention, ContextParallel, context_parallel_inputs
from .flex_attention import flex_inputs
from .flops import training_flops_per_token
from .generation import OLMoGenerateOutput, generate
from .init import init_normal, init_scales
from .layers import (
    LayerNorm,
    OutputHeadFn,
    OutputLayer,
    RotaryTables,
    lm_head,
    make_dropout,
    rotary_cos_sin,
)
from .loss import LossSums
from .meta_init import skip_meta_init
from .recurrent_cache import LayerCache, cached_length, recurrent_resets

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


KVCache = list[LayerCache]
"""Per block, its keys and values so far (B, n_kv_heads, T, head_dim) each, keys rotated, or its RecurrentState."""


class OLMoOutput(NamedTuple):
    logits: torch.Tensor | None
    """(batch, seq, embedding_size), or (batch, 1, embedding_size) with ``last_logits_only``; the columns past
    vocab_size belong to padding rows of the embedding. None when the loss was computed with ``fused_loss``, which
    never holds all the logits."""
    attn_key_values: KVCache | None
    """With ``use_cache``: every block's cache (keys and values, or a linear-attention layer's recurrent state), the
    cached positions included (the next call's ``past_key_values``); else None."""
    hidden_states: tuple[torch.Tensor, ...] | None
    """With ``output_hidden_states``: the input of every block, then the output of ``ln_f``."""
    loss: LossSums | Any = None
    """With ``labels``: the summed cross entropy and z-loss over the labelled positions (a
    :class:`~olmo.model.loss.LossSums`); with ``head``, what the head returned."""


_checkpoint_loader: Callable[..., OLMo] | None = None
"""What ``OLMo.from_checkpoint`` calls: checkpoint formats are read by :mod:`olmo.checkpoint`, a layer above this one,
which registers its loader when imported (``import olmo.checkpoint``; ``from olmo import OLMo`` does it too)."""


def register_checkpoint_loader(loader: Callable[..., OLMo]) -> None:
    """Set the function behind ``OLMo.from_checkpoint(checkpoint_dir, device, checkpoint_type)``."""
    global _checkpoint_loader
    _checkpoint_loader = loader


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
        if not (config.alibi or config.rope or config.nope):
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
        self._rope_cache: dict[tuple[torch.device, bool], RotaryTables] = {}
        # The windows of the windowed layers (model.sliding_window), each once.
        self.windows = sorted({w for w in config.layer_windows() if w is not None})
        device = torch.get_default_device()
        # Build on meta and initialize once, so a direct build draws exactly what meta + reset_parameters draws.
        with torch.device("meta"), skip_meta_init():  # no values, no random numbers: nothing to initialize yet
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
        past_key_values: Sequence[LayerCache] | None = None,
        use_cache: bool = False,
        last_logits_only: bool = False,
        context_parallel: ContextParallel | None = None,
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

        Context parallelism (training only, :mod:`olmo.distributed.context_parallel`): ``input_ids`` and ``labels``
        are this rank's tokens of each instance, (B, T / degree), cut by ``context_parallel.shard``, while
        ``attention_mask`` and ``doc_lens`` describe whole instances; the blocks gather every rank's keys and values.
        """
        cfg = self.config
        t = self.transformer
        past = cached_length(past_key_values)
        check_forward_inputs(cfg, input_ids, input_embeddings, attention_mask, past_key_values, past, doc_lens)
        cp = context_parallel
        if cp is not None and (past_key_values or use_cache or last_logits_only or input_embeddings is not None):
            raise ValueError("context_parallel is for training: it takes input_ids alone, without a KV cache.")
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
            if cp is not None:
                x = x + t.wpe(cp.positions(T * cp.degree, x.device))  # (B, T, C)
            else:
                x = x + t.wpe(torch.arange(past, past + T, device=x.device))  # (B, T, C)
        x = t.emb_drop(x)
        doc_spans: DocumentSpans | None = None
        inputs: dict[int | None, tuple[torch.Tensor | None, RotaryTables | None]] = {}
        cp_inputs: dict[int | None, tuple[ContextAttention, RotaryTables | None]] = {}
        if cp is not None:
            rope_fn = self._rope_tables if cfg.rope else None
            kind = x.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype  # q's dtype
            shape = (x.shape[0], T)
            cp_inputs = context_parallel_inputs(
                cfg, cp, shape, x.device, attention_mask, doc_lens, max_doc_lens, self.windows, rope_fn, dtype
            )
        else:
            inputs, doc_spans = self.attention_inputs(
                x, attention_mask, doc_lens, max_doc_lens, past, attention_bias
            )
        resets = recurrent_resets(cfg, attention_mask, doc_lens, attention_bias, past, T)
        hidden_states: list[torch.Tensor] = []
        presents: KVCache = []
        for i, block in enumerate(t.typed_blocks()):
            if output_hidden_states:
                hidden_states.append(x)
            if block.is_recurrent and not (past_key_values or use_cache):
                x = block(x, resets, context_parallel=cp)  # (B, T, C)
                continue
            if cp is not None:
                attention, rope_i = cp_inputs[block.window]
                x = block(x, None, rope_i, context_parallel=attention)  # (B, T / degree, C)
                continue
            bias_i, rope_i = (resets, None) if block.is_recurrent else inputs[block.window]
            if past_key_values or use_cache:
                layer_past = past_key_values[i] if past_key_values else None
                x, present = block(x, bias_i, rope_i, doc_spans, layer_past=layer_past, use_cache=True)
                presents.append(present)
            else:
                x = block(x, bias_i, rope_i, doc_spans)  # (B, T, C)
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

        The search options are :class:`~olmo.model.beams.BeamSearch`'s; the sequences end at
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

    def flash_runs_documents(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
        """Whether the blocks' attention for the embeddings ``x`` can run on flash-attn's varlen kernel."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype  # q's dtype
        return _flash_usable(self._flash_attn, x.device, dtype, attention_mask is not None or self.config.alibi)

    def attention_inputs(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        doc_lens: torch.Tensor | None,
        max_doc_lens: Sequence[int] | None,
        past: int,
        attention_bias: torch.Tensor | None,
    ) -> tuple[dict[int | None, tuple[torch.Tensor | None, RotaryTables | None]], DocumentSpans | None]:
        """Each window's (attention bias, RoPE tables) for the embeddings ``x`` after ``past`` cached positions
        (None: the full-attention layers), and the document spans when flash-attn's varlen kernel runs."""
        cfg, T = self.config, x.shape[1]
        doc_spans: DocumentSpans | None = None
        doc_ids: torch.Tensor | None = None
        if doc_lens is not None:
            doc_lens = doc_lens.to(x.device)
            check_doc_lens(doc_lens, x.shape[:2], max_doc_lens)
            if self.flash_runs_documents(x, attention_mask):
                doc_spans = document_spans(doc_lens, max_doc_lens)
            else:
                doc_ids = document_ids(doc_lens, T)  # (B, T)
        masks = flex_inputs(self, x, attention_mask, doc_ids, past, attention_bias)  # FlexAttention's, or None
        # (B or 1, H or 1, T, past + T) or None
        attn_bias = build_attention_bias(
            cfg, T, x.device, attention_mask, doc_ids, past, attention_bias, masks=masks
        )
        rope = (
            self._rope_tables(past + T, x.device, past, scaled=cfg.rope_scaling is not None) if cfg.rope else None
        )
        # Each block's attention inputs by its window (model.sliding_window): one entry, None, in most models.
        inputs: dict[int | None, tuple[torch.Tensor | None, RotaryTables | None]] = {None: (attn_bias, rope)}
        for window in self.windows:
            inputs[window] = (
                self._window_bias(window, attn_bias, x, attention_mask, doc_ids, past, attention_bias, masks),
                self._rope_tables(past + T, x.device, past, scaled=False) if cfg.rope else None,
            )
        return inputs, doc_spans

    def _window_bias(
        self,
        window: int,
        attn_bias: torch.Tensor | None,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        past: int,
        attention_bias: torch.Tensor | None,
        masks: dict[int | None, Any] | None = None,
    ) -> torch.Tensor | None:
        """The attention bias of a layer with this window: FlexAttention's block mask where it runs (``masks``), the
        full layers' ``attn_bias`` where the window hides nothing (no query is ``window`` or more positions after a
        key) or flash-attn applies it (no bias, or the varlen kernel), else that bias with the window folded in."""
        T = x.shape[1]
        if masks is not None:
            return masks.get(window, attn_bias)
        if past + T <= window or (attn_bias is None and self.flash_runs_documents(x, attention_mask)):
            return attn_bias
        return build_attention_bias(
            self.config, T, x.device, attention_mask, doc_ids, past, attention_bias, window
        )

    def _rope_tables(
        self, seq_len: int, device: torch.device, past: int = 0, scaled: bool = False
    ) -> RotaryTables:
        """RoPE tables of positions ``past .. seq_len - 1``; ``scaled``: with ``model.rope_scaling``."""
        cached = self._rope_cache.get((device, scaled))
        if cached is None or cached[0].shape[0] < seq_len:
            head_dim = self.config.d_model // self.config.n_heads
            scaling = self.config.rope_scaling if scaled else None
            cached = rotary_cos_sin(seq_len, head_dim, self.config.rope_theta, device, scaling)
            if not torch.is_inference_mode_enabled():
                # Inference tensors cannot be saved for backward, so they must not leak into a later training step.
                self._rope_cache[(device, scaled)] = cached
        cos, sin = cached
        return cos[past:seq_len], sin[past:seq_len]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize every parameter per ``config.init_fn`` (OLMo >= v0.4 scheme); biases 0, norm weights 1."""
        cfg = self.config
        d = cfg.d_model
        cutoff, std, emb_std = init_scales(cfg)
        t = self.transformer
        init_normal(t.wte, emb_std, cutoff)
        if t.wpe is not None:
            init_normal(t.wpe, std, cutoff)
        if t.ff_out is not None:
            init_normal(t.ff_out, std if cfg.init_fn == InitFnType.normal else 1 / math.sqrt(d), cutoff)
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

    def num_expert_params(self, active: bool = False) -> int:
        """Parameters of the mixture-of-experts layers' experts (0 for a dense model); with ``active``, the share of
        them each token uses (``top_k / num_experts``)."""
        total = 0
        for block in self.transformer.typed_blocks():
            moe = block.moe
            if moe is not None:
                experts = sum(getattr(moe, name).numel() for name in moe.matrix_params)
                total += experts * moe.top_k // moe.num_experts if active else experts
        return total

    def num_active_params(self, include_embedding: bool = True) -> int:
        """Parameters that compute on each token: :meth:`num_params` with each mixture-of-experts layer's expert
        weights counted ``top_k / num_experts`` times (OLMoE-1B-7B: 1.3B of 6.9B); equal to it for a dense model."""
        return self.num_params(include_embedding) - self.num_expert_params() + self.num_expert_params(active=True)

    def num_flops_per_token(self, seq_len: int | None = None) -> int:
        """Training (forward + backward) FLOPs per token, the nanoGPT / OLMo-core MFU convention.

        ``6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len``, where ``N_matmul`` is the non-embedding
        parameter count plus the output projection (``embedding_size * d_model``, counted even when tied, since the
        LM head is a matmul), and the second term is the attention scores and weighted sum (2 matmuls of
        ``2 * T * d`` FLOPs per token forward, times 3 for forward + backward). A layer with a sliding window
        (``model.sliding_window``) counts ``min(window, T)`` keys instead of ``T``: with the same convention (the
        causal half is not subtracted) that is the work a windowed kernel does. This is not OLMo's
        ``num_fwd_flops + num_bck_flops``, which counts embedding lookups in the backward pass. In a mixture of
        experts, ``N_matmul`` counts the active parameters (:meth:`num_active_params`): the router and ``top_k``
        experts per token. A linear-attention layer counts its recurrence instead, the same at any length: per token
        and value head its (dk, dv) state read with the key, corrected and read with the query, ``18 * dk * dv``.

        :param seq_len: Context length; defaults to ``max_sequence_length``.
        """
        return training_flops_per_token(self.config, self.num_active_params(include_embedding=False), seq_len)
