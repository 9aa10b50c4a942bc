"""Typed run configuration: ``TrainConfig`` with YAML/CLI loading and validation. The sections (model,
optimizer, data, ...) and enums live in their own modules (:mod:`olmo.config.sections`, ``model_sections``,
``optim_sections``, ``data_sections``, ``eval_sections``, ...), each with its checks, and are re-exported here;
the checks of the run as a whole are in :mod:`olmo.config.validation`.

Field names and defaults follow the original OLMo ``TrainConfig`` so that OLMo configs and habits
carry over. A config is loaded once (:meth:`TrainConfig.load`), validated once
(:meth:`TrainConfig.validate`), and never mutated afterwards; values that depend on the runtime
(world size, device batch size) are computed by functions, not stored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

from omegaconf import OmegaConf as om
from omegaconf.errors import OmegaConfBaseException

from ..exceptions import OLMoError
from ..util import env_world_size
from ..util.secrets import redact_urls
from .base import BaseConfig
from .cli import ENV_WRITTEN, clean_opt, config_error, refuse_interpolations
from .data_sections import (
    CustomDatasetCollatorConfig,
    CustomDatasetConfig,
    DataConfig,
    InstanceFilterConfig,
    MixtureConfig,
    MixtureSourceConfig,
    RemoteDataConfig,
)
from .dpo_sections import DPOConfig
from .eval_sections import EvaluatorConfig
from .loading import load_reporting_all
from .model_sections import ModelConfig
from .moe_sections import ExpertParallelConfig
from .optim_sections import OptimizerConfig, SchedulerConfig
from .parallel_sections import ContextParallelConfig, TensorParallelConfig
from .pipeline_sections import PipelineParallelConfig
from .resolvers import register_resolvers
from .rl_sections import RLConfig
from .sections import (
    ActivationCheckpointingStrategy,
    ActivationType,
    BlockType,
    CheckpointType,
    CompilerConfig,
    DDPConfig,
    DDPGradSyncMode,
    DecayShape,
    DistributedStrategy,
    EvaluatorType,
    FSDPConfig,
    FSDPPrecision,
    FSDPWrapStrategy,
    InitFnType,
    LayerNormType,
    OptimizerType,
    PaddingDirection,
    SchedulerType,
    SchedulerUnits,
    ShardingStrategy,
    SingleGPUConfig,
    SpeedMonitorConfig,
    StrEnum,
    TokenizerConfig,
    TruncationDirection,
    WandbConfig,
)
from .stability_sections import StabilityConfig
from .stage_sections import DEFAULT_MAX_DURATION, KLEstimator, KLReferenceConfig, StageConfig, parse_duration_steps
from .validation import config_problems, validate_train_config

__all__ = [
    "StrEnum",
    "ActivationType",
    "BlockType",
    "CheckpointType",
    "LayerNormType",
    "InitFnType",
    "ActivationCheckpointingStrategy",
    "OptimizerType",
    "SchedulerType",
    "SchedulerUnits",
    "DecayShape",
    "PaddingDirection",
    "TruncationDirection",
    "EvaluatorType",
    "DistributedStrategy",
    "ShardingStrategy",
    "FSDPWrapStrategy",
    "FSDPPrecision",
    "DDPGradSyncMode",
    "ModelConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "InstanceFilterConfig",
    "MixtureConfig",
    "MixtureSourceConfig",
    "RemoteDataConfig",
    "CustomDatasetCollatorConfig",
    "CustomDatasetConfig",
    "DataConfig",
    "EvaluatorConfig",
    "TokenizerConfig",
    "WandbConfig",
    "SpeedMonitorConfig",
    "CompilerConfig",
    "FSDPConfig",
    "DDPConfig",
    "SingleGPUConfig",
    "TrainConfig",
    "HFExportConfig",
    "StageConfig",
    "KLReferenceConfig",
    "KLEstimator",
    "DEFAULT_MAX_DURATION",
    "clean_opt",
]


C = TypeVar("C", bound="TrainConfig")


@dataclass
class HFExportConfig:
    """Exporting checkpoints as Hugging Face transformers model directories (``stepN-hf/`` in ``save_folder``),
    as ``scripts/convert_to_hf.py`` writes them; needs the ``hf`` extra."""

    enabled: bool = False
    """Export the final checkpoint of the run (the architecture and tokenizer are checked at start-up)."""
    dtype: str = "bfloat16"
    """``bfloat16`` or ``float32``: the dtype of the exported weights."""
    every_unsharded: bool = False
    """Also export at every step that writes an unsharded checkpoint (``save_interval_unsharded``)."""
    max_shard_size: str = "5GB"
    """Largest ``model*.safetensors`` file; above it the weights are sharded with an index."""

    def problems(self) -> list[str]:
        """One sentence per value of ``hf_export`` that cannot work."""
        out: list[str] = []
        if self.dtype not in ("bfloat16", "float32"):
            out.append(f"hf_export.dtype={self.dtype!r} must be bfloat16 or float32.")
        if not re.fullmatch(r"\s*\d+(\.\d+)?\s*[KMGT]?i?B?\s*", self.max_shard_size, re.IGNORECASE):
            out.append(f"hf_export.max_shard_size={self.max_shard_size!r} must be a size such as 5GB or 500MB.")
        return out


@dataclass
class TrainConfig(BaseConfig):
    """The whole run. Loaded from YAML plus CLI overrides by :meth:`load`."""

    run_name: Optional[str] = None
    """Name of the run (used in ``save_folder`` and wandb by the shipped configs)."""
    seed: int = 6198
    """Seed for model init, dropout and (unless ``data.seed``) the data order."""
    epoch: Optional[int] = None
    """Start at this epoch instead of the checkpoint's (changes the shuffle seed to seed+epoch)."""
    dry_run: bool = False
    """Check everything a launch would, print the run's plan (:mod:`olmo.ladder.run_planner`) and exit 0 without training or
    building a process group; with ``force_save_unsharded``: restore, save an unsharded checkpoint and exit."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model's architecture."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and its hyperparameters."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training data."""
    restore_dataloader: bool = True
    """If False, a restored run starts at step 0 of the data (weights and optimizer still load)."""
    fast_forward_batches: Optional[int] = None
    """On restore, skip this many global batches of data (e.g. past a loss spike)."""
    evaluators: list[EvaluatorConfig] = field(default_factory=list)
    """In-loop evaluations, run every ``eval_interval`` steps and at the last step."""
    eval_interval: int = 1000
    """Steps between in-loop evaluations."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer the data was made with (used by downstream evaluation and data tools)."""
    save_folder: str = "./"
    """Everything the run writes goes here: config.yaml, train_data/, checkpoints, metrics.jsonl."""
    remote_save_folder: Optional[str] = None
    """Also upload every committed checkpoint to ``{remote_save_folder}/{stepN...}/`` (a folder, ``file://``,
    ``s3://``, ``r2://`` or ``gs://``), in the background, from rank 0, marker last. Remote copies are never
    pruned."""
    canceled_check_interval: int = 50
    """Accepted for OLMo compatibility: stop requests are checked every step."""
    save_interval: Optional[int] = 1000
    """Steps between sharded checkpoints (``stepN/``)."""
    save_interval_unsharded: Optional[int] = None
    """Steps between unsharded checkpoints (``stepN-unsharded/``)."""
    save_interval_ephemeral: Optional[int] = None
    """Steps between extra sharded checkpoints of which only the newest is kept (any regular sharded
    checkpoint removes them); for frequent restart points without filling the disk."""
    save_num_checkpoints_to_keep: int = -1
    """Sharded checkpoints to keep (-1 all, 0 disables sharded saving)."""
    save_num_unsharded_checkpoints_to_keep: int = -1
    """Unsharded checkpoints to keep (-1 all, 0 disables unsharded saving)."""
    save_async: bool = False
    """Write sharded checkpoints in a background thread: training continues once the state is copied to
    CPU memory, and the checkpoint is committed when every rank has finished writing."""
    save_overwrite: bool = False
    """Allow replacing an existing config.yaml, data order or checkpoint in ``save_folder``."""
    force_save_unsharded: bool = False
    """After restoring, save an unsharded checkpoint (with ``dry_run``: convert and exit)."""
    no_pre_train_checkpoint: bool = False
    """Skip the step-0 checkpoint of a fresh run."""
    load_path: Optional[str] = None
    """Checkpoint directory (local or URL) to restore model, optimizer and trainer state from."""
    load_path_sharded_checkpointer: Optional[str] = None
    """OLMo's hint for ``load_path``'s layout; not needed: the layout (ours, or the original's unsharded,
    ``torch_new`` or ``olmo_core``) is read from the directory."""
    try_load_latest_save: bool = False
    """Resume from the newest committed checkpoint in ``save_folder`` if there is one (then the
    reset flags are ignored)."""
    reset_optimizer_state: bool = False
    """Load the model from ``load_path`` but start a fresh optimizer (with a bolt-on warmup)."""
    reset_trainer_state: bool = False
    """Load model and optimizer but start at step 0 of the data with fresh RNG (fine-tuning)."""
    sharded_checkpointer: str = "torch_new"
    """OLMo's sharded layout. Every value maps onto ours: torch.distributed.checkpoint, which is OLMo's
    ``torch_new`` layout (``model_and_optim/`` + ``train/rank{R}.pt``), loadable at any world size."""
    new_style_checkpoints: Optional[bool] = None
    """Deprecated no-op kept so old configs load."""
    max_duration: Optional[Union[int, str]] = None
    """Training length: an int (steps), ``"2e12T"`` (tokens) or ``"3ep"`` (epochs). Null: 10000 steps, as in
    OLMo, or with ``stages`` the sum of the stages (given as well, it must equal that sum)."""
    stages: Optional[list[StageConfig]] = None
    """Train in stages, one after the other, in one run (see :class:`olmo.config.stage_sections.StageConfig`): each with
    its length, optionally its own data and schedule, and a KL penalty to a frozen reference (``kl_beta``).
    Null: one stage of ``max_duration``."""
    kl_reference: KLReferenceConfig = field(default_factory=KLReferenceConfig)
    """The frozen reference of the stages with ``kl_beta > 0``."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Direct Preference Optimization on prepared pairs (``scripts/prepare_preference_data.py``) against a frozen
    reference (:class:`olmo.config.dpo_sections.DPOConfig`); off by default."""
    rl: RLConfig = field(default_factory=RLConfig)
    """Reinforcement learning with verifiable rewards on prepared prompts (``scripts/prepare_rl_prompts.py``)
    (:class:`olmo.config.rl_sections.RLConfig`); off by default."""
    global_train_batch_size: int = 512
    """Instances per optimizer step across all ranks."""
    device_train_batch_size: Optional[int] = None
    """Derived (global batch / world size); ignored with a warning. Kept so OLMo config.yaml files load."""
    device_train_microbatch_size: int = 16
    """Instances per forward/backward pass; gradient accumulation covers the rest."""
    device_eval_batch_size: int = 16
    """Instances per evaluation batch on each rank."""
    eval_subset_num_batches: int = -1
    """Batches per rank each evaluator scores; -1 scores the whole set."""
    eval_on_load: bool = False
    """Evaluate right after restoring a checkpoint, before training on."""
    device_train_grad_accum: Optional[int] = None
    """Derived; leave unset. Kept so OLMo config.yaml files load."""
    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this value."""
    max_grad_norm_ratio: Optional[float] = None
    """Adaptive per-parameter clipping against a running average of each norm (takes priority)."""
    precision: Optional[str] = None
    """``amp_bf16``, ``amp_fp16`` or ``fp32``. On CPU every setting runs in fp32."""
    float32_matmul_precision: str = "high"
    """``torch.set_float32_matmul_precision`` on CUDA: ``high`` lets fp32 matmuls (the fp32 parts of a
    mixed-precision step, or all of an fp32 run) use TF32 tensor cores; ``highest`` keeps IEEE fp32.
    Not applied on CPU."""
    wandb: Optional[WandbConfig] = None
    """Weights & Biases logging (offline unless configured); null disables it."""
    speed_monitor: SpeedMonitorConfig = field(default_factory=SpeedMonitorConfig)
    """Throughput and MFU measurement."""
    hf_export: HFExportConfig = field(default_factory=HFExportConfig)
    """Export checkpoints for Hugging Face transformers (``stepN-hf/``)."""
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    """Spike skipping, rollback, the hang watchdog and straggler detection (all off by default;
    docs/stability.md)."""
    console_log_interval: int = 1
    """Steps between console metric lines."""
    metrics_collect_interval: Optional[int] = None
    """Steps between reading the loss and gradient norm back from the device. 1 reads them every step,
    before the optimizer step, so a non-finite loss or gradient stops the run before it touches the
    weights. N > 1 leaves the GPU's queue full (no host sync in the hot loop); a non-finite value then
    stops the run at the next collection, up to N - 1 optimizer steps later, still before any checkpoint
    or evaluation (both collect first). Every step still gets its own line in ``metrics.jsonl``, except
    that a run that crashes (out of memory, a lost rank) leaves out the up to N - 1 steps not yet collected.
    None: 1 on CPU, 10 on GPU (see :meth:`metrics_collect_steps`)."""
    gen1_gc_interval: Optional[int] = 1
    """Disable automatic GC and collect generation 1 every N steps; None leaves GC alone."""
    compile: Optional[CompilerConfig] = None
    """torch.compile each block with these options; null disables."""
    distributed_strategy: Optional[DistributedStrategy] = DistributedStrategy.fsdp
    """``fsdp``, ``ddp`` or ``single``; with one process every strategy trains unwrapped."""
    single: SingleGPUConfig = field(default_factory=SingleGPUConfig)
    """Settings for ``distributed_strategy: single`` (OLMo's one-device mode)."""
    fsdp: Optional[FSDPConfig] = field(default_factory=FSDPConfig)
    """FSDP2 sharding options (with more than one process)."""
    expert_parallel: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)
    """Expert parallelism for ``model.moe``: ``{degree: N}`` splits each layer's experts over N ranks."""
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    """Context parallelism: ``{degree: N}`` splits each instance's tokens over N ranks (long sequences)."""
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    """Tensor parallelism: ``{degree: N}`` splits each layer's matrices over N ranks (only 1 so far)."""
    pipeline_parallel: PipelineParallelConfig = field(default_factory=PipelineParallelConfig)
    """Pipeline parallelism: ``{degree: N, schedule, microbatches, stages_per_rank}`` splits the layers into stages
    over N groups of ranks (:mod:`olmo.distributed.pipeline`, planned by ``scripts/plan.py``)."""
    distributed_timeout_minutes: float = 30.0
    """How long a collective may wait for a peer before the job fails instead of hanging (a rank that
    dies is normally detected by torchrun within seconds; this bounds hangs it cannot see). Above 0 and at most
    1440 (a day): a collective still waiting after a day is hung."""
    ddp: Optional[DDPConfig] = None
    """Options for ``distributed_strategy: ddp``."""
    softmax_auxiliary_loss: bool = False
    """Add the PaLM z-loss (``auxiliary_loss_multiplier * logsumexp(logits)^2``)."""
    auxiliary_loss_multiplier: Optional[float] = 1e-4
    """Weight of the z-loss."""
    time_limit: Optional[float] = None
    """Seconds after which the run saves a checkpoint and exits (resumable exit code): a positive, finite number
    (without an upper bound: it is compared with the time elapsed, never waited for), or null for no limit."""
    extra_steps_after_cancel: int = 10
    """Accepted for OLMo compatibility; a canceled run saves and stops at once (values other than 0 and the
    default warn at startup)."""
    early_stopping_factor: Optional[float] = None
    """Accepted for OLMo compatibility; not implemented yet."""
    save_data_indices: bool = True
    """Record each rank's instance indices per step in ``save_folder/data-indices/`` (OLMo's
    ``step<TAB>index...`` lines; one file per launch, read them with ``olmo.data.read_data_indices``)."""
    python_profiling: bool = False
    """Accepted for OLMo compatibility; not implemented yet (warns)."""
    torch_profiling: bool = False
    """Accepted for OLMo compatibility; not implemented yet (warns)."""
    stop_at: Optional[int] = None
    """Stop after this global step (default: the step max_duration reaches)."""
    stop_after: Optional[int] = None
    """Stop after this many steps of this launch."""
    activation_checkpointing: Optional[ActivationCheckpointingStrategy] = None
    """Recompute activations in the backward pass to save memory: whole_layer, one_in_two ... three_in_four, fine_grained."""
    fused_loss: Optional[bool] = None
    """Compute the loss chunk by chunk from the final hidden states without materializing the (tokens,
    vocab) logits (:func:`olmo.model.loss.fused_output_loss`; pure PyTorch, unlike OLMo's flash-attn kernel).
    Same loss and gradients up to rounding, less memory around the 50k-wide output layer. None = off: on an
    H200 it saved 6-14 GB but cost 4-12 % of the speed (RESEARCH_LOG 2026-11-26), so it is a memory option."""
    train_module: Optional[str] = None
    """The TrainModule that runs each step: a dotted path (``my_pkg.modules.MyTrainModule``) or a class name
    from :mod:`olmo.train.train_module`; null is :class:`olmo.train.train_module.TransformerTrainModule`, OLMo's step."""
    hf_datasets_cache_dir: Optional[str] = None
    """Deprecated no-op kept so old configs load."""
    module_outputs_save_steps: Optional[list[int]] = None
    """Accepted for OLMo compatibility; not implemented yet."""

    @classmethod
    def load(cls: type[C], path: Union[str, Path], overrides: Optional[list[str]] = None) -> C:
        """Load a YAML config, apply command-line overrides, then resolve interpolations.

        :param overrides: ``--key.path=value``, ``key.path=value`` or bare boolean ``--flag`` arguments.

        :raises OLMoConfigurationError: naming the key for unknown keys, wrong types and bad values.
        """
        register_resolvers()
        return load_reporting_all(cls, path, overrides, _update_legacy_settings, _launch_problems)

    @classmethod
    def load_saved(cls: type[C], path: Union[str, Path], overrides: Optional[list[str]] = None) -> C:
        """Load the ``config.yaml`` that came with a checkpoint or a run (written resolved by :meth:`save`), then
        apply command-line overrides. Such a file may come from anyone: a ``${...}`` in it is refused, never
        resolved, so it can neither read this machine's environment (``${oc.env:...}``) nor look at its files.

        :raises OLMoConfigurationError: naming the key that holds an interpolation, and as :meth:`load` does.
        """
        register_resolvers()
        prepare = lambda raw: _update_legacy_settings(refuse_interpolations(raw, path))  # noqa: E731
        return load_reporting_all(cls, path, overrides, prepare, _launch_problems)

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        """Build a config from a (nested) dict, with the same checks as :meth:`load`."""
        register_resolvers()
        try:
            return om.to_object(om.merge(om.structured(cls), om.create(values)))  # type: ignore
        except OmegaConfBaseException as e:
            raise config_error(e, "in the given dict") from None

    def save(self, path: Union[str, Path]) -> None:
        """Write the config as YAML: resolved, except that no secret is written (see :meth:`as_written`)."""
        om.save(config=om.create(self.as_written()), f=str(path))

    def as_written(self) -> dict[str, Any]:
        """The config as it may be written to a file or sent to wandb: the resolved values, except that a value read
        from the environment keeps its ``${oc.env:NAME}`` as written (escaped: loading the file gives that text,
        never this machine's environment) and every URL has its credentials and query values masked
        (:func:`olmo.util.secrets.redact_url`). Secrets belong in the environment, never in a saved config."""
        resolved = om.to_container(om.structured(self), resolve=False, enum_to_str=True)
        return _written(resolved, (), getattr(self, ENV_WRITTEN, {}))  # type: ignore[return-value]

    def validate(self, world_size: int = 1) -> None:
        """Check values that types alone cannot, and report every problem at once."""
        validate_train_config(self, world_size)

    @property
    def autocast_precision(self) -> Optional[str]:
        """The dtype name autocast should use on an accelerator: bfloat16, float16, or None (fp32)."""
        return {"amp_bf16": "bfloat16", "amp_fp16": "float16"}.get(self.precision or "fp32")

    def metrics_collect_steps(self, device: Any) -> int:
        """``metrics_collect_interval`` resolved for ``device`` (a ``torch.device``)."""
        if self.metrics_collect_interval is not None:
            return self.metrics_collect_interval
        return 1 if device.type == "cpu" else 10

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that read different instances: ``world_size`` over the context-, tensor- and pipeline-parallel degrees
        (the ranks of one such group share their instances), for the batch sizes' checks; which share each rank reads is
        the layout's (:class:`olmo.distributed.layout.ParallelLayout`)."""
        return max(1, world_size // self._shared_instance_ranks())

    def _shared_instance_ranks(self) -> int:
        """Ranks that read the same instances (context x tensor x pipeline parallel degrees; a bad degree, which
        validation reports, counts as 1)."""
        degrees = (self.context_parallel.degree, self.tensor_parallel.degree, self.pipeline_parallel.degree)
        return math.prod(d if isinstance(d, int) and not isinstance(d, bool) and d >= 1 else 1 for d in degrees)

    def device_batch_size(self, world_size: int) -> int:
        """Instances each rank processes per optimizer step (with context parallelism, a share of each one's
        tokens)."""
        return self.global_train_batch_size // self.data_parallel_size(world_size)

    def tensor_parallel_size(self, world_size: int) -> int:
        """``tensor_parallel.degree`` where it divides ``world_size`` (1 otherwise: validation refuses that launch)."""
        tp = self.tensor_parallel.degree
        return tp if isinstance(tp, int) and tp > 1 and world_size % tp == 0 else 1

    def device_tokens(self, world_size: int) -> int:
        """Tokens of each step a rank accounts for: its data-parallel share of the batch, over the ranks that share
        those instances (context or tensor parallel) for throughput."""
        shared = world_size // self.data_parallel_size(world_size)
        return self.device_batch_size(world_size) * self.model.max_sequence_length // max(1, shared)

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank."""
        return math.ceil(self.device_batch_size(world_size) / self.device_train_microbatch_size)

    @property
    def tokens_per_batch(self) -> int:
        return self.global_train_batch_size * self.model.max_sequence_length

    def max_steps(self, instances_per_epoch: int) -> int:
        """Optimizer steps that ``max_duration`` asks for, given the dataset's size in instances. (A run with
        ``stages`` gets its length from :func:`olmo.train.stages.plan_stages` instead.)"""
        duration = DEFAULT_MAX_DURATION if self.max_duration is None else self.max_duration
        return parse_duration_steps(
            duration, self.global_train_batch_size, self.tokens_per_batch, instances_per_epoch
        )


def _launch_problems(cfg: TrainConfig) -> list[str]:
    """What :meth:`TrainConfig.validate` would find for a launch from this environment; reported with the unknown
    keys of a config that has some, so that a misspelled key does not hide the bad values."""
    try:
        world_size = env_world_size()
    except OLMoError:
        world_size = 1  # the launcher's variables are reported by the launch itself; the values still get checked
    return config_problems(cfg, world_size)


def _written(node: Any, parts: tuple[Any, ...], from_env: dict[tuple[Any, ...], str]) -> Any:
    """``node`` (resolved values) as a saved config writes it: a string read from the environment as the user wrote
    it, any other string escaped (a ``${`` in a resolved value is text, and must stay text when the file is read
    back), URLs masked in both."""
    if isinstance(node, str):
        return redact_urls(from_env[parts]) if parts in from_env else redact_urls(node).replace("${", "\\${")
    if isinstance(node, dict):
        return {k: _written(v, (*parts, k), from_env) for k, v in node.items()}
    if isinstance(node, list):
        return [_written(v, (*parts, i), from_env) for i, v in enumerate(node)]
    return node


def _update_legacy_settings(raw: Any) -> Any:
    """Accept the spellings older OLMo configs used."""
    if "activation_checkpointing" in raw and isinstance(raw.activation_checkpointing, bool):
        raw.activation_checkpointing = "whole_layer" if raw.activation_checkpointing else None
    optimizer = raw.get("optimizer") if hasattr(raw, "get") else None
    if optimizer is not None and optimizer.get("name") == "decoupled_lionw":
        optimizer.name = "lionw"
        if "eps" in optimizer:
            del optimizer["eps"]
    return raw
