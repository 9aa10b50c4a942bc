"""OLMo-core's ``config.json`` (ai2-olmo-core 3.x) as our config: the model section exactly, or a refusal.

OLMo-core's trainer writes ``stepN/config.json`` (its ``ConfigSaverCallback``): the experiment config's
``as_config_dict()``, whose ``model`` is a ``TransformerConfig`` (OLMo 3: ``TransformerConfig.olmo3_7B``). Keys
are OLMo-core's, ``null`` values are left out (so a missing key holds OLMo-core's default), and every nested config
names its class in ``_CLASS_``. How they map:

===============================================  ================================================================
OLMo-core (``model.``)                            ours (``model.``)
===============================================  ================================================================
``d_model``, ``n_layers``, ``vocab_size``         ``d_model``, ``n_layers``, ``embedding_size`` (the padded size)
``block.name: reordered_norm`` / ``default``      ``norm_after: true`` / ``false``
``block.sequence_mixer.qk_norm``                  ``attention_layer_norm`` (norms over all query / key channels)
``block.sequence_mixer.rope.theta``               ``rope_theta``
``block.sequence_mixer.sliding_window``           ``sliding_window`` (the same fields, meaning and order)
``...rope.scaling`` (``block_overrides`` of the   ``rope_scaling`` (``YaRNRoPEScalingConfig`` -> ``yarn``,
full-attention layers, ``with_rope_scaling``)     ``StepwiseRoPEScalingConfig`` -> ``llama3``)
``block.feed_forward.hidden_size`` (w1, w3)       ``mlp_hidden_size`` = 2 x hidden (our fused ``ff_proj``)
``block.layer_norm`` (``rms``), ``lm_head``       ``layer_norm_type: rms``, ``layer_norm_eps``, ``ln_f``
===============================================  ================================================================

``dataset.tokenizer`` gives ``vocab_size``, ``eos_token_id``, ``pad_token_id`` and the tokenizer; the train module's
``max_sequence_length`` (or the dataset's ``sequence_length``) gives ``max_sequence_length``; an AdamW optimizer
(``AdamWConfig``, ``SkipStepAdamWConfig``) gives ``optimizer``. Every option our model cannot reproduce exactly (MoE,
a hybrid of block types, a RoPE scaling on windowed layers, head-wise QK-norm, attention gates, ...) is one sentence of
a single :class:`~olmo.exceptions.OLMoConfigurationError`, raised before anything is read or written.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Optional

from ..config import (
    ActivationType,
    LayerNormType,
    ModelConfig,
    OptimizerConfig,
    OptimizerType,
    RopeScalingConfig,
    SlidingWindowConfig,
    TokenizerConfig,
    TrainConfig,
)
from ..config.attention_sections import attention_option_problems
from ..exceptions import OLMoConfigurationError
from ..util.tokenizer_files import DEFAULT_TOKENIZER

__all__ = ["train_config_from_olmo_core"]

log = logging.getLogger(__name__)

# Keys that change how a model is trained or stored, never what it computes in fp32.
_NEUTRAL = {"_CLASS_", "type", "dtype", "backend", "use_flash", "full_precision", "loss_implementation"}
_NEUTRAL_ATTENTION = _NEUTRAL | set(
    "mxfp8_projections mxfp8_qkv_projection mxfp8_out_projection use_recompute_qkv_prep mxfp8_save_qkv_for_backward".split()
)
_NEUTRAL_MODEL = _NEUTRAL | {"init_method", "init_seed", "init_std", "embedding_init_std", "freeze_params"}
_RMS_NAMES = ("rms", "fused_rms")  # the same function in fp32 (fused_rms is a Triton kernel of it)
# Hub ids of OLMo's tokenizers, and the names our tokenizer lookup finds offline (`make tokenizers`).
_OFFLINE_TOKENIZERS = {
    "allenai/dolma2-tokenizer": "tokenizers/allenai_dolma2.json",
    "allenai/gpt-neox-olmo-dolma-v1_5": DEFAULT_TOKENIZER,
}


def _cls(d: Any) -> str:
    """The class name a config dict records in ``_CLASS_`` (without its module), or ''."""
    return str(d.get("_CLASS_", "")).rsplit(".", 1)[-1] if isinstance(d, dict) else ""


def _our_window(sliding_window: Optional[dict[str, Any]]) -> Optional[SlidingWindowConfig]:
    """Our ``model.sliding_window`` for OLMo-core's ``SlidingWindowAttentionConfig``: the same fields and meaning
    (a forced first layer starts the cycle at layer 1), with OLMo-core's defaults (both ends forced)."""
    if sliding_window is None:
        return None
    return SlidingWindowConfig(
        pattern=list(sliding_window.get("pattern") or []),
        force_full_attention_on_first_layer=bool(sliding_window.get("force_full_attention_on_first_layer", True)),
        force_full_attention_on_last_layer=bool(sliding_window.get("force_full_attention_on_last_layer", True)),
    )


