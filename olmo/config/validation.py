"""The checks of a :class:`~olmo.config.TrainConfig` as a whole, and the one report of every problem.

Each section checks its own values beside its fields (``cfg.model.problems()``, ``cfg.data.problems(...)``, ...),
given what it needs of the rest of the run as arguments. This module holds what belongs to no one section: the run's
own top-level settings (batch sizes against the world size, lengths, intervals, checkpoints, names and folders),
the rules between sections (the optimizer's step and stability's spike skipping, evaluators and the tokenizer
against the model, stages against ``max_duration``, a mixture's draw against the lengths that train on it), the
order in which all problems are reported, and the warnings about settings that have no effect (or not the one
meant), such as a warmup as long as the run. Besides the values themselves, the tokenizer, downstream task labels
and the remote upload client are checked on this machine through low-level helpers only, so the config layer
imports nothing above it.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Optional

from ..exceptions import OLMoConfigurationError
from ..util import env_rank, missing_slash_problem, remote_save_folder_problems
from .attention_sections import attention_mask_warnings
from .bounds import MAX_TIMEOUT_SECONDS, non_finite_problems
from .data_sections import DataConfig
from .eval_sections import EvaluatorConfig, task_labels, unknown_label_problems
from .layout_checks import batch_layout_problems, layout_world_size, strategy_problems
from .optim_sections import SchedulerConfig
from .sections import EvaluatorType, FSDPWrapStrategy, OptimizerType, SchedulerUnits, TruncationDirection
from .stage_sections import (
    DEFAULT_MAX_DURATION,
    parse_duration_steps,
    segment_lengths,
    stage_data_config,
    stage_name_problems,
    stage_sum_problem,
)

if TYPE_CHECKING:
    from .train_config import TrainConfig

__all__ = [
    "validate_train_config",
    "config_problems",
    "evaluator_problems",
    "evaluator_batch_size",
    "tokenizer_problems",
    "warmup_warnings",
    "task_labels",  # defined beside the evaluators' section; olmo.eval imports it from here
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
    """Every section's problems and the run's, in the order of the report."""
    problems: list[str] = []
    layout_world = layout_world_size(cfg, world_size)
    problems += cfg.model.problems()
    problems += batch_layout_problems(cfg, layout_world)
    if cfg.global_train_batch_size > 0 and cfg.device_train_microbatch_size > 0:  # durations count in batches
        problems += _run_settings_problems(cfg)
    problems += cfg.data.problems(
        cfg.model.vocab_size, cfg.model.max_sequence_length, _segment_durations(cfg, None), _stage_mixtures(cfg)
    )
    problems += _optim_problems(cfg)
    problems += _checkpoint_problems(cfg)
    problems += _run_name_problems(cfg)
    problems += _location_problems(cfg)
    problems += strategy_problems(cfg, layout_world)
    if cfg.evaluators:
        problems += evaluator_problems(cfg)
    problems += tokenizer_problems(cfg)
    problems += remote_save_folder_problems(cfg.remote_save_folder, cfg.save_folder)
    problems += _stage_problems(cfg)
    has_checkpoints = any(
        interval is not None
        for interval in (cfg.save_interval, cfg.save_interval_unsharded, cfg.save_interval_ephemeral)
    )
    problems += cfg.stability.problems(cfg.optimizer.name, has_checkpoints)
    problems += cfg.dpo.problems(cfg, world_size)
    problems += cfg.rl.problems(cfg, world_size)
    return problems


def _run_settings_problems(cfg: TrainConfig) -> list[str]:
    """The run's other top-level settings of how it runs."""
    out: list[str] = []
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


def _checkpoint_problems(cfg: TrainConfig) -> list[str]:
    """The run's intervals, what it keeps, and how it saves and exports checkpoints."""
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
    return out + cfg.hf_export.problems()


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
    values = {"save_folder": cfg.save_folder, "load_path": cfg.load_path}
    out = [p for key, value in values.items() if (p := missing_slash_problem(value, key)) is not None]
    return out + cfg.kl_reference.problems()


