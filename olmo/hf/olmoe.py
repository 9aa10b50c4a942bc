"""The mixture-of-experts part of the mapping between our model and transformers' (:mod:`olmo.hf.mapping` holds the
rest): ``OlmoeForCausalLM`` and ``FlexOlmoForCausalLM``.

* ``OlmoeForCausalLM`` (``model_type: olmoe``): OLMoE. Pre-norm blocks with RMSNorm weights (``input_layernorm``
  before attention, ``post_attention_layernorm`` before the experts), QK-norm over all query and all key channels,
  ours with ``model.moe``, ``layer_norm_type: rms`` and ``attention_layer_norm``.
* ``FlexOlmoForCausalLM`` (``model_type: flex_olmo``): FlexOlmo, the OLMo-2 block (``norm_after``) with experts.

Both route as ours (softmax over the experts in float32, top ``k``, optionally renormalized: ``norm_topk_prob``) and
hold each expert as a SwiGLU MLP. The files hold the experts one by one, as the released checkpoints do and
transformers reads in every version: ``mlp.experts.{j}.gate_proj.weight`` (H, C) = our ``w1[j]`` transposed,
``up_proj`` = ``w3[j]``ᵀ, ``down_proj`` (C, H) = ``w2[j]``ᵀ; the router is ``mlp.gate.weight`` (E, C). Reading also
takes transformers 5's fused form (``mlp.experts.gate_up_proj`` (E, 2H, C), gate first, and ``mlp.experts.down_proj``
(E, C, H)). Not representable: a shared expert, sliding windows, RoPE scaling and ``clip_qkv`` (OLMoE's clamps after
the QK-norm, ours before it, as the original OLMo's), refused on export; a config.json with ``clip_qkv`` is refused
on import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import LayerNormType, ModelConfig
from ..config.moe_sections import MAX_EXPERTS, MoEConfig
from ..exceptions import OLMoConfigurationError

__all__ = [
    "MOE_MODEL_TYPES",
    "moe_model_type",
    "moe_export_problems",
    "moe_config_kwargs",
    "moe_config_from_hf",
    "expert_keys",
    "experts_to_hf",
    "experts_from_hf",
    "hf_expert_names",
]

MOE_MODEL_TYPES = {"olmoe": "OlmoeForCausalLM", "flex_olmo": "FlexOlmoForCausalLM"}
"""The transformers ``model_type`` values of mixture-of-experts OLMo models, and their model class."""

_CLIP = {
    True: "has no clip_qkv",
    False: "clamps queries and keys after the QK-norm, where ours (as the original OLMo) clamps before it",
}
_MATRICES = ("w1", "w3", "w2")
_HF_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_model_type(cfg: ModelConfig) -> str:
    """``flex_olmo`` for the OLMo-2 architecture (``norm_after``) with experts, else ``olmoe``."""
    return "flex_olmo" if cfg.norm_after else "olmoe"


def moe_export_problems(cfg: ModelConfig) -> list[str]:
    """The options of a mixture-of-experts ``cfg`` that neither transformers class can hold, with their fixes
    (the ones every OLMo export shares, and the norms, are :mod:`olmo.hf.mapping`'s)."""
    assert cfg.moe is not None
    out = []
    name = MOE_MODEL_TYPES[moe_model_type(cfg)]
    if cfg.moe.shared_expert_hidden_size is not None:
        out.append(
            f"model.moe.shared_expert_hidden_size={cfg.moe.shared_expert_hidden_size}: {name} has no shared expert; "
            f"train with it null."
        )
    for option in ("sliding_window", "rope_scaling"):
        if getattr(cfg, option) is not None:
            out.append(f"model.{option} with model.moe: {name} has no {option}; set --model.{option}=null.")
    if cfg.clip_qkv is not None:
        out.append(f"model.clip_qkv={cfg.clip_qkv}: {name} {_CLIP[cfg.norm_after]}; set --model.clip_qkv=null.")
    return out


def moe_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """``OlmoeConfig`` / ``FlexOlmoConfig`` keyword arguments beyond those every OLMo config takes."""
    moe = cfg.moe
    assert moe is not None
    out: dict[str, Any] = dict(
        intermediate_size=moe.expert_hidden_size(cfg),
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        router_aux_loss_coef=moe.lb_loss_weight,
        output_router_logits=False,
        rms_norm_eps=cfg.layer_norm_eps,
    )
    if not cfg.norm_after:
        out["clip_qkv"] = None
    return out


def moe_config_from_hf(hf: Any) -> dict[str, Any]:
    """Our ``ModelConfig`` fields for an ``OlmoeConfig`` / ``FlexOlmoConfig`` (beyond the shape every OLMo shares).

    :raises OLMoConfigurationError: for an expert count or top-k our model cannot hold.
    """
    experts, top_k = getattr(hf, "num_experts", None), getattr(hf, "num_experts_per_tok", None)
    for key, value in (("num_experts", experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OLMoConfigurationError(
                f"The config.json of this {hf.model_type} model is damaged; nothing was written: {key}={value!r} "
                f"must be a positive whole number."
            )
    assert isinstance(experts, int) and isinstance(top_k, int)
    if top_k > experts or experts > MAX_EXPERTS:
        raise OLMoConfigurationError(
            f"The config.json of this {hf.model_type} model is damaged; nothing was written: num_experts={experts} "
            f"and num_experts_per_tok={top_k} must satisfy 1 <= num_experts_per_tok <= num_experts <= {MAX_EXPERTS:,}."
        )
    if getattr(hf, "clip_qkv", None) is not None:
        raise OLMoConfigurationError(
            f"This {hf.model_type} model cannot be represented by our model exactly; nothing was written: "
            f"clip_qkv={hf.clip_qkv}: transformers' {MOE_MODEL_TYPES[hf.model_type]} {_CLIP[False]}."
        )
    moe = MoEConfig(
        num_experts=experts,
        top_k=top_k,
        hidden_size=hf.intermediate_size,
        norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
        lb_loss_weight=float(getattr(hf, "router_aux_loss_coef", 0.01)),
    )
    norm_after = hf.model_type == "flex_olmo"
    return dict(
        moe=moe,
        norm_after=norm_after,
        clip_qkv=None,
        attention_layer_norm=True,
        attention_layer_norm_with_affine=True,
        layer_norm_type=LayerNormType.rms,
        layer_norm_with_affine=True,
        layer_norm_eps=float(hf.rms_norm_eps),
    )


def expert_keys(cfg: ModelConfig, layer: int) -> list[str]:
    """The transformers names of layer ``layer``'s expert weights, as the files hold them (one by one)."""
    assert cfg.moe is not None
    mlp = f"model.layers.{layer}.mlp.experts."
    return [f"{mlp}{j}.{_HF_NAMES[m]}.weight" for j in range(cfg.moe.num_experts) for m in _MATRICES]


def experts_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' expert weights (transposed views) of our state dict ``state``."""
    assert cfg.moe is not None
    out = {}
    for i in range(cfg.n_layers):
        ours = f"transformer.blocks.{i}.moe."
        for j in range(cfg.moe.num_experts):
            for m in _MATRICES:
                out[f"model.layers.{i}.mlp.experts.{j}.{_HF_NAMES[m]}.weight"] = state[ours + m][j].T
    return out


def _fused(state: Mapping[str, torch.Tensor], layer: int) -> bool:
    return f"model.layers.{layer}.mlp.experts.gate_up_proj" in state


def hf_expert_names(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> set[str]:
    """The expert weights a transformers state dict must hold for ``cfg``: each layer's one by one, or fused."""
    names: set[str] = set()
    for i in range(cfg.n_layers):
        if _fused(state, i):
            names |= {f"model.layers.{i}.mlp.experts.{n}" for n in ("gate_up_proj", "down_proj")}
        else:
            names |= set(expert_keys(cfg, i))
    return names


def experts_from_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Our ``w1``/``w3``/``w2`` of every layer from transformers' expert weights in ``state`` (which holds the
    names :func:`hf_expert_names` gives)."""
    moe = cfg.moe
    assert moe is not None
    E, C, H = moe.num_experts, cfg.d_model, moe.expert_hidden_size(cfg)
    expected = {"w1": (E, C, H), "w3": (E, C, H), "w2": (E, H, C)}
    out = {}
    for i in range(cfg.n_layers):
        mlp = f"model.layers.{i}.mlp.experts."
        try:
            if _fused(state, i):
                gate, up = state[mlp + "gate_up_proj"].transpose(1, 2).chunk(2, dim=-1)  # 2 x (E, C, H)
                mats = {"w1": gate, "w3": up, "w2": state[mlp + "down_proj"].transpose(1, 2)}
            else:
                mats = {
                    m: torch.stack([state[f"{mlp}{j}.{_HF_NAMES[m]}.weight"].T for j in range(E)])
                    for m in _MATRICES
                }
        except RuntimeError as e:
            raise OLMoConfigurationError(
                f"The expert weights of layer {i} in '{source}' do not fit together: {e}"
            ) from None
        for m, tensor in mats.items():
            if tuple(tensor.shape) != expected[m]:
                raise OLMoConfigurationError(
                    f"The expert weights of layer {i} in '{source}' make {m} of shape {list(tensor.shape)}, but its "
                    f"config.json makes it {list(expected[m])}: the weights and config.json come from different "
                    f"models, or a file is damaged. Nothing was written."
                )
            out[f"transformer.blocks.{i}.moe.{m}"] = tensor.contiguous()
    return out
