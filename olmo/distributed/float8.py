"""Float8 training (``model.float8``), applied to a built model from the outside like compile and FSDP: the blocks'
linear layers swapped for torchao's ``Float8Linear`` (:func:`convert_float8`), which casts each product's operands
to float8 with dynamic scales and multiplies them on float8 tensor cores.

Which layers: every plain ``nn.Linear`` except those ``model.float8.skip`` names, those narrower than
``model.float8.min_features`` and those whose widths are not multiples of 16 (float8 products need that); the output
layer is never converted (its product runs in the loss, in chunks under ``fused_loss``), nor the experts' router (its
product is taken from its weight in fp32). :func:`float8_plan` says
which and why, without torchao, so ``--dry_run`` and the tests can show it anywhere.

The weights stay what they were (``Float8Linear`` keeps the layer's parameters and their names), so checkpoints,
optimizer state and exports are those of a plain run. Under FSDP on GPUs (NCCL) with the ``tensorwise`` recipe the weights are
all-gathered in float8 and their scales computed for all layers in one all-reduce after each optimizer step
(:func:`refresh_float8_scales`), as torchao recommends.
"""

from __future__ import annotations

import fnmatch
import importlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch import nn

from ..config import Float8Config
from ..config.float8_sections import OUTPUT_LAYER
from ..exceptions import OLMoConfigurationError

log = logging.getLogger(__name__)

__all__ = [
    "Float8Plan",
    "float8_plan",
    "float8_device_problem",
    "check_float8_device",
    "convert_float8",
    "refresh_float8_scales",
]

MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}
"""The compute capability each recipe's float8 products need (tensorwise: Ada and newer; rowwise: Hopper and newer,
whose CUTLASS kernel scales rows)."""
_SCALES_FLAG = "_float8_precompute_scales"
"""Set on a converted model whose float8 weights are all-gathered by FSDP (their scales are computed together)."""


@dataclass(frozen=True)
class Float8Plan:
    """Which linear layers of a model float8 training converts, and why each other one is kept."""

    converted: tuple[str, ...]
    """Module names converted, in the model's order."""
    kept: dict[str, str] = field(default_factory=dict)
    """Module name of each linear layer kept in its precision -> the reason."""
    unused_patterns: tuple[str, ...] = ()
    """``model.float8.skip`` entries that match no module (a typo?)."""

    def describe(self) -> str:
        """One line: how many layers are converted, their kinds, and the kept ones grouped by reason."""
        kinds = sorted({name.rsplit(".", 1)[-1] for name in self.converted})
        line = f"{len(self.converted)} linear layer(s) in float8 ({', '.join(kinds) or 'none'})"
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.kept.items():
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            line += f"; kept {shown}: {reason}"
        return line


def float8_plan(model: nn.Module, cfg: Float8Config) -> Float8Plan:
    """Which of ``model``'s linear layers ``cfg`` converts (works on the meta device and without torchao). A skip
    pattern keeps the layers it names and those inside the modules it names (``transformer.blocks.0``)."""
    converted: list[str] = []
    kept: dict[str, str] = {}
    used: set[str] = set()
    for name, module in model.named_modules():
        matched = [p for p in cfg.skip if fnmatch.fnmatchcase(name, p)]
        used.update(matched)
        if not isinstance(module, nn.Linear):
            continue
        parts = name.split(".")
        within = [
            p
            for i in range(len(parts) - 1, 0, -1)
            for p in cfg.skip
            if fnmatch.fnmatchcase(".".join(parts[:i]), p)
        ]
        reason = _kept_reason(name, module, cfg, matched + within)
        if reason is None:
            converted.append(name)
        else:
            kept[name] = reason
    defaults = ("transformer.wte", OUTPUT_LAYER)  # absent in some models (tied weights): no typo
    return Float8Plan(tuple(converted), kept, tuple(p for p in cfg.skip if p not in used and p not in defaults))


def _kept_reason(name: str, module: nn.Linear, cfg: Float8Config, matched: list[str]) -> Optional[str]:
    if name == OUTPUT_LAYER or type(module) is not nn.Linear:
        return "the output layer (its product runs in the loss)" if name == OUTPUT_LAYER else "not a plain linear"
    if name.endswith(".moe.router"):
        return "the expert router (its product is taken from its weight, in fp32)"
    if matched:
        return f"model.float8.skip ({matched[0]})"
    if module.in_features % 16 or module.out_features % 16:
        return "widths not multiples of 16"
    if min(module.in_features, module.out_features) < cfg.min_features:
        return f"narrower than model.float8.min_features={cfg.min_features}"
    return None


