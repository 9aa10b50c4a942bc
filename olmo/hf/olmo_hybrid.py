"""The OLMo Hybrid part of :mod:`olmo.hf.mapping` (which stays the one entry point): our models with
``linear_attention`` layers (``model.layer_types``), to and from transformers' ``OlmoHybridForCausalLM``
(``model_type: olmo_hybrid``).

transformers' model has two layer kinds, chosen per layer by its ``layer_types`` list:

* ``full_attention``: OLMo 3's attention layer (norm after attention and after the MLP, QK-norm over all query
  and all key channels, GQA through ``num_key_value_heads``), which is our block with ``model.norm_after``; no
  sliding window.
* ``linear_attention``: Gated DeltaNet, pre-norm (``input_layernorm`` before the mixer, ``post_attention_layernorm``
  before the MLP), which is our ``linear_attention`` block: its parameters carry transformers' names
  (``transformer.blocks.{i}.q_proj.weight`` is ``model.layers.{i}.linear_attn.q_proj.weight``), our
  ``attn_norm``/``ff_norm`` are its two norms, ``ff_proj`` is ``up_proj`` then ``gate_proj`` stacked and ``ff_out``
  is ``down_proj``, as for every other layer.

The config keys: ``layer_types`` is ``model.layer_kinds()`` (our pattern cycled; on import the shortest pattern
that reproduces it), ``linear_num_key_heads``/``linear_num_value_heads``/``linear_key_head_dim``/
``linear_value_head_dim``/``linear_conv_kernel_dim``/``linear_allow_neg_eigval`` are ``model.linear_attention``'s
``num_key_heads``/``num_value_heads``/``key_head_dim``/``value_head_dim``/``conv_kernel_size``/
``allow_neg_eigval``; ``linear_a_log_*`` and ``linear_dt_*`` only draw initial weights (ours are transformers'
defaults) and are not read.

RoPE. transformers' model has one ``rope_parameters`` for every attention layer (default, or a scaling such as
YaRN, which becomes our ``model.rope_scaling``), or none at all: ``rope_parameters.rope_theta`` null (what
transformers itself saves; OLMo-core writes a top-level ``"rope_theta": null``) means no position information in
any layer ("NoPE"), as the released OLMo-Hybrid-7B has it after its long-context stage dropped RoPE. A config.json
whose ``rope_parameters`` is null or missing, with no ``rope_theta`` either, gets transformers' default RoPE
(theta 10000) on load, which is what transformers then computes and what we import. NoPE is our ``model.nope``
(``model.rope=false`` alone would give learned positions, ``transformer.wpe``, which transformers' model lacks):
imported from a null theta, exported as ``rope_parameters`` with a null ``rope_theta``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import LinearAttentionConfig, ModelConfig
from ..config.linear_attention_sections import FULL_ATTENTION, LAYER_TYPES, LINEAR_ATTENTION
from .olmo3 import hf_scaling

__all__ = [
    "HYBRID",
    "olmo_hybrid_export_problems",
    "olmo_hybrid_config_kwargs",
    "olmo_hybrid_import_problems",
    "olmo_hybrid_fields",
    "linear_layer_names",
    "to_saved_names",
    "from_saved_names",
]

HYBRID = "olmo_hybrid"
"""transformers' ``model_type`` of OLMo Hybrid."""

_SAVED_NAMES = (
    ("input_layernorm", "attention_layer_norm"),
    ("post_attention_layernorm", "feedforward_layer_norm"),
)
"""transformers' names of two norms in memory and in its files (``save_pretrained`` renames them in every layer)."""
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
"""The three parts of ``linear_attn.conv1d.weight`` in transformers' files, stacked along dim 0 in this order."""

_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj", "conv1d", "o_norm")
"""The Gated DeltaNet layers whose ``.weight`` has the same name on both sides (under ``linear_attn.`` there)."""


