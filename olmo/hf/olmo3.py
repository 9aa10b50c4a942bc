"""The OLMo-3 part of :mod:`olmo.hf.mapping` (which stays the one entry point): sliding-window attention and RoPE
scaling, to and from transformers' ``Olmo3ForCausalLM`` (``model_type: olmo3``), and the RoPE scaling that
``Olmo2ForCausalLM`` reads too.

Export. A model of the OLMo-2 architecture (``norm_after``) with ``model.sliding_window`` or ``model.rope_scaling``
set becomes an ``Olmo3Config`` (a plain OLMo-2 model stays ``olmo2``, its files unchanged):

* ``layer_types`` from :meth:`~olmo.config.ModelConfig.layer_windows` (``sliding_attention`` for a windowed layer)
  and ``sliding_window`` the window size. transformers holds one size for every windowed layer, so a pattern with
  two sizes is refused. Without a windowed layer ``sliding_window`` is ``max_sequence_length``: transformers builds
  the sliding mask whatever the layer types, and no layer reads it.
* ``rope_parameters``: ``full_attention`` carries ``model.rope_scaling`` (yarn: ``factor``, ``beta_fast``,
  ``beta_slow``, ``original_max_position_embeddings``, and ``attention_factor`` always written, the one our model
  uses, as OLMo 3's released config has it; llama3: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings``); ``sliding_attention`` is plain RoPE. Both with ``model.rope_theta``.
* ``max_position_embeddings`` is ``model.max_sequence_length``, as for every export, not ``old_context_len *
  factor``: a round trip then gives back the same config. With a factor set, neither transformers' YaRN nor its
  llama3 reads ``max_position_embeddings``, so the numbers do not depend on it; where the two differ transformers
  only warns that its ratio is not the factor. OLMo 3's long-context stage trains at 65,536 = 8,192 * 8, which is
  also what its released config says, so for OLMo 3 both readings agree.

Import (``olmo3``, and ``olmo2`` with RoPE scaling, which transformers' Olmo2 applies to every layer):

* ``layer_types`` become the shortest ``model.sliding_window.pattern`` that reproduces them when cycled (the
  ``force_full_attention_on_first/last_layer`` flags used where they make it shorter; with the same length, the
  flags of OLMo 3's own config, last layer forced); the per-layer list where nothing shorter fits. No windowed
  layer: no ``model.sliding_window``.
* ``rope_parameters``: the windowed layers' entry must be plain RoPE with the same theta as the full-attention
  layers' (our model has one ``model.rope_theta`` and scales the full-attention layers only); yarn or llama3 on
  ``full_attention`` becomes ``model.rope_scaling``; anything else is refused, naming the key.
* YaRN as transformers computes it: ``beta_fast``/``beta_slow`` missing or 0 are 32 and 1; a missing ``factor`` is
  ``max_position_embeddings / original_max_position_embeddings``; ``mscale``/``mscale_all_dim`` become the
  ``attention_factor`` transformers derives from them. ``truncate``: transformers reads it from the top level of
  ``rope_parameters``, which for ``olmo3`` holds only the two layer types, so an OLMo-3 model always runs with the
  correction range floored/ceiled ("truncated"), whatever ``full_attention.truncate`` says; our YaRN always
  truncates too. So an ``olmo3`` ``truncate: false`` is accepted with a warning (transformers ignores it), and an
  ``olmo2`` one, which transformers honours, is refused.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ..config import ModelConfig, RopeScalingConfig, SlidingWindowConfig
from ..config.attention_sections import MAX_WINDOW, RopeScalingName, attention_option_problems

__all__ = [
    "uses_olmo3",
    "olmo3_export_problems",
    "olmo3_config_kwargs",
    "hf_scaling",
    "HFRope",
    "read_rope",
    "read_windows",
]

log = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"

_FLAG_ORDER = ((False, True), (False, False), (True, True), (True, False))
"""(force first, force last) tried for each pattern length: OLMo 3's own flags first, then the fewest flags."""


