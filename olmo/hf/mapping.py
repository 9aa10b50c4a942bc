"""The mapping between our model and Hugging Face transformers' OLMo models, in both directions.

Three transformers classes can hold one of our models exactly:

* ``OlmoForCausalLM`` (``model_type: olmo``): OLMo-1. Pre-norm blocks with a non-parametric layer norm
  (eps 1e-5), RoPE, SwiGLU, no biases, optional ``clip_qkv`` and GQA.
* ``Olmo2ForCausalLM`` (``model_type: olmo2``): OLMo-2. ``norm_after`` blocks with RMSNorm weights, QK-norm
  (RMSNorm over all query and all key channels), RoPE, SwiGLU, no biases, optional GQA. transformers' Olmo2 also
  reads YaRN and llama3 RoPE scaling, which we import (every layer then has full attention and scaled RoPE).
* ``Olmo3ForCausalLM`` (``model_type: olmo3``): OLMo-3, the OLMo-2 blocks with sliding-window attention on some
  layers (``model.sliding_window``) and RoPE scaling on the full-attention ones (``model.rope_scaling``); an
  OLMo-2-architecture model with either set exports as this. The window and RoPE parts are in :mod:`olmo.hf.olmo3`.
* ``OlmoHybridForCausalLM`` (``model_type: olmo_hybrid``): OLMo Hybrid, a model with ``linear_attention`` layers
  (``model.layer_types``): OLMo 3's attention layers beside Gated DeltaNet ones; in :mod:`olmo.hf.olmo_hybrid`.

Every other architecture is refused with an :class:`~olmo.exceptions.OLMoConfigurationError` that names the
options at fault, before anything is written. The parameters map one to one, except our two fused projections:

* ``att_proj`` (d_model + 2 * kv_dim rows) is ``q_proj``, ``k_proj`` and ``v_proj`` stacked in that order;
* ``ff_proj`` (2 * intermediate rows) is ``up_proj`` then ``gate_proj``: our SwiGLU computes
  ``silu(second half) * first half``, transformers ``silu(gate_proj(x)) * up_proj(x)``.

Both sides rotate with the same NeoX ("rotate_half") RoPE, repeat each key/value head for consecutive query
heads, and hold ``embedding_size`` rows in the embedding (transformers calls it ``vocab_size``).

Used by :mod:`olmo.hf.files`, the two conversion commands and the trainer's ``hf_export``; transformers is
imported inside the functions that need it (the optional ``hf`` extra), never at import time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config import ActivationType, LayerNormType, ModelConfig
from ..exceptions import OLMoConfigurationError, OLMoError
from ..model import OLMo
from .config_checks import hf_import_problems, hf_size_problems
from .olmo3 import olmo3_config_kwargs, olmo3_export_problems, read_rope, read_windows, uses_olmo3
from .olmo_hybrid import (
    HYBRID,
    from_saved_names,
    linear_layer_names,
    olmo_hybrid_config_kwargs,
    olmo_hybrid_export_problems,
    olmo_hybrid_fields,
    olmo_hybrid_import_problems,
    to_saved_names,
)
from .olmoe import (
    MOE_MODEL_TYPES,
    experts_from_hf,
    experts_to_hf,
    hf_expert_names,
    moe_config_from_hf,
    moe_config_kwargs,
    moe_export_problems,
    moe_model_type,
)

__all__ = [
    "HF_MODEL_TYPES",
    "hf_class_listing",
    "hf_config_class",
    "import_transformers",
    "hf_model_type",
    "hf_config_kwargs",
    "build_hf_config",
    "model_config_from_hf",
    "to_hf_state",
    "from_hf_state",
]

HF_MODEL_TYPES = {
    "olmo": "OlmoForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    **MOE_MODEL_TYPES,
    HYBRID: "OlmoHybridForCausalLM",
}
"""The transformers ``model_type`` values we convert, and their model class."""


def hf_class_listing() -> str:
    """Every transformers class we convert, with its ``model_type``, as help texts and messages list them:
    ``OlmoForCausalLM (olmo), Olmo2ForCausalLM (olmo2), ...`` (read from :data:`HF_MODEL_TYPES`)."""
    return ", ".join(f"{name} ({model_type})" for model_type, name in HF_MODEL_TYPES.items())


_NORM_AFTER_TYPES = ("olmo2", "olmo3", "flex_olmo", HYBRID)
"""The model types with the OLMo-2 blocks (norm after, RMSNorm with weights, QK-norm)."""

_OLMO1_NORM_EPS = 1e-5
"""transformers' ``OlmoLayerNorm`` hard-codes this epsilon."""