def olmo_hybrid_export_problems(cfg: ModelConfig) -> list[str]:
    """The options of ``cfg`` (a model with ``linear_attention`` layers) that ``OlmoHybridForCausalLM`` cannot hold,
    each with its fix (the checks shared by every export, such as RoPE and SwiGLU, are :mod:`olmo.hf.mapping`'s)."""
    name = "OlmoHybridForCausalLM"
    kinds = cfg.layer_kinds()
    out = []
    if FULL_ATTENTION not in kinds or LINEAR_ATTENTION not in kinds:
        out.append(
            f"model.layer_types={list(cfg.layer_types or [])} gives the {cfg.n_layers} layers only "
            f"{kinds[0]} layers; {name} needs at least one full_attention and one linear_attention layer. Change "
            f"model.layer_types or model.n_layers."
        )
    if not cfg.norm_after:
        out.append(
            f"model.norm_after=false: the attention layers of {name} are OLMo 3's, with their norms after attention "
            f"and after the MLP; train with --model.norm_after=true (linear_attention layers stay pre-norm)."
        )
    if cfg.is_moe:
        out.append(f"model.moe: {name} has a dense MLP in every layer; train without model.moe.")
    if cfg.clip_qkv is not None:
        out.append(f"model.clip_qkv={cfg.clip_qkv}: {name} has no clip_qkv; set --model.clip_qkv=null.")
    windowed = [
        i for i, (w, k) in enumerate(zip(cfg.layer_windows(), kinds)) if w is not None and k == FULL_ATTENTION
    ]
    if windowed:
        out.append(
            f"model.sliding_window gives the full_attention layers {windowed[:4]} a window: {name} has no sliding-"
            f"window attention. Set --model.sliding_window=null, or a pattern with -1 on every attention layer."
        )
    la = cfg.linear_attention
    if la is not None and la.kind != "gated_deltanet":
        out.append(f"model.linear_attention.kind={la.kind!r}: {name}'s linear attention is gated_deltanet.")
    return out


def olmo_hybrid_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """``OlmoHybridConfig``'s hybrid keyword arguments for ``cfg`` (which passed the export checks): ``layer_types``,
    the ``linear_*`` shape and ``rope_parameters``."""
    la = cfg.linear_attention
    assert la is not None, "validation requires model.linear_attention with linear_attention layers"
    theta = float(cfg.rope_theta)
    rope = {"rope_type": "default", "rope_theta": None if cfg.nope else theta}
    return dict(
        layer_types=cfg.layer_kinds(),
        linear_num_key_heads=la.key_heads(cfg),
        linear_num_value_heads=la.value_heads(cfg),
        linear_key_head_dim=la.key_dim(cfg),
        linear_value_head_dim=la.value_dim(cfg),
        linear_conv_kernel_dim=la.conv_kernel_size,
        linear_allow_neg_eigval=la.allow_neg_eigval,
        rope_parameters=rope if cfg.rope_scaling is None else hf_scaling(cfg.rope_scaling, theta),
    )


