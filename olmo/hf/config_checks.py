"""Checks of a transformers config.json that every model type we import shares (:mod:`olmo.hf.mapping` adds each
type's own): sizes that are positive whole numbers, and options our blocks lack."""

from __future__ import annotations

import math
from typing import Any

from ..config.model_sections import MAX_LAYERS

__all__ = ["hf_size_problems", "hf_import_problems"]

_POSITIVE_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


def hf_size_problems(hf: Any) -> list[str]:
    """Sizes of config.json that are not positive whole numbers (a damaged or hand-edited file)."""
    out = []
    for name in (*_POSITIVE_SIZES, "num_key_value_heads", "max_position_embeddings"):
        value = getattr(hf, name, None)
        if value is None and name not in _POSITIVE_SIZES:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            out.append(f"{name}={value!r} must be a positive whole number.")
    if not out and hf.num_hidden_layers > MAX_LAYERS:
        out.append(f"num_hidden_layers={hf.num_hidden_layers:,} is more than {MAX_LAYERS:,}.")
    if not out and hf.hidden_size % hf.num_attention_heads:
        out.append(
            f"hidden_size={hf.hidden_size} is not a multiple of num_attention_heads={hf.num_attention_heads}."
        )
    kv = getattr(hf, "num_key_value_heads", None)
    if not out and kv and hf.num_attention_heads % kv:
        out.append(f"num_attention_heads={hf.num_attention_heads} is not a multiple of num_key_value_heads={kv}.")
    return out


def hf_import_problems(hf: Any, theta: float) -> list[str]:
    """Options of the transformers config ``hf`` (any model type we convert; RoPE base ``theta``, NaN for none) that
    our blocks cannot hold."""
    out = []
    if getattr(hf, "attention_bias", False):
        out.append("attention_bias=true: our blocks have biases in every linear layer or in none.")
    if getattr(hf, "hidden_act", "silu") != "silu":
        out.append(f"hidden_act={hf.hidden_act!r}: our SwiGLU MLP uses silu.")
    if math.isnan(theta) and hf.model_type != "olmo_hybrid":
        out.append("rope_theta is null or missing: only OLMo Hybrid's attention goes without RoPE (model.nope).")
    elif not theta.is_integer() and not math.isnan(theta):  # NaN: OLMo Hybrid's NoPE
        out.append(f"rope_theta={theta}: model.rope_theta is an integer.")
    head_dim = getattr(hf, "head_dim", None)
    if head_dim is not None and head_dim * hf.num_attention_heads != hf.hidden_size:
        out.append(f"head_dim={head_dim}: ours is always hidden_size / num_attention_heads.")
    return out
