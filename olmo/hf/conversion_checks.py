"""What a conversion to or from transformers must pass before anything is written: the trainer's own validation of
the model's config, and finite weights. A config.json with an ``inf`` RoPE factor or loss weight, or a weight file
with NaN in it, converted without a word gave a checkpoint that the trainer then refused (or trained on NaN); a
checkpoint of ours with such a config or weights gave a transformers model that computes nothing useful.

* :func:`check_imported_config` refuses what :func:`~olmo.config.validation.config_problems`, the very checks of a
  launch, finds in the :class:`~olmo.config.TrainConfig` an import writes, naming each problem's config.json field.
* :func:`check_exported_config` runs the launch's checks of the ``model`` section (those that do not depend on how
  many processes trained it) on the config of a checkpoint to export.
* :func:`check_finite` refuses a tensor with a NaN or infinite value, naming it and its file or checkpoint, counted
  in slices of bounded size (:func:`non_finite_count`): the reader of transformers' weights
  (:func:`olmo.hf.files.read_hf_weights`) checks each file as it reads it, and an export its model's weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..config.bounds import problem_key, with_bound_problems
from ..exceptions import OLMoCheckpointError, OLMoConfigurationError

__all__ = [
    "HF_FIELDS",
    "IMPORT_WEIGHTS_FIX",
    "check_imported_config",
    "check_exported_config",
    "check_finite",
    "non_finite_count",
]

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
    "model.layer_types": "layer_types",
    "model.linear_attention.num_key_heads": "linear_num_key_heads",
    "model.linear_attention.num_value_heads": "linear_num_value_heads",
    "model.linear_attention.key_head_dim": "linear_key_head_dim",
    "model.linear_attention.value_head_dim": "linear_value_head_dim",
    "model.linear_attention.conv_kernel_size": "linear_conv_kernel_dim",
}
"""The config.json field each of our model keys is read from, to name it in a refusal."""

IMPORT_WEIGHTS_FIX = (
    "The trainer could not train from it: convert an intact copy (download the model again, or save it again with "
    "save_pretrained from a model whose weights are finite)."
)
"""How a refusal of an imported weight that is not finite ends."""

_SLICE = 2**24
"""Values checked at a time (64 MiB of float32 for a one-byte float): the check of a tensor of any size takes
bounded memory beyond the tensor itself."""


def check_imported_config(problems: list[str], model_type: str, source: Path) -> None:
    """Refuse the config an import of the ``model_type`` model in ``source`` would write unless a launch would accept
    it: every one of its ``problems`` (:func:`olmo.config.validation.config_problems` of it, for one process), in one
    paragraph, each with the config.json field it comes from.

    :raises OLMoConfigurationError: naming ``source``'s config.json and each field at fault.
    """
    if not problems:
        return
    named = [f"{HF_FIELDS[problem_key(p)]}: {p}" if problem_key(p) in HF_FIELDS else p for p in problems]
    raise OLMoConfigurationError(
        f"The config.json of this {model_type} model in '{source}' gives a model config that the trainer refuses, "
        f"so its checkpoint could not be trained; nothing was written. {' '.join(named)} Fix these fields of "
        f"'{source / 'config.json'}' (or save the model again with transformers' save_pretrained from an intact "
        f"copy)."
    )


def check_exported_config(model_cfg: ModelConfig, checkpoint: str) -> None:
    """Refuse to export the model of ``checkpoint`` if a launch would refuse the ``model`` section of its config
    (the checks of that section alone: how many processes trained it does not matter here).

    :raises OLMoConfigurationError: listing the section's problems in one paragraph.
    """
    problems = with_bound_problems(model_cfg.problems(), model_cfg, "model.")
    if problems:
        raise OLMoConfigurationError(
            f"The config.yaml of checkpoint '{checkpoint}' holds a model section that the trainer refuses, so a "
            f"transformers model made from it would not compute what was meant; nothing was written. "
            f"{' '.join(problems)} Export a checkpoint of a run whose config validates."
        )


def check_finite(state: Mapping[str, Any], where: str, fix: str) -> None:
    """Refuse the first floating-point tensor of ``state`` (read from ``where``: a quoted file, a checkpoint) that
    holds a NaN or an infinity, in one paragraph that ends with ``fix``.

    :raises OLMoCheckpointError: naming the tensor, ``where`` and how many of its values are not finite.
    """
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            bad = non_finite_count(tensor)
            if bad:
                share = "all" if bad == tensor.numel() else f"{bad:,} of"
                raise OLMoCheckpointError(
                    f"The weight {name} in {where} is damaged: {share} its {tensor.numel():,} values are NaN or "
                    f"infinite, which no trained model holds (a broken download or disk, or a model saved after its "
                    f"training diverged). Nothing was written. {fix}"
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
