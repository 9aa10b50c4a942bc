"""The model's float8 training option (``model.float8``): which linear layers compute their matrix products in float8
through torchao, with the checks of its values (``problems``). The conversion itself is :mod:`olmo.distributed.float8`.

Absent (or ``enabled: false``) nothing is converted and a run computes exactly what it computed before the option
existed. Float8 changes how the matrix products are computed, not the weights: parameters, optimizer state and
checkpoints stay in their usual precision, so a float8 run's checkpoint resumes without float8 and the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import BaseConfig

__all__ = ["Float8Config", "FLOAT8_RECIPES", "OUTPUT_LAYER"]

FLOAT8_RECIPES = ("tensorwise", "rowwise")
"""The values of ``model.float8.recipe`` (torchao's recipe names)."""

OUTPUT_LAYER = "transformer.ff_out"
"""The output layer's module name (OLMo's). It is never converted: its product runs inside the loss (``lm_head``),
which the fused loss computes in chunks without the module's own forward."""


@dataclass
class Float8Config(BaseConfig):
    """Float8 matrix products in the blocks' linear layers (torchao's float8 training), on GPUs of compute capability
    8.9 or newer (Ada, Hopper, Blackwell; the rowwise recipe 9.0).

    Each converted layer casts its input, weight and output gradient to float8 with a dynamic scale and multiplies
    them on the GPU's float8 tensor cores; the weights themselves stay in their usual precision. With FSDP and the
    ``tensorwise`` recipe the weights are also all-gathered in float8 on GPUs (half the bytes of bf16).
    """

    enabled: bool = False
    """Convert the linear layers to float8 training (torchao must be installed: ``pip install torchao``)."""
    recipe: str = "tensorwise"
    """``tensorwise``: one scale per tensor, the fastest, float8 all-gather under FSDP (OLMo-core's and torchtitan's
    default). ``rowwise``: one scale per row, closer to bf16's numbers, a little slower, all-gathers in bf16."""
    emulate: bool = False
    """Compute the float8 casts and products in ordinary precision instead of on float8 tensor cores (torchao's
    emulation): the same rounding on any device, CPU included, with no speed gain. For tests and debugging."""
    skip: list[str] = field(default_factory=lambda: ["transformer.wte", OUTPUT_LAYER])
    """Module names kept in their usual precision, with the layers inside them (shell-style patterns, ``*`` matching
    any text: ``transformer.blocks.0`` for the first block, ``*.ff_out`` for every block's down projection). By default the embedding and the output layer, which float8
    would make less accurate for no gain. The embedding is not a linear layer and the output layer is never converted
    (its product runs in the loss), so both stay as they are in any case."""
    min_features: int = 1024
    """Keep a linear layer in its usual precision when its input or output width is below this: in small products
    the casts cost more than float8 saves. 1 converts every layer whose widths are multiples of 16 (float8's
    products need that; other layers are always kept)."""

    def problems(self) -> list[str]:
        """One sentence per bad value of ``model.float8``, each naming the key and the fix."""
        out: list[str] = []
        if self.recipe not in FLOAT8_RECIPES:
            out.append(
                f"model.float8.recipe={self.recipe!r} is not a float8 recipe; use one of {', '.join(FLOAT8_RECIPES)}."
            )
        if isinstance(self.min_features, bool) or not 1 <= self.min_features <= 2**24:
            out.append(
                f"model.float8.min_features={self.min_features} must be a width between 1 and 2**24 "
                "(1 converts every layer whose widths are multiples of 16)."
            )
        bad = [p for p in self.skip if not isinstance(p, str) or not p.strip()]
        if bad:
            out.append(
                f"model.float8.skip holds {bad!r}: each entry is a module name or a pattern such as "
                "'transformer.blocks.0.*'."
            )
        return out
