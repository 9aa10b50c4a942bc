"""The model's OLMo-3 attention options: sliding-window attention (``model.sliding_window``) and RoPE scaling
(``model.rope_scaling``), named as in OLMo-core, each with the checks of its values (``problems``).

Semantics (chosen to equal transformers' ``Olmo3ForCausalLM``, which OLMo 3's released checkpoints run in):

* A layer with window ``W`` lets the query at position ``i`` see the keys at ``i - W + 1 .. i``: ``W`` keys, itself
  included (transformers' ``kv_idx > q_idx - sliding_window``; flash-attn's ``window_size=(W - 1, 0)``).
* The pattern is cycled over the layers (layer ``i`` gets ``pattern[i % len(pattern)]``, ``-1`` = full attention),
  then the first and last layer are forced to full attention when asked; a forced first layer starts the cycle at
  layer 1, as OLMo-core does (``pattern[(i - 1) % len(pattern)]``).
* RoPE scaling applies to the full-attention layers only; windowed layers keep plain RoPE (transformers' OLMo-3
  config has one RoPE entry per layer type and puts ``rope_scaling`` on ``full_attention``). In a model without
  windows every layer is a full-attention layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .base import BaseConfig
from .bounds import with_bound_problems

if TYPE_CHECKING:
    from .model_sections import ModelConfig

__all__ = [
    "SlidingWindowConfig",
    "RopeScalingConfig",
    "RopeScalingName",
    "attention_option_problems",
    "attention_mask_warnings",
]

MAX_WINDOW = 2**24
"""The longest window accepted (the longest sequence validation accepts); -1 means full attention."""
RopeScalingName = ("yarn", "llama3")
"""The RoPE scalings implemented, by ``model.rope_scaling.name``."""


@dataclass
class SlidingWindowConfig(BaseConfig):
    """Sliding-window attention on some layers (OLMo 3: three of every four layers see the last 4,096 tokens)."""

    pattern: list[int] = field(default_factory=lambda: [4096, 4096, 4096, -1])
    """Window sizes cycled over the layers: layer i gets ``pattern[i % len(pattern)]`` keys (itself included);
    -1 means full attention."""
    force_full_attention_on_first_layer: bool = False
    """Give layer 0 full attention whatever the pattern says."""
    force_full_attention_on_last_layer: bool = True
    """Give the last layer full attention whatever the pattern says."""

    def windows(self, n_layers: int) -> list[Optional[int]]:
        """Each layer's window, None for full attention. As OLMo-core: a forced first layer starts the cycle at
        layer 1 (layer i gets ``pattern[(i - 1) % len(pattern)]``); a forced last layer just replaces its entry."""
        shift = 1 if self.force_full_attention_on_first_layer else 0
        out: list[Optional[int]] = [
            None if w == -1 else w
            for w in (self.pattern[(i - shift) % len(self.pattern)] for i in range(n_layers))
        ]
        if n_layers and self.force_full_attention_on_first_layer:
            out[0] = None
        if n_layers and self.force_full_attention_on_last_layer:
            out[-1] = None
        return out

    def problems(self) -> list[str]:
        """One sentence per bad value of ``model.sliding_window``, each naming the key and the fix."""
        pattern, out = list(self.pattern), list[str]()
        if not pattern:
            out.append(
                "model.sliding_window.pattern is empty: give the window of each layer in the cycle, e.g. "
                "[4096, 4096, 4096, -1] (-1 = full attention), or set model.sliding_window to null."
            )
        bad = [
            w
            for w in pattern
            if isinstance(w, bool) or not isinstance(w, int) or (w != -1 and not 1 <= w <= MAX_WINDOW)
        ]
        if bad:
            out.append(
                f"model.sliding_window.pattern={pattern} holds {bad}: each entry is a window of 1 to {MAX_WINDOW:,} "
                f"tokens, or -1 for full attention."
            )
        return out


@dataclass
class RopeScalingConfig(BaseConfig):
    """RoPE frequency scaling for contexts longer than the model was pretrained on, as transformers defines it
    (``rope_type: yarn`` / ``llama3``), on the full-attention layers."""

    name: str = "yarn"
    """``yarn`` (YaRN: interpolate the low frequencies, keep the high ones, scale attention) or ``llama3``
    (Llama 3.1's smoothed division of the low frequencies)."""
    factor: float = 8.0
    """How many times longer the new context is than ``old_context_len``."""
    old_context_len: int = 8192
    """The context length the model was trained at before scaling (transformers' ``original_max_position_embeddings``)."""
    beta_fast: float = 32.0
    """``yarn``: rotations within ``old_context_len`` above which a frequency is kept as it is."""
    beta_slow: float = 1.0
    """``yarn``: rotations below which a frequency is divided by ``factor``."""
    attention_factor: Optional[float] = None
    """``yarn``: multiplies cos and sin (so the attention logits by its square); None = ``0.1 * ln(factor) + 1``."""
    low_freq_factor: float = 1.0
    """``llama3``: wavelengths above ``old_context_len / low_freq_factor`` are divided by ``factor``."""
    high_freq_factor: float = 4.0
    """``llama3``: wavelengths below ``old_context_len / high_freq_factor`` are kept."""

    @property
    def effective_attention_factor(self) -> float:
        if self.name != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def problems(self, rope: bool) -> list[str]:
        """One sentence per bad value of ``model.rope_scaling``, each naming the key and the fix; a factor or beta
        that is not finite or is past :data:`~olmo.config.bounds.MAX_SCALE` included.

        :param rope: ``model.rope``; the scaling applies to RoPE, so it needs it.
        """
        out: list[str] = []
        if not rope:
            out.append(
                "model.rope_scaling is set but model.rope=false: scaling applies to RoPE; set model.rope=true."
            )
        if self.name not in RopeScalingName:
            out.append(f"model.rope_scaling.name={self.name!r} is not one of {', '.join(RopeScalingName)}.")
        if not self.factor >= 1.0:
            out.append(
                f"model.rope_scaling.factor={self.factor} must be at least 1 (how many times longer the context is)."
            )
        if self.old_context_len < 1:
            out.append(f"model.rope_scaling.old_context_len={self.old_context_len} must be positive.")
        if self.name == "yarn" and not self.beta_fast > self.beta_slow > 0:
            out.append(
                f"model.rope_scaling.beta_fast={self.beta_fast}, beta_slow={self.beta_slow}: YaRN needs "
                f"beta_fast > beta_slow > 0 (OLMo 3: 32 and 1)."
            )
        if self.name == "yarn" and self.attention_factor is not None and not self.attention_factor > 0:
            out.append(f"model.rope_scaling.attention_factor={self.attention_factor} must be positive (or null).")
        if self.name == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            out.append(
                f"model.rope_scaling.low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}: "
                f"llama3 scaling needs high_freq_factor > low_freq_factor > 0 (Llama 3.1: 4 and 1)."
            )
        return with_bound_problems(out, self, "model.rope_scaling.")


def attention_option_problems(
    sliding_window: Optional[SlidingWindowConfig], rope_scaling: Optional[RopeScalingConfig], rope: bool
) -> list[str]:
    """The problems of ``model.sliding_window`` and ``model.rope_scaling`` (either may be None), for a model with
    ``model.rope`` as given: what :meth:`ModelConfig.problems` reports of them, for the converters that check these
    options without a whole ``ModelConfig``."""
    out = [] if sliding_window is None else sliding_window.problems()
    return out if rope_scaling is None else out + rope_scaling.problems(rope)


MASK_WARNING_BYTES = 2**30
"""An attention mask this large (per forward) is worth a warning: flash-attn would need none."""


def attention_mask_warnings(model: ModelConfig, doc_masking: bool) -> list[str]:
    """A warning when the windows or document masking (``data.generate_doc_lengths``) will be an SDPA mask of a
    gigabyte or more per forward: (T, T) fp32, and a copy in the compute dtype on every layer that uses it. With
    flash-attn (``model.flash_attention`` on CUDA in bf16) there is no mask at all."""
    T = model.max_sequence_length
    windowed = any(w is not None and w < T for w in model.layer_windows())
    if not (windowed or doc_masking) or model.flash_attention or 4 * T * T < MASK_WARNING_BYTES:
        return []
    what = "model.sliding_window" if windowed else "data.generate_doc_lengths"
    return [
        f"{what} at model.max_sequence_length={T:,} without model.flash_attention: PyTorch SDPA then takes a "
        f"{T:,} x {T:,} attention mask, {4 * T * T / 2**30:,.1f} GiB in fp32 per forward (per instance with document "
        f"masking) plus a copy per layer in the compute dtype. Install flash-attn and set "
        f"--model.flash_attention=true on CUDA (its kernels take the window and the documents without a mask)."
    ]