def _length_in_steps(cfg: TrainConfig, duration: Any) -> Optional[int]:
    """``duration`` (``max_duration``, a stage's) in steps; None when it is null, in epochs (which need the data) or
    not a duration (reported by the duration's own check)."""
    if duration is None or str(duration).strip().endswith("ep"):
        return None
    try:
        return parse_duration_steps(duration, cfg.global_train_batch_size, cfg.tokens_per_batch, 0)
    except OLMoConfigurationError:
        return None


def _schedule_length(cfg: TrainConfig, duration: Any, s: SchedulerConfig) -> Optional[float]:
    """``duration`` in the units of the schedule ``s`` (see :func:`_length_in_steps`), else None."""
    steps = _length_in_steps(cfg, duration)
    if steps is None:
        return None
    return steps * cfg.tokens_per_batch if s.units == SchedulerUnits.tokens else steps


def _optim_problems(cfg: TrainConfig) -> list[str]:
    """The optimizer's and every schedule's problems, with the settings of the run that go with them."""
    o, s = cfg.optimizer, cfg.scheduler
    out = o.problems()
    if o.name == OptimizerType.muon and cfg.stability.skip_spikes.enabled:
        out.append(
            "stability.skip_spikes needs optimizer.name adamw or lionw; muon has no skip-step version yet. Turn "
            "stability.skip_spikes.enabled off, or use adamw."
        )
    run_length = None if cfg.stages else _schedule_length(cfg, cfg.max_duration, s)
    out += s.problems("scheduler", run_length)
    for i, stage in enumerate(cfg.stages or []):
        if stage.scheduler is not None:
            length = _schedule_length(cfg, stage.max_duration, stage.scheduler)
            out += stage.scheduler.problems(f"stages[{i}].scheduler", length)
    if s.warmup_min_lr is not None and not 0 <= s.warmup_min_lr < o.learning_rate:
        out.append(
            f"scheduler.warmup_min_lr={s.warmup_min_lr} must be in [0, optimizer.learning_rate={o.learning_rate})."
        )
    if cfg.max_grad_norm is not None and cfg.max_grad_norm <= 0:
        out.append(f"max_grad_norm={cfg.max_grad_norm} must be positive (or null to disable clipping).")
    if cfg.max_grad_norm_ratio is not None and cfg.max_grad_norm_ratio <= 0:
        out.append(f"max_grad_norm_ratio={cfg.max_grad_norm_ratio} must be positive (or null).")
    return out


def _segment_durations(cfg: TrainConfig, first: Optional[int]) -> list[str]:
    """The lengths that decide the draw of a mixture with null ``tokens`` (see :func:`segment_lengths`), and for
    the run's ``data`` in a staged run its ``max_duration`` too (the stages must add up to it)."""
    out = [str(x) for x in segment_lengths(cfg, first)]
    if cfg.stages and first is None and cfg.max_duration is not None:
        out.append(str(cfg.max_duration))
    return out


def _stage_mixtures(cfg: TrainConfig) -> list[tuple[str, DataConfig, list[str]]]:
    """``(key, data, durations)`` of each stage whose own data is a mixture, for the data checks."""
    out = []
    for i, stage in enumerate(cfg.stages or []):
        if stage.data is not None:
            try:
                data = stage_data_config(cfg.data, stage.data, f"stages[{i}].data")
            except OLMoConfigurationError:
                continue  # reported by the stage checks
            if data.mixture is not None:
                out.append((f"stages[{i}].data", data, _segment_durations(cfg, i)))
    return out


def evaluator_problems(cfg: TrainConfig) -> list[str]:
    """Every problem with ``cfg.evaluators``, one line each (empty when there is none): lm evaluators
    without data, batch sizes below 1, unknown downstream labels. Builds nothing."""
    problems: list[str] = []
    downstream: dict[str, str] = {}
    for i, ecfg in enumerate(cfg.evaluators):
        key = f"evaluators[{i}]"
        problems += ecfg.problems(key, cfg.device_eval_batch_size, cfg.model.vocab_size)
        if ecfg.type == EvaluatorType.downstream:
            downstream[f"{key}.label"] = ecfg.label
    if downstream:
        problems += unknown_label_problems(downstream)
    return problems