def _unknown(d: dict[str, Any], known: str, key: str, problems: list[str], neutral: set[str] = _NEUTRAL) -> None:
    """A problem for each key of ``d`` neither in ``known`` (space-separated) nor ``neutral``."""
    for name in sorted(set(d) - set(known.split()) - neutral):
        problems.append(
            f"{key}.{name}={d[name]!r} is unknown to this converter (written for ai2-olmo-core 3.0), so whether our "
            f"model computes the same is unknown; remove it from config.json only if it does not change the forward."
        )


def _norm(d: Any, key: str, problems: list[str]) -> tuple[float, bool, bool]:
    """(eps, affine, bias) of an OLMo-core ``LayerNormConfig`` that our RMSNorm reproduces."""
    if not isinstance(d, dict):
        problems.append(
            f"{key} is missing: our blocks and output always normalize (OLMo-2 / OLMo 3 as OLMo-core)."
        )
        return 1e-5, True, False
    if d.get("name", "default") not in _RMS_NAMES:
        problems.append(
            f"{key}.name={d.get('name', 'default')!r}: only RMSNorm ({', '.join(_RMS_NAMES)}) converts."
        )
    _unknown(d, "name eps elementwise_affine bias", key, problems)
    affine = bool(d.get("elementwise_affine", True))
    return float(d.get("eps", 1e-5)), affine, affine and bool(d.get("bias", True))


def _strip_scaling(block: dict[str, Any]) -> str:
    """``block`` without its RoPE scaling, comparable as text."""
    mixer = dict(block.get("sequence_mixer") or {})
    mixer["rope"] = {k: v for k, v in (mixer.get("rope") or {}).items() if k != "scaling"}
    return json.dumps({**block, "sequence_mixer": mixer}, sort_keys=True)


def _layer_blocks(model: dict[str, Any], n_layers: int, problems: list[str]) -> list[dict[str, Any]]:
    """Each layer's block config (``block``, or its ``block_overrides`` entry), refusing overrides that differ in
    anything but the RoPE scaling (what ``with_rope_scaling`` writes)."""
    base = model["block"]
    overrides = model.get("block_overrides") or {}
    blocks = [base] * n_layers
    for index, block in overrides.items():
        i = int(index) if str(index).isdigit() else -1
        if not 0 <= i < n_layers or not isinstance(block, dict):
            problems.append(f"model.block_overrides has the entry {index!r} for a model of {n_layers} layers.")
        elif _strip_scaling(block) != _strip_scaling(base):
            problems.append(
                f"model.block_overrides.{index} differs from model.block in more than its RoPE scaling: our model "
                f"builds every layer from one set of options."
            )
        else:
            blocks[i] = block
    return blocks