_IGNORED_HF_KEYS = ("rotary_emb.inv_freq",)
"""Buffers that older transformers versions saved with the weights; they are recomputed from the config."""


def import_transformers() -> Any:
    """The transformers package, or an :class:`~olmo.exceptions.OLMoError` saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise OLMoError(
            f"Converting to or from Hugging Face needs the transformers package, which did not import ({e}). "
            f"Install the optional extra: pip install -e '.[hf]'."
        ) from None
    return transformers


def hf_config_class(model_type: str) -> Any:
    """transformers' config class for ``model_type`` (one of :data:`HF_MODEL_TYPES`)."""
    return getattr(import_transformers(), HF_MODEL_TYPES[model_type].replace("ForCausalLM", "Config"))


def _export_problems(cfg: ModelConfig) -> list[str]:
    """Every option of ``cfg`` that the transformers class for it cannot represent, each with its fix."""
    if cfg.has_linear_attention:
        out = olmo_hybrid_export_problems(cfg)
    else:
        out = moe_export_problems(cfg) if cfg.is_moe else olmo3_export_problems(cfg)
    if not (cfg.rope or (cfg.nope and cfg.has_linear_attention)) or cfg.alibi:
        out.append(
            f"model.rope={cfg.rope}, model.alibi={cfg.alibi}: transformers' OLMo models use rotary position "
            f"embeddings only (no ALiBi, no learned positions); train with --model.rope=true --model.alibi=false "
            f"(or, for OLMo Hybrid, with no position encoding: --model.nope=true)."
        )
    if cfg.activation_type != ActivationType.swiglu:
        out.append(
            f"model.activation_type={cfg.activation_type}: transformers' OLMo MLP is SwiGLU only; train with "
            f"--model.activation_type=swiglu."
        )
    if cfg.effective_mlp_hidden_size % 2:
        out.append(f"model.mlp_hidden_size={cfg.effective_mlp_hidden_size} must be even for SwiGLU.")
    if cfg.include_bias or cfg.effective_bias_for_layer_norm:
        out.append(
            "model.include_bias / model.bias_for_layer_norm: transformers' OLMo MLP and norms have no biases; "
            "train with --model.include_bias=false."
        )
    for name in ("embedding_layer_norm", "scale_logits"):
        if getattr(cfg, name):
            out.append(f"model.{name}=true has no counterpart in transformers' OLMo models; train with it false.")
    if cfg.has_linear_attention:
        out += rms_qk_norm_problems(cfg, "OlmoHybridForCausalLM")
    elif cfg.is_moe:
        out += rms_qk_norm_problems(cfg, MOE_MODEL_TYPES[moe_model_type(cfg)])
    else:
        out += _olmo2_problems(cfg) if cfg.norm_after else _olmo1_problems(cfg)
    return out