def uses_olmo3(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` (of an architecture transformers can hold) exports as ``Olmo3ForCausalLM``."""
    return cfg.norm_after and (cfg.sliding_window is not None or cfg.rope_scaling is not None)


def olmo3_export_problems(cfg: ModelConfig) -> list[str]:
    """The window and RoPE-scaling options of ``cfg`` that no transformers OLMo class can hold, with fixes."""
    out = []
    if not cfg.norm_after:
        for name in ("sliding_window", "rope_scaling"):
            if getattr(cfg, name) is not None:
                out.append(
                    f"model.{name} without model.norm_after: transformers' class for it is Olmo3ForCausalLM, which "
                    f"has the OLMo-2 architecture (norm_after, rms, QK-norm); OlmoForCausalLM has no {name}. Set "
                    f"--model.{name}=null, or use the OLMo-2 architecture."
                )
        return out
    sizes = sorted({w for w in cfg.layer_windows() if w is not None})
    if len(sizes) > 1 and cfg.sliding_window is not None:
        out.append(
            f"model.sliding_window.pattern={list(cfg.sliding_window.pattern)} gives the layers {len(sizes)} window "
            f"sizes ({', '.join(map(str, sizes))}), but transformers' Olmo3ForCausalLM holds one sliding_window for "
            f"every windowed layer; use a pattern with one size (and -1 for full attention)."
        )
    return out


def hf_scaling(scaling: RopeScalingConfig, theta: float) -> dict[str, Any]:
    """transformers' ``rope_parameters`` entry for ``scaling`` on RoPE with base ``theta``."""
    out: dict[str, Any] = dict(
        rope_type=scaling.name,
        rope_theta=theta,
        factor=float(scaling.factor),
        original_max_position_embeddings=scaling.old_context_len,
    )
    if scaling.name == "yarn":
        out.update(
            beta_fast=float(scaling.beta_fast),
            beta_slow=float(scaling.beta_slow),
            attention_factor=float(scaling.effective_attention_factor),
        )
    else:
        out.update(
            low_freq_factor=float(scaling.low_freq_factor), high_freq_factor=float(scaling.high_freq_factor)
        )
    return out


def olmo3_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """``Olmo3Config``'s ``layer_types``, ``sliding_window`` and ``rope_parameters`` for ``cfg``, which passed
    :func:`olmo3_export_problems`."""
    windows = cfg.layer_windows()
    sizes = {w for w in windows if w is not None}
    theta = float(cfg.rope_theta)
    plain = {"rope_type": "default", "rope_theta": theta}
    full = dict(plain) if cfg.rope_scaling is None else hf_scaling(cfg.rope_scaling, theta)
    layers = dict(
        layer_types=[FULL if w is None else SLIDING for w in windows],
        sliding_window=sizes.pop() if sizes else cfg.max_sequence_length,
    )
    if _transformers_4():
        # transformers 4 (4.57: the first with Olmo3) has one top-level rope_theta, and rope_scaling, which its
        # full-attention layers alone read; it has no rope_parameters (it would keep them unread).
        scaling = None if cfg.rope_scaling is None else {k: v for k, v in full.items() if k != "rope_theta"}
        return {**layers, "rope_theta": theta, "rope_scaling": scaling}
    return {**layers, "rope_parameters": {FULL: full, SLIDING: plain}}


def _transformers_4() -> bool:
    """Whether the installed transformers is a 4.x release (its configs hold ``rope_theta`` and ``rope_scaling``,
    not transformers 5's ``rope_parameters``)."""
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


def read_windows(hf: Any) -> tuple[Optional[SlidingWindowConfig], list[str]]:
    """``model.sliding_window`` for the transformers config ``hf`` (None unless ``olmo3`` with a windowed layer),
    and the reasons our model cannot hold its layers' attention."""
    if hf.model_type != "olmo3":
        return None, []
    layer_types = list(hf.layer_types or [])
    if len(layer_types) != hf.num_hidden_layers:
        return None, [f"layer_types has {len(layer_types)} entries for num_hidden_layers={hf.num_hidden_layers}."]
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        return None, [f"layer_types holds {unknown}: our layers have {SLIDING!r} or {FULL!r} attention."]
    if SLIDING not in layer_types:
        return None, []
    size = hf.sliding_window
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_WINDOW:
        return None, [
            f"sliding_window={size!r} must be a whole number of tokens from 1 to {MAX_WINDOW:,} for the {SLIDING} "
            f"layers."
        ]
    return shortest_pattern([size if t == SLIDING else None for t in layer_types]), []


def shortest_pattern(windows: list[Optional[int]]) -> Optional[SlidingWindowConfig]:
    """The ``model.sliding_window`` with the shortest pattern that, cycled (and with the force-full flags), gives
    each layer ``windows[i]`` (None = full attention); None when every layer has full attention."""
    n = len(windows)
    if all(w is None for w in windows):
        return None
    for k in range(1, n + 1):
        for first, last in _FLAG_ORDER:
            if (first and windows[0] is not None) or (last and windows[-1] is not None):
                continue  # a forced layer must be a full-attention layer
            start, end = int(first), n - int(last)  # the layers the pattern decides
            if windows[start + k : end] != windows[start : max(end - k, start)]:
                continue
            # The cycle starts at the first decided layer (layer 1 when the first is forced, as OLMo-core counts):
            # entry j is the window of layer start + j; -1 where no decided layer is left.
            decided = [windows[start + j] if start + j < end else None for j in range(k)]
            pattern = [-1 if w is None else w for w in decided]
            found = SlidingWindowConfig(
                pattern=pattern, force_full_attention_on_first_layer=first, force_full_attention_on_last_layer=last
            )
            assert found.windows(n) == windows, (windows, found)
            return found
    raise AssertionError("a pattern of every layer always fits")


@dataclass(frozen=True)
class HFRope:
    """The RoPE of a transformers config, as our model holds it."""

    theta: float
    """NaN when the config has none."""
    scaling: Optional[RopeScalingConfig]
    problems: list[str]
    """Why our model cannot hold it exactly; empty when it can."""


def read_rope(hf: Any) -> HFRope:
    """The RoPE of the transformers config ``hf`` (any model type we convert), as our model holds it."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if hf.model_type != "olmo3":
        theta = _theta(params.get("rope_theta", getattr(hf, "rope_theta", None)))
        if hf.model_type == "olmo" and _rope_type(params) != "default":
            why = (
                f"RoPE scaling of type {_rope_type(params)!r}: our OLMo-1 architecture (OlmoForCausalLM) has none."
            )
            return HFRope(theta, None, [why])
        scaling, problems = _read_scaling(hf, params, "rope_parameters", truncate_read=True)
        return HFRope(theta, scaling, _partial_rotary_problems(params, "rope_parameters") + problems)
    present = [t for t in (FULL, SLIDING) if t in set(hf.layer_types or [])]
    if not present:
        return HFRope(math.nan, None, [])  # layer_types is damaged, which read_windows reports
    if getattr(hf, "rope_parameters", None) is None:
        # A transformers 4 config object: one rope_theta, and rope_scaling for the full-attention layers only.
        base = getattr(hf, "rope_theta", None)
        scaling_params = getattr(hf, "rope_scaling", None) or {"rope_type": "default"}
        params = {
            FULL: {**scaling_params, "rope_theta": base},
            SLIDING: {"rope_type": "default", "rope_theta": base},
        }
    missing = [t for t in present if not isinstance(params.get(t), Mapping)]
    if missing:
        return HFRope(math.nan, None, [f"rope_parameters has no entry for the {missing[0]} layers."])
    problems = [p for t in present for p in _partial_rotary_problems(params[t], f"rope_parameters.{t}")]
    if SLIDING in present and _rope_type(params[SLIDING]) != "default":
        problems.append(
            f"rope_parameters.{SLIDING}.rope_type={_rope_type(params[SLIDING])!r}: our model scales RoPE on the "
            f"full-attention layers only (model.rope_scaling), as OLMo 3 does; its windowed layers use plain RoPE."
        )
    thetas = {t: _theta(params[t].get("rope_theta")) for t in present}
    if len(set(thetas.values())) > 1:
        problems.append(
            f"rope_parameters.{SLIDING}.rope_theta={thetas[SLIDING]:g} but rope_parameters.{FULL}.rope_theta="
            f"{thetas[FULL]:g}: our model has one model.rope_theta for every layer (a config.json with a top-level "
            f"rope_theta and no rope_parameters gets transformers' default 500000 for {SLIDING})."
        )
    scaling = None
    if FULL in present:
        scaling, more = _read_scaling(hf, params[FULL], f"rope_parameters.{FULL}", truncate_read=False)
        problems += more
    return HFRope(thetas[present[0]], scaling, problems)


def _theta(value: Any) -> float:
    return float(
        "nan" if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) else value
    )


def _rope_type(params: Mapping[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _partial_rotary_problems(params: Mapping[str, Any], where: str) -> list[str]:
    partial = params.get("partial_rotary_factor", 1.0)
    return (
        []
        if partial in (None, 1, 1.0)
        else [f"{where}.partial_rotary_factor={partial}: our RoPE rotates every channel."]
    )


def _mscale(factor: float, mscale: float = 1) -> float:
    """transformers' YaRN attention factor for ``factor`` (DeepSeek's ``mscale`` generalisation)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _read_scaling(
    hf: Any, params: Mapping[str, Any], where: str, truncate_read: bool
) -> tuple[Optional[RopeScalingConfig], list[str]]:
    """``model.rope_scaling`` for the ``rope_parameters`` entry ``params`` (at ``where`` in config.json).

    :param truncate_read: whether transformers reads ``truncate`` from ``params`` (olmo2; not olmo3).
    """
    rope_type = _rope_type(params)
    if rope_type == "default":
        return None, []
    if rope_type not in RopeScalingName:
        return None, [f"{where}.rope_type={rope_type!r}: our RoPE scaling is one of {RopeScalingName}."]
    keys: tuple[str, ...] = ("factor", "original_max_position_embeddings")
    keys += ("low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ()
    values: dict[str, Any] = {k: params.get(k) for k in keys}
    problems: list[str] = []
    old = values["original_max_position_embeddings"]
    if rope_type == "yarn" and values["factor"] is None and isinstance(old, int) and old > 0:
        values["factor"] = hf.max_position_embeddings / old  # as transformers' YaRN fills it in
    bad = [k for k, v in values.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad or not isinstance(old, int) or old < 1:
        shown = ", ".join(f"{k}={values[k]!r}" for k in bad or ["original_max_position_embeddings"])
        return None, [f"{where} ({rope_type}) needs numbers for {shown}."]
    factor = float(values["factor"])
    if rope_type == "llama3":
        scaling = RopeScalingConfig(
            name="llama3",
            factor=factor,
            old_context_len=old,
            low_freq_factor=float(values["low_freq_factor"]),
            high_freq_factor=float(values["high_freq_factor"]),
        )
    else:
        attention_factor, mscale, mscale_all_dim = (
            params.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim")
        )
        if attention_factor is None and mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        scaling = RopeScalingConfig(
            name="yarn",
            factor=factor,
            old_context_len=old,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            attention_factor=None if attention_factor is None else float(attention_factor),
        )
        truncate = params.get("truncate", True)
        if not truncate and truncate_read:
            problems.append(
                f"{where}.truncate={truncate}: transformers' YaRN then uses the correction range unrounded, while "
                f"ours floors/ceils it (as transformers' Olmo3ForCausalLM always does); set it to true or remove it."
            )
        elif not truncate:
            log.warning(
                "%s.truncate=%s is ignored: transformers reads truncate from the top level of rope_parameters, "
                "which for olmo3 holds only the layer types, so this model runs with the YaRN correction range "
                "floored/ceiled in transformers, as it does in ours.",
                where,
                truncate,
            )
    problems += [f"{where} would give {p}" for p in attention_option_problems(None, scaling, True)]
    return scaling, problems