def evaluator_batch_size(cfg: TrainConfig, ecfg: EvaluatorConfig) -> int:
    """Instances per forward pass of one evaluator: its own ``device_eval_batch_size``, else the run's."""
    return ecfg.batch_size(cfg.device_eval_batch_size)


def tokenizer_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with ``cfg.tokenizer`` for this run (see :meth:`TokenizerConfig.problems`): the downstream
    evaluators use it, with the model's vocabulary."""
    used = any(e.type == EvaluatorType.downstream for e in cfg.evaluators)
    return cfg.tokenizer.problems(cfg.model.vocab_size, used)


def _stage_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with ``stages`` and ``kl_reference`` (checks that need no data files)."""
    if not cfg.stages:
        if cfg.stages is not None:
            return ["stages=[] has no stage; give at least one, or remove the key."]
        if cfg.kl_reference.load_path is not None:
            return [
                "kl_reference.load_path is set but the run has no stages: the reference is only used by a stage "
                "with kl_beta > 0. Add stages (see configs/tiny/OLMo-tiny-two-stage.yaml) or remove the key."
            ]
        return []
    out: list[str] = []
    for i, stage in enumerate(cfg.stages):
        out += stage.problems(i, cfg.global_train_batch_size, cfg.tokens_per_batch, cfg.data)
    out += stage_name_problems(cfg.stages)
    steps = [_length_in_steps(cfg, stage.max_duration) for stage in cfg.stages]
    given = _length_in_steps(cfg, cfg.max_duration)
    if given is not None and None not in steps:
        total = sum(n for n in steps if n is not None)
        if given != total:
            out.append(stage_sum_problem(cfg, total, given))
    return out


def _warn_no_effect(cfg: TrainConfig) -> None:
    if env_rank() == 0:  # about the config, not this rank: once per launch
        for line in warmup_warnings(cfg) + attention_mask_warnings(cfg.model, cfg.data.generate_doc_lengths):
            log.warning(line)
    if cfg.dpo.enabled and cfg.fused_loss and env_rank() == 0:
        log.warning(
            "fused_loss=true is not used by dpo: each micro-batch's logits exist at once (rows x sequence x "
            "vocabulary) to give every answer its log-probability; lower device_train_microbatch_size if memory is short."
        )
    float8 = cfg.model.float8
    if float8 is not None and float8.enabled and not float8.emulate and cfg.compile is None and env_rank() == 0:
        log.warning(
            "model.float8.enabled=true without compile: torchao's float8 casts then run as separate kernels and "
            "float8 is usually slower than bf16; set compile (e.g. --compile.mode=default) to fuse them."
        )
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


def warmup_warnings(cfg: TrainConfig) -> list[str]:
    """A line for each schedule whose warmup lasts as long as what it schedules (the run, or a stage with its own
    schedule), which then trains at a fraction of ``optimizer.learning_rate`` throughout: what an official config
    shortened with ``--max_duration`` does with its 2,000-step warmup. Lengths in epochs need the data and are
    not checked."""
    s, lr, out = cfg.scheduler, cfg.optimizer.learning_rate, list[str]()
    if cfg.stages:
        lengths = [_schedule_length(cfg, stage.max_duration, s) for stage in cfg.stages]
        run = None if None in lengths else sum(n for n in lengths if n is not None)
        out += s.warmup_warnings("scheduler", run, lr, "the run", "the stages' max_duration")
    else:
        duration = DEFAULT_MAX_DURATION if cfg.max_duration is None else cfg.max_duration
        run = _schedule_length(cfg, duration, s)
        out += s.warmup_warnings("scheduler", run, lr, "the run", f"max_duration={duration!r}", "--max_duration")
    for i, stage in enumerate(cfg.stages or []):
        if stage.scheduler is not None:
            length = _schedule_length(cfg, stage.max_duration, stage.scheduler)
            span = f"stages[{i}].max_duration={stage.max_duration!r}"
            out += stage.scheduler.warmup_warnings(f"stages[{i}].scheduler", length, lr, f"stages[{i}]", span)
    return out