def _olmo1_problems(cfg: ModelConfig) -> list[str]:
    fix = "or use the OLMo-2 architecture (norm_after, rms, QK-norm), which Olmo2ForCausalLM holds."
    out = []
    if cfg.layer_norm_type == LayerNormType.rms or cfg.layer_norm_with_affine:
        out.append(
            f"model.layer_norm_type={cfg.layer_norm_type}, model.layer_norm_with_affine="
            f"{cfg.layer_norm_with_affine}: OlmoForCausalLM (pre-norm OLMo-1) has only a layer norm without "
            f"weights; set --model.layer_norm_type=default --model.layer_norm_with_affine=false, {fix}"
        )
    if cfg.layer_norm_eps != _OLMO1_NORM_EPS:
        out.append(f"model.layer_norm_eps={cfg.layer_norm_eps}: OlmoForCausalLM's layer norm uses 1e-05 only.")
    if cfg.attention_layer_norm:
        out.append(
            f"model.attention_layer_norm=true (QK-norm) without model.norm_after: OlmoForCausalLM lacks it, {fix}"
        )
    return out


def _olmo2_problems(cfg: ModelConfig) -> list[str]:
    olmo2 = "Olmo2ForCausalLM / Olmo3ForCausalLM (the transformers classes with model.norm_after=true)"
    out = rms_qk_norm_problems(cfg, olmo2)
    if cfg.clip_qkv is not None:
        out.append(f"model.clip_qkv={cfg.clip_qkv}: {olmo2} has no clip_qkv; set --model.clip_qkv=null.")
    return out


def rms_qk_norm_problems(cfg: ModelConfig, name: str) -> list[str]:
    """The norms of ``cfg`` unless they are RMSNorm with weights and QK-norm with weights, which the transformers
    class ``name`` always has."""
    out = []
    if cfg.layer_norm_type != LayerNormType.rms or not cfg.layer_norm_with_affine:
        out.append(
            f"model.layer_norm_type={cfg.layer_norm_type}, model.layer_norm_with_affine={cfg.layer_norm_with_affine}: "
            f"{name} uses RMSNorm with weights; set --model.layer_norm_type=rms --model.layer_norm_with_affine=true."
        )
    if not cfg.attention_layer_norm or not cfg.attention_layer_norm_with_affine:
        out.append(
            f"model.attention_layer_norm={cfg.attention_layer_norm}, model.attention_layer_norm_with_affine="
            f"{cfg.attention_layer_norm_with_affine}: {name} always has QK-norm with weights; set both to true."
        )
    return out


def hf_model_type(cfg: ModelConfig) -> str:
    """``olmo3`` for the OLMo-2 architecture (``norm_after``) with a sliding window or RoPE scaling, ``olmo2`` for
    it without, else ``olmo``.

    :raises OLMoConfigurationError: listing every option that transformers' class cannot represent (one paragraph
        for one problem).
    """
    problems = _export_problems(cfg)
    if problems:
        listing = f" {problems[0]}" if len(problems) == 1 else "\n" + "\n".join(f"  - {p}" for p in problems)
        raise OLMoConfigurationError(
            f"This model cannot be converted to Hugging Face transformers exactly ({len(problems)} problem(s) in "
            f"its config.yaml); nothing was written:{listing}"
        )
    if cfg.has_linear_attention:
        return HYBRID
    if cfg.is_moe:
        return moe_model_type(cfg)
    if uses_olmo3(cfg):
        return "olmo3"
    return "olmo2" if cfg.norm_after else "olmo"


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """The keyword arguments of ``OlmoConfig`` / ``Olmo2Config`` / ``Olmo3Config`` that describe ``cfg`` (see
    :func:`hf_model_type`)."""
    model_type = hf_model_type(cfg)
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.effective_embedding_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.effective_mlp_hidden_size // 2,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.effective_n_kv_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.max_sequence_length,
        initializer_range=cfg.init_std,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=None,
        eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=cfg.weight_tying,
        rope_theta=float(cfg.rope_theta),
        attention_bias=False,
        attention_dropout=cfg.attention_dropout,
    )
    if model_type == "olmo":
        kwargs["clip_qkv"] = cfg.clip_qkv
    else:
        kwargs["rms_norm_eps"] = cfg.layer_norm_eps
    if model_type in MOE_MODEL_TYPES:
        kwargs.update(moe_config_kwargs(cfg))
    if model_type == "olmo3":
        del kwargs["rope_theta"]  # in rope_parameters, one entry per layer type
        kwargs.update(olmo3_config_kwargs(cfg))
    if model_type == HYBRID:
        del kwargs["rope_theta"]  # in rope_parameters
        kwargs.update(olmo_hybrid_config_kwargs(cfg))
    return kwargs