def _rope_scaling(
    scalings: list[Optional[dict[str, Any]]],
    windows: list[Optional[int]],
    head_dim: int,
    theta: float,
    problems: list[str],
) -> Optional[RopeScalingConfig]:
    """Our ``model.rope_scaling`` for OLMo-core's per-layer scalings; it applies to the full-attention layers only."""
    full = [i for i, w in enumerate(windows) if w is None]
    scaled = [i for i, s in enumerate(scalings) if s is not None]
    if not scaled:
        return None
    distinct = {json.dumps(scalings[i], sort_keys=True) for i in full}
    if scaled != full or len(distinct) != 1:
        problems.append(
            f"model.block.sequence_mixer.rope.scaling (with model.block_overrides) is set on layers {scaled} (full "
            f"attention: {full}): our model.rope_scaling applies one scaling to every full-attention layer and none "
            f"to a windowed one "
            f"(transformers' OLMo 3 convention; OLMo-core's with_rope_scaling(full_attn_layers_only=True)). Different "
            f"RoPE per layer type cannot be represented."
        )
        return None
    s = scalings[full[0]]
    assert s is not None
    kind, key = _cls(s), "sequence_mixer.rope.scaling (model.block or model.block_overrides)"
    if kind == "YaRNRoPEScalingConfig":
        _unknown(s, "factor beta_fast beta_slow old_context_len", key, problems)
        out = RopeScalingConfig(
            name="yarn",
            factor=float(s.get("factor", 8.0)),
            beta_fast=float(s.get("beta_fast", 32)),
            beta_slow=float(s.get("beta_slow", 1)),
            old_context_len=int(s.get("old_context_len", 8192)),
        )
        # OLMo-core caps the ramp's upper end at the last frequency (head_dim/2 - 1), transformers (and we) at
        # head_dim - 1: the two differ only when the ramp would end past the last frequency.
        end = head_dim * math.log(out.old_context_len / (out.beta_slow * 2 * math.pi)) / (2 * math.log(theta))
        if math.ceil(end) > head_dim // 2 - 1:
            problems.append(
                f"{key}: with old_context_len={out.old_context_len}, beta_slow={out.beta_slow}, rope theta {theta} and "
                f"head size {head_dim}, YaRN's ramp ends past the last frequency, where OLMo-core and transformers "
                f"(whose definition our model.rope_scaling follows) compute different frequencies."
            )
        return out
    if kind == "StepwiseRoPEScalingConfig":
        known = "factor low_freq_proportion high_freq_proportion old_context_len attention_rescale_factor"
        _unknown(s, known, key, problems)
        if float(s.get("attention_rescale_factor", 1.0)) != 1.0:
            problems.append(
                f"{key}.attention_rescale_factor={s['attention_rescale_factor']}: llama3 scaling has none."
            )
        return RopeScalingConfig(
            name="llama3",
            factor=float(s.get("factor", 32.0)),
            old_context_len=int(s.get("old_context_len", 8192)),
            low_freq_factor=1.0 / (1 - float(s.get("low_freq_proportion", 0.0))),
            high_freq_factor=1.0 / float(s.get("high_freq_proportion", 0.25)),
        )
    problems.append(
        f"{key} is a {kind or 'RoPE scaling without _CLASS_'}: only YaRNRoPEScalingConfig (model.rope_scaling.name=yarn) "
        f"and StepwiseRoPEScalingConfig (llama3) have a counterpart in our model."
    )
    return None


def _attention(mixer: dict[str, Any], d_model: int, problems: list[str]) -> dict[str, Any]:
    """Our model options from OLMo-core's ``AttentionConfig`` (``model.block.sequence_mixer``)."""
    key = "model.block.sequence_mixer"
    if _cls(mixer) != "AttentionConfig" or mixer.get("name", "default") != "default":
        problems.append(
            f"{key} is a {_cls(mixer) or 'mixer without _CLASS_'} named {mixer.get('name', 'default')!r}: only OLMo-core's "
            f"default attention (separate w_q, w_k, w_v) converts; recurrent mixers, fused_v2 and normalized attention "
            f"have no counterpart in our model."
        )
    known = (
        "name n_heads n_kv_heads head_dim bias rope clip_qkv qk_norm dropout sliding_window use_head_qk_norm "
        "scalable_softmax attention_sinks gate qk_norm_per_head_gains"
    )
    _unknown(mixer, known, key, problems, _NEUTRAL_ATTENTION)
    n_heads = int(mixer.get("n_heads", 16))
    head_dim = mixer.get("head_dim")
    if head_dim is not None and int(head_dim) * n_heads != d_model:
        problems.append(
            f"{key}.head_dim={head_dim} with {n_heads} heads is not d_model={d_model}: our heads are "
            f"d_model / n_heads wide."
        )
    for name in ("gate", "scalable_softmax", "attention_sinks", "use_head_qk_norm", "qk_norm_per_head_gains"):
        if mixer.get(name):
            problems.append(f"{key}.{name}={mixer[name]!r} has no counterpart in our model.")
    rope = mixer.get("rope")
    if not isinstance(rope, dict):
        problems.append(
            f"{key}.rope is missing: our model without RoPE learns absolute positions, OLMo-core's has none."
        )
        rope = {}
    _unknown(rope, "name theta no_global_rope scaling partial_rotary_factor", f"{key}.rope", problems)
    if rope.get("name", "default") != "default":
        problems.append(
            f"{key}.rope.name={rope['name']!r}: only OLMo-core's default (NeoX, rotate-half) RoPE converts."
        )
    if rope.get("no_global_rope"):
        problems.append(f"{key}.rope.no_global_rope=true: our full-attention layers always use RoPE.")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append(
            f"{key}.rope.partial_rotary_factor={rope['partial_rotary_factor']}: we rotate every channel."
        )
    qk_norm = mixer.get("qk_norm")
    out: dict[str, Any] = {
        "n_heads": n_heads,
        "n_kv_heads": mixer.get("n_kv_heads"),
        "clip_qkv": mixer.get("clip_qkv"),
        "attention_dropout": float(mixer.get("dropout") or 0.0),
        "rope_theta": int(rope.get("theta", 500_000)),
        "rope_full_precision": bool(rope.get("full_precision", True)),
        "attention_layer_norm": qk_norm is not None,
        "bias": bool(mixer.get("bias", True)),
    }
    if qk_norm is not None:
        out["qk_norm"] = _norm(qk_norm, f"{key}.qk_norm", problems)
    return out