def _torchao_float8() -> Any:
    """``torchao.float8``, imported with the warnings of its first import kept quiet: the CUDA kernels a CPU cannot
    load (float8 training does not use them) and a deprecation inside torch that torchao triggers."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module("torchao.float8")
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def float8_device_problem(cfg: Optional[Float8Config], device: torch.device) -> Optional[str]:
    """Why float8 training as ``cfg`` says cannot run on ``device`` (one paragraph naming the key and the fix), or
    None when it can (or is off)."""
    if cfg is None or not cfg.enabled:
        return None
    try:
        _torchao_float8()
    except ImportError as e:
        return (
            f"model.float8.enabled=true trains through torchao's float8 layers, and torchao cannot be imported ({e}). "
            "Install it with `pip install 'torchao>=0.17'` (or `pip install -e '.[float8]'`), or set "
            "--model.float8.enabled=false."
        )
    if cfg.emulate:
        return None
    need = MIN_CAPABILITY.get(cfg.recipe, (9, 0))
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap >= need:
            return None
        where = f"this run's GPU ({torch.cuda.get_device_name(device)}) has compute capability {cap[0]}.{cap[1]}"
    else:
        where = f"this run trains on the {device.type.upper()}, which has none"
    return (
        f"model.float8.enabled=true with recipe {cfg.recipe} needs float8 tensor cores (NVIDIA compute capability "
        f"{need[0]}.{need[1]} or newer: {'Ada, ' if need < (9, 0) else ''}Hopper, Blackwell), and {where}. Train "
        "without it (--model.float8.enabled=false), or set --model.float8.emulate=true for torchao's emulation: "
        "the same float8 rounding computed in ordinary precision, on any device, with no speed gain (for tests and "
        "debugging)."
    )


def check_float8_device(cfg: Optional[Float8Config], device: torch.device) -> None:
    """Raise :class:`OLMoConfigurationError` with :func:`float8_device_problem`'s paragraph, if any."""
    problem = float8_device_problem(cfg, device)
    if problem is not None:
        raise OLMoConfigurationError(problem)


def convert_float8(model: nn.Module, cfg: Float8Config, fsdp: bool) -> Float8Plan:
    """Swap the linear layers :func:`float8_plan` chooses for torchao's ``Float8Linear`` (before compile and FSDP:
    the model may be on the meta device) and return the plan.

    :param fsdp: FSDP2 will shard the model over NCCL: with the ``tensorwise`` recipe its weights are then
        all-gathered in float8 and :func:`refresh_float8_scales` computes their scales. (Not over gloo, which has no
        float8 type: emulated runs on CPUs all-gather their weights as they are.)
    """
    plan = float8_plan(model, cfg)
    for pattern in plan.unused_patterns:
        log.warning("model.float8.skip entry %r matches no module of the model; is it spelled right?", pattern)
    float8 = _torchao_float8()
    all_gather = fsdp and cfg.recipe == "tensorwise"
    config = replace(
        float8.Float8LinearConfig.from_recipe_name(cfg.recipe),
        emulate=cfg.emulate,
        enable_fsdp_float8_all_gather=all_gather,
    )
    chosen = set(plan.converted)
    float8.convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in chosen, config=config)
    setattr(model, _SCALES_FLAG, all_gather and bool(chosen))
    if not chosen:
        log.warning(
            "model.float8.enabled=true converts no layer of this model (%s): it trains as without float8. Lower "
            "model.float8.min_features or shorten model.float8.skip to convert some.",
            plan.describe(),
        )
    log.info(
        "Float8 (%s%s%s): %s.",
        cfg.recipe,
        ", emulated" if cfg.emulate else "",
        ", float8 all-gather" if all_gather else "",
        plan.describe(),
    )
    return plan


def refresh_float8_scales(model: nn.Module) -> None:
    """After each optimizer step, and after a checkpoint is loaded into it, of a model whose float8 weights FSDP
    all-gathers: compute every layer's weight scale from the weights as they now are, in one all-reduce (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``; else the next forward would use the scales of the weights before a
    load, or compute one per layer). Nothing for any other model."""
    if getattr(model, _SCALES_FLAG, False):
        _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