def build_hf_config(cfg: ModelConfig, dtype: torch.dtype) -> Any:
    """The transformers config (``OlmoConfig``, ``Olmo2Config`` or ``Olmo3Config``) of ``cfg``, for weights stored in
    ``dtype``."""
    kwargs = hf_config_kwargs(cfg)
    model_type = hf_model_type(cfg)
    config = hf_config_class(model_type)(**kwargs, architectures=[HF_MODEL_TYPES[model_type]])
    config.dtype = dtype
    return config


def model_config_from_hf(hf: Any, vocab_size: Optional[int] = None) -> ModelConfig:
    """Our model config for the transformers config ``hf`` (an ``OlmoConfig``, ``Olmo2Config`` or ``Olmo3Config``).

    :param vocab_size: The tokenizer's vocabulary (``model.vocab_size``: ids below it are real tokens); None, or
        one larger than the embedding, uses the embedding size.
    :raises OLMoConfigurationError: for a model type or option our model does not implement.
    """
    if hf.model_type not in HF_MODEL_TYPES:
        raise OLMoConfigurationError(
            f"model_type={hf.model_type!r} is not an OLMo model; only {', '.join(HF_MODEL_TYPES)} convert."
        )
    sizes = hf_size_problems(hf)
    if sizes:
        raise OLMoConfigurationError(
            f"The config.json of this {hf.model_type} model is damaged; nothing was written: {' '.join(sizes)}"
        )
    windows, problems = read_windows(hf)
    rope = read_rope(hf)
    problems += rope.problems + hf_import_problems(hf, rope.theta)
    problems += olmo_hybrid_import_problems(hf) if hf.model_type == HYBRID else []
    if problems:
        raise OLMoConfigurationError(
            f"This {hf.model_type} model cannot be represented by our model exactly; nothing was written. In its "
            f"config.json: " + " ".join(problems)
        )
    norm_after = hf.model_type in _NORM_AFTER_TYPES
    moe = moe_config_from_hf(hf) if hf.model_type in MOE_MODEL_TYPES else {}
    hidden = 2 * hf.intermediate_size
    eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, (list, tuple)) else hf.eos_token_id
    pad = hf.pad_token_id if hf.pad_token_id is not None else eos
    embedding_size = hf.vocab_size
    kv_heads = hf.num_key_value_heads or hf.num_attention_heads
    fields: dict[str, Any] = dict(
        d_model=hf.hidden_size,
        n_heads=hf.num_attention_heads,
        n_kv_heads=None if kv_heads == hf.num_attention_heads else kv_heads,
        clip_qkv=None if norm_after else hf.clip_qkv,
        n_layers=hf.num_hidden_layers,
        mlp_ratio=hidden // hf.hidden_size if hidden % hf.hidden_size == 0 else 4,
        mlp_hidden_size=None if hidden % hf.hidden_size == 0 else hidden,
        activation_type=ActivationType.swiglu,
        rope=True,
        rope_theta=int(rope.theta)
        if math.isfinite(rope.theta)
        else ModelConfig.rope_theta,  # NaN: olmo_hybrid's NoPE
        rope_scaling=rope.scaling,
        sliding_window=windows,
        attention_dropout=float(hf.attention_dropout or 0.0),
        residual_dropout=0.0,
        embedding_dropout=0.0,
        attention_layer_norm=norm_after,
        attention_layer_norm_with_affine=norm_after,
        layer_norm_type=LayerNormType.rms if norm_after else LayerNormType.default,
        layer_norm_with_affine=norm_after,
        layer_norm_eps=float(hf.rms_norm_eps) if norm_after else _OLMO1_NORM_EPS,
        norm_after=norm_after,
        max_sequence_length=hf.max_position_embeddings,
        include_bias=False,
        vocab_size=vocab_size if vocab_size is not None and vocab_size <= embedding_size else embedding_size,
        embedding_size=embedding_size,
        weight_tying=bool(hf.tie_word_embeddings),
        eos_token_id=eos if eos is not None else embedding_size - 1,
        pad_token_id=pad if pad is not None else embedding_size - 1,
        init_std=float(getattr(hf, "initializer_range", 0.02)),
    )
    hybrid = olmo_hybrid_fields(hf) if hf.model_type == HYBRID else {}
    return ModelConfig(**{**fields, **moe, **hybrid})