def _tokenizer(cfg: dict[str, Any], embedding_size: int, problems: list[str]) -> tuple[int, int, int, str]:
    """(vocab_size, eos_token_id, pad_token_id, our tokenizer identifier) from OLMo-core's ``TokenizerConfig``."""
    dataset = cfg.get("dataset")
    tok = dataset.get("tokenizer") if isinstance(dataset, dict) else None
    if _cls(tok) != "TokenizerConfig":
        problems.append(
            "dataset.tokenizer is missing from config.json, so the vocabulary and the EOS and padding ids are unknown; "
            "use the config.json OLMo-core's trainer wrote (an ExperimentConfig with its dataset)."
        )
        return embedding_size, 0, 0, DEFAULT_TOKENIZER
    assert isinstance(tok, dict)
    vocab, eos, pad = (
        int(tok.get("vocab_size", 0)),
        int(tok.get("eos_token_id", -1)),
        int(tok.get("pad_token_id", -1)),
    )
    if not 0 < vocab <= embedding_size or not 0 <= eos < vocab or not 0 <= pad < vocab:
        problems.append(
            f"dataset.tokenizer (vocab_size {vocab}, eos {eos}, pad {pad}) does not fit the model's "
            f"{embedding_size} embedding rows."
        )
    identifier = tok.get("identifier")
    if identifier is None:
        log.warning(
            "config.json names no tokenizer; the converted config.yaml names %s, which may not match (set "
            "tokenizer.identifier when you fine-tune).",
            DEFAULT_TOKENIZER,
        )
        return vocab, eos, pad, DEFAULT_TOKENIZER
    return vocab, eos, pad, _OFFLINE_TOKENIZERS.get(str(identifier), str(identifier))


def _optimizer(cfg: dict[str, Any]) -> Optional[OptimizerConfig]:
    """Our AdamW settings from OLMo-core's (Skip-step) AdamW, or None for any other optimizer."""
    optim = (cfg.get("train_module") or {}).get("optim")
    if not isinstance(optim, dict) or _cls(optim) not in ("AdamWConfig", "SkipStepAdamWConfig"):
        return None
    betas = optim.get("betas", (0.9, 0.999))
    return OptimizerConfig(
        name=OptimizerType.adamw,
        learning_rate=float(optim.get("lr", 1e-3)),
        weight_decay=float(optim.get("weight_decay", 1e-2)),
        betas=(float(betas[0]), float(betas[1])),
        eps=float(optim.get("eps", 1e-8)),
    )


