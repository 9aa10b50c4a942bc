"""Checks on a loaded :class:`~olmo.config.TrainConfig` that types alone cannot express.

Every problem is collected and reported together, so a user fixes a config in one pass. Settings
that are accepted for OLMo compatibility but have no effect produce a warning, as does a warmup as long as the run. Besides the values
themselves, this checks what the config names on this machine (the tokenizer, downstream task labels,
the remote upload client) through low-level helpers only, so the config layer imports nothing above it.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..exceptions import OLMoConfigurationError
from ..util import env_rank, missing_slash_problem, remote_save_folder_problems
from ..util.tokenizer_files import load_base_tokenizer, resolve_tokenizer_path
from .attention import attention_mask_warnings, attention_option_problems
from .bounds import MAX_TIMEOUT_SECONDS, non_finite_problems
from .data_sections import EvaluatorConfig
from .data_validation import MEMMAP_DTYPES, data_location_problems, data_problems
from .optim_validation import optim_problems, warmup_warnings
from .sections import EvaluatorType, FSDPWrapStrategy, TruncationDirection
from .stability import stability_problems
from .stages import parse_duration_steps, stage_problems

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = [
    "validate_train_config",
    "config_problems",
    "data_location_problems",
    "parse_duration_steps",
    "evaluator_problems",
    "evaluator_batch_size",
    "tokenizer_problems",
    "task_labels",
    "unknown_label_problems",
    "MEMMAP_DTYPES",
]

log = logging.getLogger(__name__)

PRECISIONS = ("amp_bf16", "amp_fp16", "fp32")


def validate_train_config(cfg: TrainConfig, world_size: int) -> None:
    """Raise one :class:`OLMoConfigurationError` listing every problem, or warn about settings that have no effect
    (or not the one meant) and return."""
    problems = config_problems(cfg, world_size)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise OLMoConfigurationError(
            f"The config has {len(problems)} problem(s); fix them in the YAML or with --key=value:\n{listing}"
        )
    _warn_no_effect(cfg)


def config_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """Every problem of ``cfg`` for a launch of ``world_size`` processes, one line each (empty when there is none).
    A ``nan`` or ``inf`` that no check of its key reports (with the key's range) is reported as not finite."""
    problems = _value_problems(cfg, world_size)
    reported = {_key_of(p) for p in problems}
    return problems + [p for key, p in non_finite_problems(cfg).items() if key not in reported]


def _key_of(problem: str) -> str:
    """The key a ``key=value ...`` problem is about (``stages[1] (anneal).kl_beta=...``: ``stages[1].kl_beta``)."""
    return re.sub(r" \([^)]*\)", "", problem.split("=", 1)[0])


def _value_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    problems: list[str] = []
    problems += _model_problems(cfg)
    problems += _batch_problems(cfg, world_size)
    problems += data_problems(cfg)
    problems += optim_problems(cfg)
    problems += _checkpoint_problems(cfg)
    problems += _run_name_problems(cfg)
    problems += _location_problems(cfg)
    problems += _strategy_problems(cfg, world_size)
    if cfg.evaluators:
        problems += evaluator_problems(cfg)
    problems += tokenizer_problems(cfg)
    problems += remote_save_folder_problems(cfg.remote_save_folder, cfg.save_folder)
    problems += stage_problems(cfg)
    problems += stability_problems(cfg)
    return problems


def _model_problems(cfg: TrainConfig) -> list[str]:
    m = cfg.model
    out: list[str] = []
    if m.d_model % m.n_heads != 0:
        out.append(f"model.d_model={m.d_model} must be divisible by model.n_heads={m.n_heads}.")
    elif (m.d_model // m.n_heads) % 2 != 0 and m.rope:
        out.append(f"model.rope needs an even head size; d_model/n_heads = {m.d_model // m.n_heads}.")
    if m.n_kv_heads is not None and m.multi_query_attention and m.n_kv_heads != 1:
        out.append(
            f"model.multi_query_attention=true contradicts model.n_kv_heads={m.n_kv_heads}; "
            f"remove multi_query_attention and keep n_kv_heads."
        )
    kv = m.effective_n_kv_heads
    if kv <= 0 or m.n_heads % kv != 0:
        out.append(f"model.n_kv_heads={kv} must be positive and divide model.n_heads={m.n_heads}.")
    if m.alibi and m.rope:
        out.append("model.alibi and model.rope are mutually exclusive; set one of them to false.")
    if m.alibi and m.flash_attention:
        out.append("model.alibi does not work with model.flash_attention; disable one of them.")
    if m.effective_embedding_size < m.vocab_size:
        out.append(f"model.embedding_size={m.embedding_size} must be at least model.vocab_size={m.vocab_size}.")
    if m.clip_qkv is not None and m.clip_qkv <= 0:
        out.append(f"model.clip_qkv={m.clip_qkv} must be positive (or null to disable).")
    if m.block_group_size != 1:
        out.append(
            f"model.block_group_size={m.block_group_size} is not supported: in OLMo, block groups only change "
            f"how FSDP wraps the blocks (parameters named transformer.block_groups.G.i...), not what the model "
            f"computes. Set --model.block_group_size=1 (the same model; use fsdp.wrapping_strategy one_in_N for "
            f"coarser FSDP units); checkpoints saved with block groups do not load yet."
        )
    if m.block_type != "sequential":
        out.append(
            f"model.block_type={m.block_type} is not supported: only OLMo's sequential block (fused att_proj, "
            f"as in every released OLMo model) is implemented; OLMo's llama block (separate q_proj/k_proj/v_proj) "
            f"is not. Set --model.block_type=sequential for a new model; a checkpoint of a llama-block model "
            f"cannot be loaded yet."
        )
    for name in ("attention_dropout", "residual_dropout", "embedding_dropout"):
        p = getattr(m, name)
        if not 0.0 <= p < 1.0:
            out.append(f"model.{name}={p} must be in [0, 1).")
    for name in ("d_model", "n_heads", "n_layers", "max_sequence_length", "vocab_size"):
        if getattr(m, name) <= 0:
            out.append(f"model.{name} must be positive.")
    for name in ("eos_token_id", "pad_token_id"):
        token = getattr(m, name)
        if not 0 <= token < m.effective_embedding_size:
            out.append(f"model.{name}={token} is outside the embedding (size {m.effective_embedding_size}).")
    out += attention_option_problems(m.sliding_window, m.rope_scaling, m.rope)
    return out + _model_size_problems(cfg)


MAX_LAYERS = 4096
MAX_SEQUENCE_LENGTH = 2**24
MAX_PARAMS = 10**13


def _model_size_problems(cfg: TrainConfig) -> list[str]:
    """Sizes no model has (a typo, an extra zero): refused before the model is built on the meta device, which for
    a hundred million layers would take hours."""
    m, out = cfg.model, list[str]()
    if m.n_layers > MAX_LAYERS:
        out.append(
            f"model.n_layers={m.n_layers:,} is more than {MAX_LAYERS:,}; the deepest released models have ~130."
        )
    if m.max_sequence_length > MAX_SEQUENCE_LENGTH:
        out.append(
            f"model.max_sequence_length={m.max_sequence_length:,} is more than {MAX_SEQUENCE_LENGTH:,} tokens."
        )
    approx = 12 * m.n_layers * m.d_model**2 + 2 * max(m.effective_embedding_size, 0) * m.d_model
    if not out and approx > MAX_PARAMS:
        out.append(
            f"model.d_model={m.d_model:,} with model.n_layers={m.n_layers:,} makes about {approx:.2g} parameters, "
            f"more than {MAX_PARAMS:.0e} (a typo?); OLMo-2 32B has d_model 5120 and 64 layers."
        )
    return out


def _batch_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    out: list[str] = []
    micro = cfg.device_train_microbatch_size
    if cfg.global_train_batch_size <= 0 or micro <= 0:
        return ["global_train_batch_size and device_train_microbatch_size must be positive."]
    if cfg.global_train_batch_size % (micro * world_size) != 0:
        out.append(
            f"global_train_batch_size={cfg.global_train_batch_size} must be divisible by "
            f"device_train_microbatch_size ({micro}) x world size ({world_size}) = {micro * world_size}; "
            f"change one of them (e.g. --global_train_batch_size={max(1, cfg.global_train_batch_size // (micro * world_size)) * micro * world_size})."
        )
    derived = cfg.device_batch_size(world_size)
    if cfg.device_train_batch_size is not None and cfg.device_train_batch_size != derived:
        # OLMo wrote this derived value into every saved config.yaml, for the world size of that run.
        log.warning(
            "device_train_batch_size=%d is ignored: it is derived as global_train_batch_size / world size = %d.",
            cfg.device_train_batch_size,
            derived,
        )
    if cfg.float32_matmul_precision not in ("highest", "high", "medium"):
        out.append(f"float32_matmul_precision={cfg.float32_matmul_precision!r} must be highest, high or medium.")
    if cfg.precision is not None and cfg.precision not in PRECISIONS:
        out.append(f"precision={cfg.precision!r} must be one of {', '.join(PRECISIONS)}.")
    try:
        if cfg.max_duration is not None:
            parse_duration_steps(cfg.max_duration, cfg.global_train_batch_size, cfg.tokens_per_batch, 0)
    except OLMoConfigurationError as e:
        out.append(str(e))
    for name in ("stop_at", "stop_after", "time_limit", "metrics_collect_interval"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            out.append(f"{name}={value} must be positive (or null).")
    if not 0 < cfg.distributed_timeout_minutes <= MAX_TIMEOUT_SECONDS / 60:
        out.append(
            f"distributed_timeout_minutes={cfg.distributed_timeout_minutes} must be above 0 and at most "
            f"{MAX_TIMEOUT_SECONDS / 60:g} (a day: a collective still waiting after a day is hung); 30 is the default."
        )
    if not 0 <= cfg.seed < 2**32:
        out.append(f"seed={cfg.seed} must be in [0, 2^32).")
    return out


_OLMO_SHARDED_CHECKPOINTERS = ("torch_new", "torch_legacy", "local", "olmo_core")


MAX_RUN_NAME_BYTES = 128
"""A run name becomes a folder name (with suffixes such as ``-unsharded``); file systems hold 255 bytes a name."""


def _run_name_problems(cfg: TrainConfig) -> list[str]:
    """``run_name`` is a name, never a path: it becomes folder names (``runs/${run_name}``) and the wandb name."""
    name = cfg.run_name
    if name is None:
        for key in ("save_folder", "remote_save_folder"):
            folder = getattr(cfg, key)
            if folder is not None and "None" in str(folder).replace("\\", "/").split("/"):
                return [
                    f"{key}={folder!r} names a folder 'None': it interpolates a key that is null, most likely "
                    f"run_name. Set --run_name=NAME (or give {key} in full)."
                ]
        return []
    if not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0"):
        return [
            f"run_name={name!r} is not a name: it must not be empty, '.' or '..', nor hold '/', '\\' or NUL, because "
            f"it becomes a folder name (save_folder: runs/${{run_name}} would land outside runs/). Use letters, digits, "
            f"'-', '_' or '.', e.g. --run_name=OLMo-1B-seed2; set save_folder to choose the folder."
        ]
    size = len(name.encode("utf-8"))
    if size > MAX_RUN_NAME_BYTES:
        return [
            f"run_name is {size} bytes long in UTF-8 ({name[:24]!r}...); it becomes a folder name and file systems "
            f"allow 255 bytes a name, with suffixes added. Use at most {MAX_RUN_NAME_BYTES} bytes."
        ]
    return []


def _location_problems(cfg: TrainConfig) -> list[str]:
    """Paths that are URLs with a slash missing (they would name a local folder such as ``s3:``)."""
    values = {
        "save_folder": cfg.save_folder,
        "load_path": cfg.load_path,
        "kl_reference.load_path": cfg.kl_reference.load_path,
    }
    return [p for key, value in values.items() if (p := missing_slash_problem(value, key)) is not None]


def _checkpoint_problems(cfg: TrainConfig) -> list[str]:
    out: list[str] = []
    for name in ("save_interval", "save_interval_unsharded", "save_interval_ephemeral", "eval_interval"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            out.append(f"{name}={value} must be a positive number of steps (or null to disable).")
    if cfg.console_log_interval < 1:
        out.append(f"console_log_interval={cfg.console_log_interval} must be a positive number of steps.")
    for name in ("save_num_checkpoints_to_keep", "save_num_unsharded_checkpoints_to_keep"):
        if getattr(cfg, name) < -1:
            out.append(f"{name}={getattr(cfg, name)} must be -1 (keep all), 0 (no such checkpoints) or a count.")
    for name in ("sharded_checkpointer", "load_path_sharded_checkpointer"):
        value = getattr(cfg, name)
        if value is not None and value not in _OLMO_SHARDED_CHECKPOINTERS:
            out.append(
                f"{name}={value!r} is not one of OLMo's sharded checkpointers "
                f"({', '.join(_OLMO_SHARDED_CHECKPOINTERS)}); every one maps onto ours, so use torch_new or leave it out."
            )
    if cfg.hf_export.dtype not in ("bfloat16", "float32"):
        out.append(f"hf_export.dtype={cfg.hf_export.dtype!r} must be bfloat16 or float32.")
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*[KMGT]?i?B?\s*", cfg.hf_export.max_shard_size, re.IGNORECASE):
        out.append(
            f"hf_export.max_shard_size={cfg.hf_export.max_shard_size!r} must be a size such as 5GB or 500MB."
        )
    return out


def _strategy_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    if cfg.distributed_strategy == "single" and world_size > 1:
        return [
            f"distributed_strategy=single trains on one device, but {world_size} processes were launched. Use "
            f"--distributed_strategy=fsdp (or ddp) under torchrun, or launch one process."
        ]
    return []


def _warn_no_effect(cfg: TrainConfig) -> None:
    if env_rank() == 0:  # about the config, not this rank: once per launch
        for line in warmup_warnings(cfg) + attention_mask_warnings(cfg.model, cfg.data.generate_doc_lengths):
            log.warning(line)
    if cfg.load_path is None and not cfg.try_load_latest_save:
        for flag in ("reset_optimizer_state", "reset_trainer_state"):
            if getattr(cfg, flag):
                log.warning("--%s has no effect without --load_path.", flag)
    unused = {
        "early_stopping_factor": cfg.early_stopping_factor is not None,
        "module_outputs_save_steps": bool(cfg.module_outputs_save_steps),
        "optimizer.record_update_metrics": cfg.optimizer.record_update_metrics,
        "python_profiling": cfg.python_profiling,
        "torch_profiling": cfg.torch_profiling,
    }
    if cfg.optimizer.metrics_log_interval is not None:
        log.warning(
            "optimizer.metrics_log_interval=%s: per-parameter norm metrics are not collected here; the global "
            "gradient norm is logged at every step.",
            cfg.optimizer.metrics_log_interval,
        )
    if cfg.single.device != "auto":
        log.warning(
            "single.device=%r has no effect: the device is chosen automatically (CUDA when available).",
            cfg.single.device,
        )
    for key, is_set in unused.items():
        if is_set:
            log.warning("%s is accepted for OLMo compatibility but not implemented yet; it has no effect.", key)
    _warn_ignored_options(cfg)


def _warn_ignored_options(cfg: TrainConfig) -> None:
    """One line for each option OLMo honours and we do not, when it is set to anything but its default."""
    ignored: list[tuple[str, object, str]] = []
    if cfg.fsdp is not None:
        wrap = cfg.fsdp.wrapping_strategy
        if wrap == FSDPWrapStrategy.size_based:
            ignored.append(("fsdp.wrapping_strategy", wrap, "each block is its own FSDP unit, as with by_block"))
        elif wrap == FSDPWrapStrategy.by_block_group:
            ignored.append(
                (
                    "fsdp.wrapping_strategy",
                    wrap,
                    "it acts as by_block (model.block_group_size is 1: a group is a block)",
                )
            )
        if not cfg.fsdp.use_orig_params:
            ignored.append(("fsdp.use_orig_params", False, "FSDP2 always keeps the original parameters"))
    if cfg.ddp is not None and cfg.ddp.find_unused_params:
        ignored.append(("ddp.find_unused_params", True, "DDP runs as FSDP2 replication, which does not need it"))
    if cfg.wandb is not None:
        if not cfg.wandb.rank_zero_only:
            ignored.append(
                ("wandb.rank_zero_only", False, "only rank 0 logs to wandb, after reducing across ranks")
            )
        if cfg.wandb.log_artifacts:
            ignored.append(
                ("wandb.log_artifacts", True, "no artifacts are uploaded to wandb (OLMo uploads none either)")
            )
    if cfg.tokenizer.truncate_direction != TruncationDirection.right:
        ignored.append(
            (
                "tokenizer.truncate_direction",
                cfg.tokenizer.truncate_direction,
                "training data is pre-tokenized and downstream tasks truncate queries on the left, as in OLMo",
            )
        )
    if cfg.extra_steps_after_cancel not in (0, 10):  # 10 is the default, in every OLMo config
        ignored.append(
            ("extra_steps_after_cancel", cfg.extra_steps_after_cancel, "a canceled run saves and stops at once")
        )
    for key, value, instead in ignored:
        log.warning("%s=%s has no effect: %s.", key, value, instead)


def evaluator_problems(cfg: TrainConfig) -> list[str]:
    """Every problem with ``cfg.evaluators``, one line each (empty when there is none): lm evaluators
    without data, batch sizes below 1, unknown downstream labels. Builds nothing."""
    problems: list[str] = []
    downstream: dict[str, str] = {}
    for i, ecfg in enumerate(cfg.evaluators):
        key = f"evaluators[{i}]"
        if evaluator_batch_size(cfg, ecfg) < 1:
            problems.append(f"{key}.device_eval_batch_size (or device_eval_batch_size) must be at least 1.")
        if ecfg.definitions not in DOWNSTREAM_DEFINITIONS:
            problems.append(
                f"{key}.definitions={ecfg.definitions!r} is not a set of metric definitions; use "
                f"{' or '.join(DOWNSTREAM_DEFINITIONS)}."
            )
        if ecfg.type == EvaluatorType.generate:
            problems += generation_problems(ecfg, key, cfg.model.vocab_size)
        elif ecfg.type == EvaluatorType.downstream:
            downstream[f"{key}.label"] = ecfg.label
        elif ecfg.data.mixture is not None:
            problems.append(
                f"{key}.data.mixture: an evaluator reads its files whole, not a mixture; list them in {key}.data.paths "
                f"or, per label, in {key}.data.datasets."
            )
        elif not (ecfg.data.paths or ecfg.data.datasets):
            problems.append(
                f"{key} (label {ecfg.label!r}) is an lm evaluator without data: set {key}.data.paths to token "
                f"files or {key}.data.datasets to label -> files, or set {key}.type=downstream."
            )
        else:
            problems += data_location_problems(ecfg.data, f"{key}.data")
    if downstream:
        problems += unknown_label_problems(downstream)
    return problems


MAX_GENERATED_TOKENS = 4096
DOWNSTREAM_DEFINITIONS = ("olmo_eval", "olmo-0.6")
"""``EvaluatorConfig.definitions``: ai2-olmo-eval's metric definitions, or the original OLMo 0.6 trainer's."""


def generation_problems(ecfg: EvaluatorConfig, key: str, vocab_size: int) -> list[str]:
    """What is wrong with a ``generate`` evaluator's settings (``key``: ``evaluators[i]``), for a model of
    ``vocab_size`` tokens."""
    out: list[str] = []
    if not ecfg.prompts or not all(isinstance(p, str) and p for p in ecfg.prompts):
        out.append(
            f"{key} (label {ecfg.label!r}) is a generate evaluator without prompts: set {key}.prompts to a list of "
            f'texts, e.g. ["The capital of France is"].'
        )
    if not 1 <= ecfg.max_new_tokens <= MAX_GENERATED_TOKENS:
        out.append(f"{key}.max_new_tokens={ecfg.max_new_tokens} must be between 1 and {MAX_GENERATED_TOKENS}.")
    if not 0 <= ecfg.temperature < math.inf:
        out.append(f"{key}.temperature={ecfg.temperature} must be a finite number >= 0 (0: greedy decoding).")
    if ecfg.top_k is not None and ecfg.top_p is not None:
        out.append(f"{key}: give top_k or top_p, not both.")
    if ecfg.top_k is not None and not 1 <= ecfg.top_k <= vocab_size:
        out.append(
            f"{key}.top_k={ecfg.top_k} must be from 1 to model.vocab_size={vocab_size} (the tokens sampled from)."
        )
    if ecfg.top_p is not None and not 0 < ecfg.top_p <= 1:
        out.append(f"{key}.top_p={ecfg.top_p} must be in (0, 1].")
    if ecfg.temperature == 0 and (ecfg.top_k is not None or ecfg.top_p is not None):
        out.append(f"{key}: top_k and top_p sample; set {key}.temperature above 0 (e.g. 0.8) with them.")
    return out


def evaluator_batch_size(cfg: TrainConfig, ecfg: EvaluatorConfig) -> int:
    """Instances per forward pass of one evaluator: its own ``device_eval_batch_size``, else the run's."""
    return cfg.device_eval_batch_size if ecfg.device_eval_batch_size is None else ecfg.device_eval_batch_size


def task_labels() -> list[str]:
    """Every downstream label ``olmo_eval`` knows (``olmo_eval.tasks.LABEL_TO_TASK_MAP``), sorted."""
    from olmo_eval.tasks import LABEL_TO_TASK_MAP

    return sorted(LABEL_TO_TASK_MAP)


def unknown_label_problems(labels: Mapping[str, str]) -> list[str]:
    """Problems with downstream labels (``{config key: label}``): a line for each label that ``olmo_eval``
    does not know, with close matches, then one listing every known label, closest first. Empty when
    every label is known. Cheap (no task is built), so config validation can call it first.
    """
    known = task_labels()
    unknown = {key: label for key, label in labels.items() if label not in known}
    if not unknown:
        return []
    problems = []
    for key, label in unknown.items():
        close = difflib.get_close_matches(label, known, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        problems.append(f"{key}={label!r} is not a downstream task in ai2-olmo-eval.{hint}")
    close_first = {
        c: None for label in unknown.values() for c in difflib.get_close_matches(label, known, n=10, cutoff=0.4)
    }
    available = [*close_first, *(label for label in known if label not in close_first)]
    problems.append(
        f"Available downstream labels ({len(known)}, closest first): {', '.join(available)}. "
        "Fix the label, or make the evaluator type: lm with data."
    )
    return problems


def tokenizer_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with ``cfg.tokenizer`` for this run, found during config validation.

    When something uses the tokenizer (downstream evaluators) it must load and match
    ``model.vocab_size``. When nothing does, it is only resolved (never fetched from the hub), and a
    name this machine cannot resolve is a warning: pre-tokenized data trains without it.
    """
    identifier = cfg.tokenizer.identifier
    if not any(e.type == EvaluatorType.downstream for e in cfg.evaluators):
        try:
            resolve_tokenizer_path(identifier)
        except OLMoConfigurationError as e:
            log.warning("%s (Nothing in this run uses the tokenizer, so training goes on.)", e)
        return []
    try:
        vocab = load_base_tokenizer(identifier).get_vocab_size()
    except OLMoConfigurationError as e:
        return [str(e)]
    if vocab != cfg.model.vocab_size:
        return [
            f"tokenizer.identifier={identifier!r} has {vocab} tokens but model.vocab_size={cfg.model.vocab_size}; "
            f"the downstream evaluators need them to match: set the tokenizer the model was trained with."
        ]
    return []