@dataclass(frozen=True)
class _Param:
    """One of our parameters and the transformers parameters it holds, stacked along dim 0 in this order."""

    ours: str
    hf: tuple[str, ...]


def _param_map(cfg: ModelConfig) -> list[_Param]:
    """Every parameter of our model (for an architecture :func:`hf_model_type` accepts), in state-dict order."""
    params = [_Param("transformer.wte.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layers):
        ours, hf = f"transformer.blocks.{i}.", f"model.layers.{i}."
        attn = hf + "self_attn."
        if cfg.layer_kinds()[i] == "linear_attention":
            params += [_Param(name, names) for name, names in linear_layer_names(ours, hf)]
            continue
        if cfg.is_moe:  # the experts themselves are olmo.hf.olmoe's
            params += _moe_block_params(cfg, ours, hf)
            continue
        if cfg.norm_after:
            params += [
                _Param(ours + "k_norm.weight", (attn + "k_norm.weight",)),
                _Param(ours + "q_norm.weight", (attn + "q_norm.weight",)),
            ]
        params += [
            _Param(ours + "attn_out.weight", (attn + "o_proj.weight",)),
            _Param(ours + "ff_out.weight", (hf + "mlp.down_proj.weight",)),
        ]
        if cfg.norm_after:
            params += [
                _Param(ours + "attn_norm.weight", (hf + "post_attention_layernorm.weight",)),
                _Param(ours + "ff_norm.weight", (hf + "post_feedforward_layernorm.weight",)),
            ]
        params += [
            _Param(ours + "att_proj.weight", tuple(attn + f"{p}_proj.weight" for p in "qkv")),
            _Param(ours + "ff_proj.weight", (hf + "mlp.up_proj.weight", hf + "mlp.gate_proj.weight")),
        ]
    if cfg.norm_after or cfg.is_moe:
        params.append(_Param("transformer.ln_f.weight", ("model.norm.weight",)))
    if not cfg.weight_tying:
        params.append(_Param("transformer.ff_out.weight", ("lm_head.weight",)))
    return params


def _moe_block_params(cfg: ModelConfig, ours: str, hf: str) -> list[_Param]:
    """A mixture-of-experts block's parameters but the experts: OLMoE's pre-norm names its norms after what they
    precede, FlexOlmo's (OLMo-2's) after what they follow."""
    attn = hf + "self_attn."
    norms = ("input_layernorm", "post_attention_layernorm")
    if cfg.norm_after:
        norms = ("post_attention_layernorm", "post_feedforward_layernorm")
    return [
        _Param(ours + "k_norm.weight", (attn + "k_norm.weight",)),
        _Param(ours + "q_norm.weight", (attn + "q_norm.weight",)),
        _Param(ours + "attn_out.weight", (attn + "o_proj.weight",)),
        _Param(ours + "attn_norm.weight", (hf + norms[0] + ".weight",)),
        _Param(ours + "ff_norm.weight", (hf + norms[1] + ".weight",)),
        _Param(ours + "att_proj.weight", tuple(attn + f"{p}_proj.weight" for p in "qkv")),
        _Param(ours + "moe.router.weight", (hf + "mlp.gate.weight",)),
    ]


def _split_sizes(cfg: ModelConfig, param: _Param) -> list[int]:
    if len(param.hf) == 1:
        return []
    if param.ours.endswith("att_proj.weight"):
        kv_dim = cfg.effective_n_kv_heads * (cfg.d_model // cfg.n_heads)
        return [cfg.d_model, kv_dim, kv_dim]
    half = cfg.effective_mlp_hidden_size // 2
    return [half, half]


def to_hf_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' state dict (views of ``state`` where possible, in a stable order) of our ``state``.

    :raises OLMoConfigurationError: as :func:`hf_model_type` does.
    """
    hf_model_type(cfg)
    expected = {p.ours for p in _param_map(cfg)}
    if cfg.is_moe:
        expected |= {f"transformer.blocks.{i}.moe.{m}" for i in range(cfg.n_layers) for m in ("w1", "w2", "w3")}
    assert set(state) == expected, f"state dict does not match the config: {sorted(set(state) ^ expected)}"
    out: dict[str, torch.Tensor] = {}
    for param in _param_map(cfg):
        tensor = state[param.ours]
        sizes = _split_sizes(cfg, param)
        parts = tensor.split(sizes, dim=0) if sizes else (tensor,)
        out.update(zip(param.hf, parts))
    if cfg.has_linear_attention:
        return to_saved_names(out, cfg)
    return {**out, **experts_to_hf(state, cfg)} if cfg.is_moe else out


def from_hf_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Our state dict of transformers' ``state`` for the model ``cfg`` (from :func:`model_config_from_hf`).

    :param source: Where ``state`` was read from, for the messages.
    :raises OLMoConfigurationError: if ``state`` lacks a parameter or holds one our model has no place for.
    """
    params = _param_map(cfg)
    state = from_saved_names(state) if cfg.has_linear_attention else state
    wanted = {name for p in params for name in p.hf} | (hf_expert_names(state, cfg) if cfg.is_moe else set())
    present = {k for k in state if not k.endswith(_IGNORED_HF_KEYS)}
    if cfg.weight_tying:
        present.discard("lm_head.weight")  # some writers save the tied copy too
    missing, unexpected = sorted(wanted - present), sorted(present - wanted)
    if missing or unexpected:
        raise OLMoConfigurationError(
            f"The weights in '{source}' do not match its config.json: missing {missing[:5] or 'none'}, "
            f"unexpected {unexpected[:5] or 'none'}"
            f"{' (and more)' if max(len(missing), len(unexpected)) > 5 else ''}. Is the directory complete?"
        )
    for name in sorted(wanted):
        if not state[name].is_floating_point():
            raise OLMoConfigurationError(
                f"The weight {name} in '{source}' is {str(state[name].dtype).replace('torch.', '')}, not floating "
                f"point: a quantized or damaged export, which our model cannot hold. Convert the model's original "
                f"float32, bfloat16 or float16 weights."
            )
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in OLMo(cfg).state_dict().items()}
    out = {}
    for param in params:
        parts = [state[name] for name in param.hf]
        try:
            out[param.ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        except RuntimeError as e:
            raise OLMoConfigurationError(
                f"The weights {param.hf} in '{source}' do not fit together: {e}"
            ) from None
        if tuple(out[param.ours].shape) != expected[param.ours]:
            raise OLMoConfigurationError(
                f"The weight {' + '.join(param.hf)} in '{source}' has shape {list(out[param.ours].shape)}, but its "
                f"config.json makes it {list(expected[param.ours])}: the weights and config.json come from different "
                f"models, or a file is damaged. Nothing was written."
            )
    return {**out, **experts_from_hf(state, cfg, source)} if cfg.is_moe else out
