"""The model's hybrid options: which layers mix the sequence with attention and which with a linear-attention
recurrence (``model.layer_types``), and the shape of that recurrence (``model.linear_attention``, OLMo Hybrid's Gated
DeltaNet), with the checks of their values (:func:`layer_type_problems`). The mixer itself is
:mod:`olmo.model.linear_attention`.

Both absent, every layer is attention and the model computes exactly what it computed before the options existed.
Defaults follow transformers' ``OlmoHybridConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from .base import BaseConfig

if TYPE_CHECKING:
    from .model_sections import ModelConfig

__all__ = ["LinearAttentionConfig", "LAYER_TYPES", "FULL_ATTENTION", "LINEAR_ATTENTION", "layer_type_problems"]

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
"""The values of ``model.layer_types`` (transformers' names)."""

LINEAR_ATTENTION_KINDS = ("gated_deltanet",)
"""The values of ``model.linear_attention.kind``."""

MAX_CONV_KERNEL = 64
"""The widest short convolution accepted (OLMo Hybrid: 4)."""


@dataclass
class LinearAttentionConfig(BaseConfig):
    """The linear-attention layers' recurrence: Gated DeltaNet as in OLMo Hybrid (a short causal convolution with
    SiLU on q, k and v; L2-normalised q and k; a per-head decay gate and write strength beta; the gated RMSNorm on
    the output). A head's state is a ``key_head_dim x value_head_dim`` matrix whatever the sequence length."""

    kind: str = "gated_deltanet"
    """The recurrence; only ``gated_deltanet`` is implemented."""
    num_key_heads: Optional[int] = None
    """Query/key heads; None = ``model.n_heads`` (transformers' default)."""
    num_value_heads: Optional[int] = None
    """Value heads (each with its own decay, beta and state); a multiple of ``num_key_heads``, whose q and k each
    group of value heads shares. None = ``model.n_heads``."""
    key_head_dim: Optional[int] = None
    """Size of each query/key head; None = ``int(0.75 * d_model / num_key_heads)`` (transformers' default)."""
    value_head_dim: Optional[int] = None
    """Size of each value head; None = ``2 * key_head_dim``."""
    conv_kernel_size: int = 4
    """Width of the short causal depthwise convolution on q, k and v (the token and the ones before it)."""
    allow_neg_eigval: bool = True
    """Scale beta (a sigmoid) by 2, to (0, 2): the state's transition may then have negative eigenvalues, which lets
    the recurrence track parity-like state (OLMo Hybrid: true)."""

    def key_heads(self, model: ModelConfig) -> int:
        return self.num_key_heads if self.num_key_heads is not None else model.n_heads

    def value_heads(self, model: ModelConfig) -> int:
        return self.num_value_heads if self.num_value_heads is not None else model.n_heads

    def key_dim(self, model: ModelConfig) -> int:
        """The size of each query/key head."""
        if self.key_head_dim is not None:
            return self.key_head_dim
        heads = self.key_heads(model)
        return int(0.75 * model.d_model / heads) if heads > 0 else 0

    def value_dim(self, model: ModelConfig) -> int:
        """The size of each value head."""
        return self.value_head_dim if self.value_head_dim is not None else 2 * self.key_dim(model)

    def problems(self, model: ModelConfig) -> list[str]:
        """One sentence per bad value of ``model.linear_attention`` in ``model``, each naming the key and the fix."""
        out: list[str] = []
        if self.kind not in LINEAR_ATTENTION_KINDS:
            out.append(
                f"model.linear_attention.kind={self.kind!r} is not implemented; use "
                f"{', '.join(LINEAR_ATTENTION_KINDS)}."
            )
        sizes = {
            "num_key_heads": self.key_heads(model),
            "num_value_heads": self.value_heads(model),
            "key_head_dim": self.key_dim(model),
            "value_head_dim": self.value_dim(model),
        }
        bad = [name for name, size in sizes.items() if isinstance(size, bool) or not 1 <= size <= 2**20]
        for name in bad:
            out.append(
                f"model.linear_attention.{name}={sizes[name]} must be a positive whole number (null: transformers' "
                f"default from model.d_model and model.n_heads)."
            )
        keys, values = sizes["num_key_heads"], sizes["num_value_heads"]
        if not {"num_key_heads", "num_value_heads"} & set(bad) and values % keys:
            out.append(
                f"model.linear_attention.num_value_heads={values} must be a multiple of num_key_heads={keys}: each "
                f"group of value heads shares one query/key head. Set num_value_heads to a multiple of {keys}."
            )
        k = self.conv_kernel_size
        if isinstance(k, bool) or not 1 <= k <= MAX_CONV_KERNEL:
            out.append(
                f"model.linear_attention.conv_kernel_size={k} must be between 1 and {MAX_CONV_KERNEL} (OLMo Hybrid: 4)."
            )
        return out


def layer_type_problems(model: ModelConfig) -> list[str]:
    """One sentence per bad value of ``model.layer_types`` and ``model.linear_attention``, each naming the key and
    the fix."""
    types = model.layer_types
    if types is None:
        return []
    out: list[str] = []
    unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if not types or unknown:
        out.append(
            f"model.layer_types={list(types)} must list one or more of {', '.join(LAYER_TYPES)} (the pattern cycled "
            f"over the layers, e.g. [linear_attention, linear_attention, linear_attention, full_attention]); "
            f"null makes every layer full attention."
        )
        return out
    if LINEAR_ATTENTION in types and model.linear_attention is None:
        out.append(
            "model.layer_types has linear_attention layers but model.linear_attention is not set: add "
            "model.linear_attention (e.g. {kind: gated_deltanet}, transformers' defaults for the rest), or make "
            "every layer full_attention."
        )
    if model.linear_attention is not None and LINEAR_ATTENTION in model.layer_kinds():
        out += model.linear_attention.problems(model)
    return out