def olmo_hybrid_import_problems(hf: Any) -> list[str]:
    """Why our model cannot hold the ``OlmoHybridConfig`` ``hf`` exactly (its RoPE scaling and sizes are checked
    with every other model type's)."""
    out = []
    unknown = sorted(set(hf.layer_types or []) - set(LAYER_TYPES))  # transformers checks their number
    if unknown:
        out.append(f"layer_types holds {unknown}: each layer of OLMo Hybrid is one of {', '.join(LAYER_TYPES)}.")
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
        value = getattr(hf, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            out.append(f"{key}={value!r} must be a positive whole number.")
    kernel = hf.linear_conv_kernel_dim
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel <= 0:
        out.append(f"linear_conv_kernel_dim={kernel!r} must be a positive whole number.")
    return out


def olmo_hybrid_fields(hf: Any) -> dict[str, Any]:
    """``model.layer_types`` (the shortest pattern that gives ``hf.layer_types`` cycled) and
    ``model.linear_attention`` for the ``OlmoHybridConfig`` ``hf`` (which passed the import checks); a null
    ``rope_parameters.rope_theta`` (NoPE) gives ``model.nope`` without ``model.rope``."""
    types = list(hf.layer_types)
    period = next(k for k in range(1, len(types) + 1) if all(t == types[i % k] for i, t in enumerate(types)))
    linear = LinearAttentionConfig(
        kind="gated_deltanet",
        num_key_heads=hf.linear_num_key_heads,
        num_value_heads=hf.linear_num_value_heads,
        key_head_dim=hf.linear_key_head_dim,
        value_head_dim=hf.linear_value_head_dim,
        conv_kernel_size=hf.linear_conv_kernel_dim,
        allow_neg_eigval=bool(hf.linear_allow_neg_eigval),
    )
    nope = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") is None
    return dict(
        layer_types=types[:period], linear_attention=linear, **({"rope": False, "nope": True} if nope else {})
    )


def linear_layer_names(ours: str, hf: str) -> list[tuple[str, tuple[str, ...]]]:
    """A ``linear_attention`` block's parameters: (our name, transformers' names stacked in it), for the block
    prefixes ``ours`` (``transformer.blocks.{i}.``) and ``hf`` (``model.layers.{i}.``)."""
    mixer = hf + "linear_attn."
    return [
        *((ours + p, (mixer + p,)) for p in ("A_log", "dt_bias")),
        (ours + "ff_out.weight", (hf + "mlp.down_proj.weight",)),
        (ours + "attn_norm.weight", (hf + "input_layernorm.weight",)),
        (ours + "ff_norm.weight", (hf + "post_attention_layernorm.weight",)),
        (ours + "ff_proj.weight", (hf + "mlp.up_proj.weight", hf + "mlp.gate_proj.weight")),
        *((ours + f"{p}.weight", (mixer + f"{p}.weight",)) for p in _LINEAR_NAMES),
    ]


def to_saved_names(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' state dict ``state`` (its model's names) under the names its ``save_pretrained`` writes, as
    the released checkpoints hold them: ``attention_layer_norm`` / ``feedforward_layer_norm`` for
    ``input_layernorm`` / ``post_attention_layernorm``, and each ``conv1d`` as ``q_conv1d``, ``k_conv1d`` and
    ``v_conv1d`` (views)."""
    la = cfg.linear_attention
    assert la is not None
    keys, values = la.key_heads(cfg) * la.key_dim(cfg), la.value_heads(cfg) * la.value_dim(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("linear_attn.conv1d.weight"):
            prefix = name.removesuffix("conv1d.weight")
            out.update(zip((f"{prefix}{c}.weight" for c in _CONVS), tensor.split([keys, keys, values])))
            continue
        for memory, saved in _SAVED_NAMES:
            name = name.replace(f".{memory}.", f".{saved}.")
        out[name] = tensor
    return out


def from_saved_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (read from a transformers directory, under either spelling) under transformers' model names, the
    inverse of :func:`to_saved_names`. Convolution parts that do not stack stay as they are, for the caller to
    report."""
    out: dict[str, torch.Tensor] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        for memory, saved in _SAVED_NAMES:
            name = name.replace(f".{saved}.", f".{memory}.")
        conv = next((c for c in _CONVS if name.endswith(f"linear_attn.{c}.weight")), None)
        if conv is None:
            out[name] = tensor
        else:
            convs.setdefault(name.removesuffix(f"{conv}.weight"), {})[conv] = tensor
    for prefix, parts in convs.items():
        shapes = {tuple(t.shape[1:]) for t in parts.values()}
        if set(parts) == set(_CONVS) and len(shapes) == 1:
            out[prefix + "conv1d.weight"] = torch.cat([parts[c] for c in _CONVS])
        else:
            out.update((f"{prefix}{c}.weight", t) for c, t in parts.items())
    return out
