"""The OLMo transformer: plain ``nn.Module`` code, no parallelism.

Module and parameter names follow the original OLMo (``transformer.wte``, ``transformer.blocks.{i}.att_proj``,
...) so that its unsharded checkpoints load with ``load_state_dict(strict=True)``. FSDP, activation
checkpointing and ``torch.compile`` are applied from outside, per entry of ``model.transformer.blocks``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from .config import ActivationType, InitFnType, ModelConfig
from .exceptions import OLMoConfigurationError
from .layers import (
    LayerNorm,
    OutputLayer,
    RotaryTables,
    alibi_bias,
    apply_rotary,
    lm_head,
    make_dropout,
    rotary_cos_sin,
)
from .loss import LossSums

__all__ = ["OLMo", "OLMoBlock", "OLMoOutput", "describe_attention"]

log = logging.getLogger(__name__)


class OLMoOutput(NamedTuple):
    logits: torch.Tensor | None
    """(batch, seq, embedding_size); the columns past vocab_size belong to padding rows of the embedding.
    None when the loss was computed with ``fused_loss``, which never holds all the logits."""
    attn_key_values: None
    """Always None: there is no KV cache (training only needs full-sequence forwards)."""
    hidden_states: tuple[torch.Tensor, ...] | None
    """With ``output_hidden_states``: the input of every block, then the output of ``ln_f``."""
    loss: LossSums | None = None
    """With ``labels``: the summed cross entropy and z-loss over the labelled positions."""


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def _load_flash_attn() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        _warn_once("model.flash_attention is set but the flash-attn package is not installed; using PyTorch SDPA.")
        return None
    return flash_attn_func


class OLMoBlock(nn.Module):
    """OLMo's sequential block: attention then MLP, each pre-norm (or post-norm with ``norm_after``).

    :param layer_id: Index of the block (used by the ``mitchell`` init).
    :param config: The model config.
    """

    def __init__(self, layer_id: int, config: ModelConfig):
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
        self._flash_attn_func = _load_flash_attn() if config.flash_attention else None

    def forward(
        self, x: torch.Tensor, attn_bias: torch.Tensor | None = None, rope: RotaryTables | None = None
    ) -> torch.Tensor:
        """
        :param x: (B, T, C) residual stream.
        :param attn_bias: Additive attention bias broadcastable to (B, H, T, T), causal part included;
            None means plain causal attention.
        :param rope: (cos, sin) tables when the model uses RoPE.
        """
        if self.config.norm_after:
            x = x + self.dropout(self.attn_norm(self.attention(x, attn_bias, rope)))
            return x + self.dropout(self.ff_norm(self.feed_forward(x)))
        x = x + self.dropout(self.attention(self.attn_norm(x), attn_bias, rope))
        return x + self.dropout(self.feed_forward(self.ff_norm(x)))

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
        self, x: torch.Tensor, attn_bias: torch.Tensor | None = None, rope: RotaryTables | None = None
    ) -> torch.Tensor:
        """Self-attention including the output projection, (B, T, C) -> (B, T, C)."""
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
        y = self._scaled_dot_product(q, k, v, attn_bias)  # (B, T, H, hd)
        return self.attn_out(y.reshape(B, T, C))

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rope: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope
        dtype = q.dtype
        if self.config.rope_full_precision:
            with torch.autocast(q.device.type, enabled=False):
                return apply_rotary(q.float(), cos, sin).to(dtype), apply_rotary(k.float(), cos, sin).to(dtype)
        cos, sin = cos.to(dtype), sin.to(dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def _scaled_dot_product(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None
    ) -> torch.Tensor:
        """q (B, H, T, hd), k/v (B, KV, T, hd) -> (B, T, H, hd)."""
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if self.config.flash_attention and self._use_flash(q, attn_bias):
            assert self._flash_attn_func is not None
            # flash-attn takes (B, T, heads, hd) and handles GQA itself.
            return self._flash_attn_func(
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
            q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, is_causal=attn_bias is None
        )  # (B, H, T, hd)
        return y.transpose(1, 2)

    def _use_flash(self, q: torch.Tensor, attn_bias: torch.Tensor | None) -> bool:
        if self._flash_attn_func is None:
            return False
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            _warn_once("flash-attn needs CUDA fp16/bf16 inputs (enable autocast); using PyTorch SDPA.")
            return False
        if attn_bias is not None:
            _warn_once("flash-attn cannot take an attention mask or ALiBi; using PyTorch SDPA for those batches.")
            return False
        return True


def describe_attention(
    config: ModelConfig, device: torch.device, dtype: torch.dtype | None, has_bias: bool
) -> dict[str, Any]:
    """Which attention kernel a forward pass will run (mirrors :meth:`OLMoBlock._use_flash`): flash-attn, or
    PyTorch SDPA and the kernel SDPA picks for this shape (asked of torch's private chooser).

    :param dtype: The autocast dtype, None for fp32.
    :param has_bias: Whether batches carry an attention mask or ALiBi bias.
    """
    try:
        import flash_attn

        flash_version: str | None = flash_attn.__version__
    except ImportError:
        flash_version = None
    flash_runs = bool(
        config.flash_attention and flash_version and device.type == "cuda" and dtype is not None and not has_bias
    )
    head_dim = config.d_model // config.n_heads
    sdpa = None
    if not flash_runs:
        shape = (1, config.n_heads, config.max_sequence_length, head_dim)  # (B, H, T, hd)
        q = torch.zeros(shape, device=device, dtype=dtype or torch.float32, requires_grad=True)
        bias = torch.zeros(1, 1, q.size(2), q.size(2), device=device, dtype=q.dtype) if has_bias else None
        try:
            choice = torch._fused_sdp_choice(q, q, q, bias, config.attention_dropout, not has_bias)
            sdpa = torch.nn.attention.SDPBackend(choice).name
        except Exception as e:  # a private API: report rather than fail
            sdpa = f"unknown ({type(e).__name__})"
    return {
        "model.flash_attention": config.flash_attention,
        "flash_attn_version": flash_version,
        "backend": "flash_attn.flash_attn_func" if flash_runs else "torch SDPA",
        "sdpa_kernel": sdpa,
        "head_dim": head_dim,
    }


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
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        labels: torch.Tensor | None = None,
        z_loss_multiplier: float | None = None,
        fused_loss: bool = False,
    ) -> OLMoOutput:
        """
        :param input_ids: (B, T) token ids.
        :param attention_mask: (B, T), 1 (or True) for real tokens and 0 for padding. Padding keys are hidden from
            every query; outputs at padding positions are meaningless. None attends to everything (causally).
        :param output_hidden_states: Also return every block's input and the final normalized hidden state.
        :param labels: (B, T) the token each position should predict, -100 for none: the output then carries
            the loss sums (:mod:`olmo.loss`). Computing the loss here, inside the model's forward, lets FSDP
            keep the output weight gathered for it.
        :param z_loss_multiplier: Weight of the z-loss, or None.
        :param fused_loss: Compute the loss chunk by chunk from the hidden states without the logits
            (:func:`olmo.loss.fused_output_loss`); ``logits`` is then None.
        """
        cfg = self.config
        t = self.transformer
        T = input_ids.shape[1]
        x = t.wte(input_ids)  # (B, T, C)
        if t.emb_norm is not None:
            x = t.emb_norm(x)
        if t.wpe is not None:
            x = x + t.wpe(torch.arange(T, device=x.device))  # (B, T, C)
        x = t.emb_drop(x)

        attn_bias = self._attention_bias(attention_mask, T, x.device)  # (B or 1, H or 1, T, T) or None
        rope = self._rope_tables(T, x.device) if cfg.rope else None
        hidden_states: list[torch.Tensor] = []
        for block in t.blocks:
            if output_hidden_states:
                hidden_states.append(x)
            x = block(x, attn_bias, rope)  # (B, T, C)
        x = t.ln_f(x)
        if output_hidden_states:
            hidden_states.append(x)

        hidden = tuple(hidden_states) if output_hidden_states else None
        head = (labels, z_loss_multiplier, fused_loss, 1 / math.sqrt(cfg.d_model) if cfg.scale_logits else 1.0)
        if t.ff_out is None:
            logits, loss = lm_head(x, t.wte.weight, None, *head)  # tied to the input embedding
        else:
            logits, loss = t.ff_out(x, *head)
        return OLMoOutput(logits, None, hidden, loss)

    def _attention_bias(
        self, attention_mask: torch.Tensor | None, seq_len: int, device: torch.device
    ) -> torch.Tensor | None:
        """Additive fp32 bias with the causal mask folded in, or None for plain causal attention."""
        if attention_mask is None and not self.config.alibi:
            return None
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]  # (1, 1, T, T)
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
        if self.config.alibi:
            bias = alibi_bias(self.config.n_heads, seq_len, self.config.alibi_bias_max, device)  # (1, H, T, T)
        else:
            bias = torch.zeros((), device=device)
        return torch.where(allowed, bias, torch.finfo(torch.float).min)

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
        if cfg.init_fn == InitFnType.normal:
            cutoff = cfg.init_cutoff_factor
            std = cfg.init_std
            emb_std = cfg.emb_init_std or std
        elif cfg.init_fn == InitFnType.mitchell:
            cutoff = cfg.init_cutoff_factor or 3.0
            std = 1 / math.sqrt(d)
            emb_std = cfg.emb_init_std or std
        else:
            assert cfg.init_fn == InitFnType.full_megatron, cfg.init_fn
            cutoff = cfg.init_cutoff_factor or 3.0
            std = cfg.init_std
            emb_std = cfg.emb_init_std or (std * math.sqrt(d) if cfg.scale_emb_init else std)

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
            _init_normal(block.att_proj, std, cutoff)
            _init_normal(block.ff_proj, std, cutoff)
            if cfg.init_fn == InitFnType.mitchell:
                attn_out_std = 1 / math.sqrt(2 * d * (block.layer_id + 1))
                ff_out_std = 1 / math.sqrt(2 * block.ff_out.in_features * (block.layer_id + 1))
            elif cfg.init_fn == InitFnType.full_megatron:
                attn_out_std = ff_out_std = std / math.sqrt(2 * cfg.n_layers)
            else:
                attn_out_std = ff_out_std = std
            _init_normal(block.attn_out, attn_out_std, cutoff)
            _init_normal(block.ff_out, ff_out_std, cutoff)

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