def _sequence_length(cfg: dict[str, Any], problems: list[str]) -> int:
    for section, key in (("train_module", "max_sequence_length"), ("dataset", "sequence_length")):
        part = cfg.get(section)
        value = part.get(key) if isinstance(part, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    problems.append(
        "config.json has neither train_module.max_sequence_length nor dataset.sequence_length, so the "
        "context length the model was trained at is unknown."
    )
    return 1


def _block(block: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Our model options from OLMo-core's ``TransformerBlockConfig`` (``model.block``), attention excepted."""
    key = "model.block"
    if block.get("feed_forward_moe") is not None or "moe" in str(block.get("name", "")):
        problems.append(f"{key} is a mixture-of-experts block ({block.get('name')}): our model is dense only.")
    elif block.get("name", "default") not in ("default", "reordered_norm"):
        problems.append(
            f"{key}.name={block['name']!r}: only OLMo-core's default (pre-norm) and reordered_norm (OLMo-2 / "
            f"OLMo 3, our model.norm_after=true) blocks convert."
        )
    known = (
        "sequence_mixer layer_norm feed_forward feed_forward_moe name dropout attention_residual_alpha "
        "feed_forward_residual_alpha"
    )
    _unknown(block, known, key, problems)
    for name in ("attention_residual_alpha", "feed_forward_residual_alpha"):
        if float(block.get(name) or 1.0) != 1.0:
            problems.append(
                f"{key}.{name}={block[name]}: our residual connections add the sub-layer output unscaled."
            )
    ff = block.get("feed_forward") or {}
    if block.get("feed_forward_moe") is None:
        _unknown(ff, "hidden_size name bias activation", f"{key}.feed_forward", problems)
        if _cls(ff) != "FeedForwardConfig" or ff.get("name", "default") != "default":
            problems.append(f"{key}.feed_forward is not OLMo-core's default feed-forward (w2(silu(w1 x) * w3 x)).")
        if ff.get("activation", "silu") != "silu":
            problems.append(
                f"{key}.feed_forward.activation={ff['activation']!r}: our gated MLP is SwiGLU (silu) only."
            )
    return {
        "norm_after": block.get("name") == "reordered_norm",
        "hidden": int(ff.get("hidden_size", 0)),
        "ff_bias": bool(ff.get("bias", True)),
        "residual_dropout": float(block.get("dropout") or 0.0),
        "norm": _norm(block.get("layer_norm"), f"{key}.layer_norm", problems),
    }


def train_config_from_olmo_core(cfg: dict[str, Any], run_name: str) -> TrainConfig:
    """Our config for the model OLMo-core's ``config.json`` ``cfg`` describes: its ``model`` section exactly, the
    tokenizer, context length and AdamW settings (the optimizer is our default when OLMo-core's is not AdamW).

    :raises OLMoConfigurationError: listing every option our model cannot reproduce exactly.
    """
    problems: list[str] = []
    model = cfg.get("model")
    if _cls(model) != "TransformerConfig" or not isinstance(model, dict):
        raise OLMoConfigurationError(
            f"config.json's model is a {_cls(model) or type(model).__name__}, not OLMo-core's TransformerConfig: only "
            f"OLMo-core transformer checkpoints (OLMo 2 / OLMo 3) convert. Nothing was written."
        )
    missing = [k for k in ("d_model", "vocab_size", "n_layers", "block", "lm_head") if not model.get(k)]
    if missing:
        raise OLMoConfigurationError(f"config.json's model lacks {missing}; it is damaged. Nothing was written.")
    if _cls(model["block"]) != "TransformerBlockConfig":
        raise OLMoConfigurationError(
            "config.json's model.block is not one TransformerBlockConfig but named blocks (a hybrid model): our "
            "model has one block type. Nothing was written."
        )
    if model.get("name", "default") != "default":
        problems.append(
            f"model.name={model['name']!r}: only OLMo-core's default transformer converts (MoE and "
            f"normalized transformers have no counterpart in our model)."
        )
    known = (
        "d_model vocab_size n_layers block lm_head embedding_norm name block_pattern block_overrides embed_scale "
        "tie_word_embeddings"
    )
    _unknown(model, known, "model", problems, _NEUTRAL_MODEL)
    for name in ("embedding_norm", "embed_scale", "block_pattern"):
        if model.get(name) is not None:
            problems.append(f"model.{name}={model[name]!r} has no counterpart in our model.")
    d_model, n_layers, embedding_size = int(model["d_model"]), int(model["n_layers"]), int(model["vocab_size"])
    block = _block(model["block"], problems)
    attention = _attention(model["block"].get("sequence_mixer") or {}, d_model, problems)
    head = model["lm_head"] if isinstance(model["lm_head"], dict) else {}
    _unknown(head, "name layer_norm bias", "model.lm_head", problems)
    if head.get("name", "default") != "default":
        problems.append(f"model.lm_head.name={head['name']!r}: only OLMo-core's default LM head converts.")
    final_norm = _norm(head.get("layer_norm"), "model.lm_head.layer_norm", problems)
    biases = {attention["bias"], block["ff_bias"], bool(head.get("bias", True))}
    if len(biases) > 1:
        problems.append(
            "model.block.sequence_mixer.bias, model.block.feed_forward.bias and model.lm_head.bias differ: "
            "our model.include_bias sets all three."
        )
    norms = [block["norm"], final_norm] + ([attention["qk_norm"]] if "qk_norm" in attention else [])
    if len({n[0] for n in norms}) > 1 or len({n[2] for n in norms}) > 1 or block["norm"][1] != final_norm[1]:
        problems.append(
            f"The block, QK and final norms differ in eps, weights or bias ({norms}): our model.layer_norm_eps "
            f"and model.bias_for_layer_norm hold one value for every norm."
        )

    layer_blocks = _layer_blocks(model, n_layers, problems)
    sliding = _our_window(model["block"].get("sequence_mixer", {}).get("sliding_window"))
    window_problems = attention_option_problems(sliding, None, rope=True)
    problems += window_problems
    windows: list[Optional[int]] = [None] * n_layers
    if sliding is not None and not window_problems:
        windows = sliding.windows(n_layers)
    scalings = [((b.get("sequence_mixer") or {}).get("rope") or {}).get("scaling") for b in layer_blocks]
    n_heads = attention["n_heads"]
    head_dim = d_model // n_heads if n_heads > 0 else d_model
    rope_scaling = _rope_scaling(scalings, windows, head_dim, attention["rope_theta"], problems)
    vocab, eos, pad, tokenizer = _tokenizer(cfg, embedding_size, problems)
    hidden = 2 * block["hidden"]
    model_cfg = ModelConfig(
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=attention["n_kv_heads"],
        clip_qkv=attention["clip_qkv"],
        n_layers=n_layers,
        mlp_ratio=hidden // d_model if hidden % d_model == 0 else 4,
        mlp_hidden_size=None if hidden % d_model == 0 else hidden,
        activation_type=ActivationType.swiglu,
        rope=True,
        rope_theta=attention["rope_theta"],
        rope_full_precision=attention["rope_full_precision"],
        rope_scaling=rope_scaling,
        sliding_window=sliding if any(w is not None for w in windows) else None,
        attention_dropout=attention["attention_dropout"],
        residual_dropout=block["residual_dropout"],
        embedding_dropout=0.0,
        attention_layer_norm=attention["attention_layer_norm"],
        attention_layer_norm_with_affine=attention.get("qk_norm", (0, True, 0))[1],
        layer_norm_type=LayerNormType.rms,
        layer_norm_with_affine=block["norm"][1],
        layer_norm_eps=block["norm"][0],
        bias_for_layer_norm=block["norm"][2],
        norm_after=block["norm_after"],
        max_sequence_length=_sequence_length(cfg, problems),
        include_bias=attention["bias"],
        vocab_size=vocab,
        embedding_size=embedding_size,
        weight_tying=bool(model.get("tie_word_embeddings", False)),
        eos_token_id=eos,
        pad_token_id=pad,
        init_std=float(model.get("init_std", 0.02)),
    )
    kv_heads = model_cfg.effective_n_kv_heads
    if n_heads <= 0 or kv_heads <= 0 or d_model % n_heads or n_heads % kv_heads:
        problems.append(
            f"model.block.sequence_mixer: {n_heads} heads ({kv_heads} key/value heads) do not divide d_model={d_model}."
        )
    problems += attention_option_problems(None, model_cfg.rope_scaling, rope=True)
    if problems:
        raise OLMoConfigurationError(
            "This OLMo-core checkpoint cannot be represented by our model exactly; nothing was written: "
            + " ".join(problems)
        )
    return TrainConfig(
        run_name=run_name,
        model=model_cfg,
        optimizer=_optimizer(cfg) or OptimizerConfig(),
        tokenizer=TokenizerConfig(identifier=tokenizer),
    )
