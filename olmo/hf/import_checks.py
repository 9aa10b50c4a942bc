"""What an import from transformers must pass before anything is written: the trainer's own validation of the
converted config, and finite weights. A config.json with an ``inf`` RoPE factor or loss weight, or a weight file
with NaN in it, converted without a word gave a checkpoint that the trainer then refused (or trained on NaN).

* :func:`check_imported_config` runs :func:`~olmo.config.validation.config_problems`, the very checks of a launch,
  on the :class:`~olmo.config.TrainConfig` the import writes, and names each problem's config.json field.
* :func:`non_finite_count` counts the NaN and infinite values of a tensor in slices of bounded size; the reader of
  the weights (:func:`olmo.hf.files.read_hf_weights`) refuses a tensor with any, naming it and its file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..config.bounds import problem_key
from ..config.validation import config_problems
from ..exceptions import OLMoCheckpointError, OLMoConfigurationError

__all__ = ["HF_FIELDS", "check_imported_config", "non_finite_count", "non_finite_weight_error"]

_ROPE = "the full-attention RoPE entry's (rope_parameters / rope_scaling)"
HF_FIELDS = {
    "model.d_model": "hidden_size",
    "model.n_heads": "num_attention_heads",
    "model.n_kv_heads": "num_key_value_heads",
    "model.n_layers": "num_hidden_layers",
    "model.mlp_hidden_size": "intermediate_size",
    "model.max_sequence_length": "max_position_embeddings",
    "model.vocab_size": "vocab_size",
    "model.embedding_size": "vocab_size",
    "model.eos_token_id": "eos_token_id",
    "model.pad_token_id": "pad_token_id",
    "model.clip_qkv": "clip_qkv",
    "model.layer_norm_eps": "rms_norm_eps",
    "model.init_std": "initializer_range",
    "model.attention_dropout": "attention_dropout",
    "model.rope_theta": "rope_theta",
    "model.sliding_window.pattern": "sliding_window / layer_types",
    "model.rope_scaling.factor": f"{_ROPE} factor",
    "model.rope_scaling.old_context_len": f"{_ROPE} original_max_position_embeddings",
    "model.rope_scaling.beta_fast": f"{_ROPE} beta_fast",
    "model.rope_scaling.beta_slow": f"{_ROPE} beta_slow",
    "model.rope_scaling.attention_factor": f"{_ROPE} attention_factor (or mscale / mscale_all_dim)",
    "model.rope_scaling.low_freq_factor": f"{_ROPE} low_freq_factor",
    "model.rope_scaling.high_freq_factor": f"{_ROPE} high_freq_factor",
    "model.moe.num_experts": "num_experts",
    "model.moe.top_k": "num_experts_per_tok",
    "model.moe.hidden_size": "intermediate_size",
    "model.moe.lb_loss_weight": "router_aux_loss_coef",
}
"""The config.json field each of our model keys is read from, to name it in a refusal."""

_SLICE = 2**24
"""Values checked at a time (64 MiB of float32 for a one-byte float): the check of a tensor of any size takes
bounded memory beyond the tensor itself."""


def check_imported_config(cfg: TrainConfig, model_type: str, source: Path) -> None:
    """Refuse ``cfg`` (the config an import of the ``model_type`` model in ``source`` would write) unless a launch
    would accept it: every problem the trainer's validation finds, in one paragraph, each with the config.json
    field it comes from.

    :raises OLMoConfigurationError: naming ``source``'s config.json and each field at fault.
    """
    problems = config_problems(cfg, 1)
    if not problems:
        return
    named = [f"{HF_FIELDS[problem_key(p)]}: {p}" if problem_key(p) in HF_FIELDS else p for p in problems]
    raise OLMoConfigurationError(
        f"The config.json of this {model_type} model in '{source}' gives a model config that the trainer refuses, "
        f"so its checkpoint could not be trained; nothing was written. {' '.join(named)} Fix these fields of "
        f"'{source / 'config.json'}' (or save the model again with transformers' save_pretrained from an intact "
        f"copy)."
    )


def non_finite_count(tensor: torch.Tensor) -> int:
    """How many values of the floating-point ``tensor`` are NaN or infinite, counted a slice at a time."""
    flat = tensor.detach().reshape(-1)
    count = 0
    for start in range(0, flat.numel(), _SLICE):
        part = flat[start : start + _SLICE]
        if part.element_size() == 1:  # float8 has no isfinite of its own
            part = part.float()
        count += int((~torch.isfinite(part)).sum())
    return count


def non_finite_weight_error(name: str, file: Any, bad: int, total: int) -> OLMoCheckpointError:
    """The refusal of the weight ``name`` in ``file`` that holds ``bad`` NaN or infinite values of ``total``."""
    share = "all" if bad == total else f"{bad:,} of"
    return OLMoCheckpointError(
        f"The weight {name} in '{file}' is damaged: {share} its {total:,} values are NaN or infinite, which no "
        f"trained model holds (a broken download or disk, or a model saved after its training diverged), and the "
        f"trainer could not train from it. Nothing was written. Convert an intact copy: download the model again, "
        f"or save it again with save_pretrained from a model whose weights are finite."
    )
