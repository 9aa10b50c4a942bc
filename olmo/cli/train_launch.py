"""The launch of ``scripts/train.py`` once its config is loaded and valid (:func:`launch`): everything else that can
be checked (the device, the checkpoint to restore and its files, the save folder, the data, the evaluators) is
checked before anything is written or the process group, model or data order is set up; then the run is built and
trained. :mod:`olmo.cli.train` imports this module only after the config checks, so that ``--help``, usage and config
errors never wait for torch's import."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

from olmo.checkpoint.restore import (
    LaunchOptions,
    LaunchPlan,
    RestorePlan,
    claim_save_folder,
    plan_restore,
    prepare_save_folder,
    replaces_previous_run,
    resumes_in_save_folder,
)
from olmo.config import DataConfig, TrainConfig
from olmo.config.linear_attention_sections import LINEAR_ATTENTION
from olmo.data import DataContext, IterableDataset, MemMapDataset, build_dataset
from olmo.data.mixture import MixturePlan
from olmo.distributed import (
    DistEnv,
    ParallelizeOptions,
    ParallelLayout,
    barrier,
    init_distributed,
    teardown_distributed,
)
from olmo.distributed.collectives import launch_device
from olmo.distributed.float8 import float8_device_problem
from olmo.distributed.launch_memory import check_launch_memory
from olmo.distributed.pipeline import build_training_model
from olmo.distributed.run_shape import RunShape
from olmo.eval import Evaluator, evaluators_of_run
from olmo.exceptions import OLMoConfigurationError, OLMoDataError
from olmo.hf.files import check_hf_export
from olmo.ladder.run_planner import format_plan, plan_run
from olmo.model import describe_attention, describe_linear_attention
from olmo.optim import build_optimizer, build_scheduler
from olmo.train import Trainer
from olmo.train.build_module import build_train_module, train_module_class
from olmo.train.callback import Callback
from olmo.train.dpo import check_pairs_differ, continued_config, resolve_dpo_reference, resolve_reference
from olmo.train.resume_point import check_resume_point
from olmo.train.stability import read_skip_ranges
from olmo.train.stages import (
    StagePlan,
    build_stage_dataloader,
    check_kl_reference,
    check_recorded_data,
    check_schedule_lengths,
    mixture_file,
    plan_stages,
    preflight_kl_reference,
)
from olmo.train.stop import EXIT_CODE_ABORTED, checkpoint_summary
from olmo.util import env_rank, env_world_size, launch_env
from olmo.util.rng import seed_all

__all__ = ["launch", "train"]

log = logging.getLogger("train")


def launch(cfg: TrainConfig, callbacks: Sequence[Callback] = ()) -> int:
    """Check what the valid ``cfg`` reads and writes, then train (or, with ``--dry_run``, print the plan); return the
    exit code. ``callbacks`` were checked by :func:`olmo.cli.train.main`.

    Ctrl-C while the run is set up or finishes (the training loop handles its own signals) ends it with one line
    and :data:`~olmo.train.stop.EXIT_CODE_ABORTED`, not a traceback."""
    try:
        return _launch(cfg, callbacks)
    except KeyboardInterrupt:
        last = checkpoint_summary(cfg.save_folder, 0)["last checkpoint"]
        log.error(
            "Interrupted (Ctrl-C) outside the training loop, while the run was set up or finished: stopped without "
            "saving a checkpoint (exit code %d). Last checkpoint in '%s': %s. Relaunch the same command (with "
            "--try_load_latest_save to continue from it).",
            EXIT_CODE_ABORTED,
            cfg.save_folder,
            last,
        )
        return EXIT_CODE_ABORTED


def _launch(cfg: TrainConfig, callbacks: Sequence[Callback]) -> int:
    if cfg.model.attention_backend == "flex" and launch_device().type == "cpu" and not cfg.dry_run:
        raise OLMoConfigurationError(
            "model.attention_backend=flex cannot train on a CPU: torch's FlexAttention has no CPU backward. Train on a "
            "GPU, or set model.attention_backend=sdpa (or null, which uses SDPA on a CPU); evaluation and generation "
            "on a CPU may use flex."
        )
    float8_problem = float8_device_problem(cfg.model.float8, launch_device()) if cfg.model.trains_float8 else None
    if float8_problem is not None and not cfg.dry_run:
        raise OLMoConfigurationError(float8_problem)
    if float8_problem is not None:  # a dry run on a login node plans a GPU run
        log.warning("%s", float8_problem)
    # A bad name, or a module that cannot train a stage's KL penalty, fails before anything is built.
    train_module_class(
        cfg.train_module, cfg.stages, cfg.dpo.enabled, cfg.rl.enabled, cfg.pipeline_parallel.degree > 1
    )
    if cfg.rl.enabled:
        from olmo.rl.run_checks import check_rl_run

        try:
            check_rl_run(cfg.rl, cfg.model)
        except (OLMoDataError, OLMoConfigurationError):
            if cfg.dry_run and env_rank() == 0:  # the plan needs no prompts: show it, then what is wrong with them
                print(format_plan(plan_run(cfg, env_world_size(), None)))
            raise
    if cfg.hf_export.enabled:
        check_hf_export(cfg.model, cfg.tokenizer.identifier)  # the export at the end must not fail
    if not cfg.dry_run:  # a dry run's plan shows the memory instead
        launched = launch_env()
        check_launch_memory(RunShape.from_train_config(cfg), launched.world_size, launched.local_world_size)
    opened: dict[int, MemMapDataset] = {}  # each data config's dataset, opened once (keyed by the config's id)
    data_context = DataContext.from_train_config(cfg)

    def dataset_of(data: DataConfig) -> MemMapDataset:
        if id(data) not in opened:
            opened[id(data)] = build_dataset(data, cfg.model, data_context, include_instance_metadata=False)
        return opened[id(data)]

    # The stages' lengths (in epochs: of their data) must add up to max_duration.
    try:
        stages = plan_stages(cfg, lambda data: len(dataset_of(data)))  # a length in epochs opens the data
        mixes = mixture_plans(stages, dataset_of)  # a mix its sources cannot meet is refused before any write
        check_schedule_lengths(cfg.scheduler, cfg.tokens_per_batch, stages)
    except (OLMoDataError, OLMoConfigurationError):
        if cfg.dry_run and env_rank() == 0:
            print(format_plan(plan_run(cfg, env_world_size(), None)))
        raise
    preflight_kl_reference(cfg.kl_reference, stages, cfg.model)
    launch = plan_restore(
        LaunchOptions.from_train_config(cfg), cfg.model, cfg.optimizer
    )  # opens every checkpoint file it will read
    resolve_dpo_reference(
        cfg.dpo, cfg.model, launch, cfg.restore_dataloader
    )  # recorded in config.yaml, so a resume keeps the reference
    if cfg.rl.enabled and cfg.rl.beta > 0:  # as DPO's: recorded in config.yaml, kept by a resume
        saved = continued_config(launch, cfg.restore_dataloader)
        recorded = (
            saved.rl.reference_path if saved is not None and saved.rl.enabled and saved.rl.beta > 0 else None
        )
        cfg.rl.reference_path = resolve_reference(
            "rl.reference_path", cfg.rl.reference_path, recorded, cfg.model, launch, "rl.beta > 0"
        )
    check_resume(cfg, stages, launch)
    prepare_save_folder(LaunchOptions.from_train_config(cfg), launch)
    # Every rank checks the files; only rank 0 pays for the full token-id scan. A staged run checks every
    # stage's data.
    scan_tokens = 2**31 if env_rank() == 0 else 0
    try:
        for stage in stages.stages:
            if stage.segment == stage.index:  # the first stage of its data
                dataset_of(stage.data).validate(cfg.model.vocab_size, scan_tokens)
        check_data(cfg, stages, launch, dataset_of)
        evaluators = evaluators_of_run(cfg, env_world_size(), env_rank())
    except (OLMoDataError, OLMoConfigurationError):
        if cfg.dry_run and env_rank() == 0:  # the plan needs no data: show it, then what is wrong with the data
            print(format_plan(plan_run(cfg, env_world_size(), None)))
        raise
    if cfg.dry_run and not cfg.force_save_unsharded:
        if env_rank() == 0:
            print(format_plan(plan_run(cfg, env_world_size(), len(dataset_of(stages.stages[0].data)))))
            for name, mix in mixes.items():
                print(f"\nmixture ({name}):\n  " + "\n  ".join(mix.describe()))
        return 0

    env = init_distributed(cfg.distributed_timeout_minutes)
    try:
        return train(cfg, env, stages, launch, evaluators, dataset_of(stages.stages[0].data), mixes, callbacks)
    finally:
        teardown_distributed()  # after train() returned: what it built is garbage now, and is collected


def mixture_plans(stages: StagePlan, dataset_of: Callable[[DataConfig], MemMapDataset]) -> dict[str, MixturePlan]:
    """The mixture of each data segment that is one (built now: its sources' sizes decide it), by file name:
    ``mixture.json`` for the first segment, ``mixture-{stage name}.json`` for a later stage's own."""
    out: dict[str, MixturePlan] = {}
    for stage in stages.stages:
        if stage.segment == stage.index and stage.data.mixture is not None:
            out[mixture_file(stage)] = dataset_of(stage.data).mixture_plan
    return out


def continued_state(cfg: TrainConfig, launch: LaunchPlan) -> Optional[RestorePlan]:
    """The restore of a launch that continues a checkpoint's trainer state (its step and data position), else None."""
    plan = launch.restore
    return plan if plan is not None and plan.load_trainer_state and cfg.restore_dataloader else None


def check_resume(cfg: TrainConfig, stages: StagePlan, launch: LaunchPlan) -> None:
    """What continuing a run depends on, checked before anything is written: the batches rollbacks took out
    (``skipped_batches.json``, read unless the launch replaces the run), and, when the launch continues a
    checkpoint's trainer state, the steps left, the schedule and the KL stage's reference."""
    if not replaces_previous_run(LaunchOptions.from_train_config(cfg), launch):
        read_skip_ranges(cfg.save_folder)
    plan = continued_state(cfg, launch)
    if plan is not None:
        check_resume_point(
            stages,
            plan.info.path,
            plan.info.step,
            resumes_in_save_folder(cfg.save_folder, launch),
            scheduler=cfg.scheduler,
            tokens_per_batch=cfg.tokens_per_batch,
            max_duration=cfg.max_duration,
            written=cfg.as_written(),
        )
        check_kl_reference(cfg.save_folder, cfg.kl_reference, cfg.model, stages, plan.info.path, plan.info.step)


def check_data(
    cfg: TrainConfig, stages: StagePlan, launch: LaunchPlan, dataset_of: Callable[[DataConfig], MemMapDataset]
) -> None:
    """Once its files are checked, each data segment can be put in order as training will (at least one global
    batch, fewer than 2**32 instances: the order's own checks, without building or writing it), and a resume in
    the run's own folder finds the data the run recorded."""
    for stage in stages.stages:
        if stage.segment == stage.index:
            data = dataset_of(stage.data)
            layout = ParallelLayout.of_run(cfg, world_size=env_world_size(), rank=env_rank())
            world, rank = layout.data_parallel_size, layout.data_parallel_rank
            IterableDataset(data, cfg.global_train_batch_size, world_size=world, rank=rank, pairs=cfg.dpo.enabled)
            if (
                cfg.dpo.enabled and env_rank() == 0
            ):  # bounded as the token-id scan is; the train step checks the rest
                check_pairs_differ(data, max_tokens=2**31)
    plan = continued_state(cfg, launch)
    if plan is not None and resumes_in_save_folder(cfg.save_folder, launch):
        fix = (
            f"start a new run from the checkpoint (--load_path={plan.info.path} --save_folder=NEW_FOLDER), which plans "
            f"and records its data anew"
        )
        check_recorded_data(cfg.save_folder, cfg.seed, stages, dataset_of, fix)


def train(
    cfg: TrainConfig,
    env: DistEnv,
    stages: StagePlan,
    launch: LaunchPlan,
    evaluators: list[Evaluator],
    dataset: MemMapDataset,
    mixes: Optional[dict[str, MixturePlan]] = None,
    callbacks: Sequence[Callback] = (),
) -> int:
    """Build the run on the initialized process group, restore what ``launch`` says and train on ``dataset`` (the first stage's
    data, checked already); ``mixes`` are recorded in ``train_data/`` once the save folder is this run's. Return the
    exit code."""
    seed_all(cfg.seed)
    log.info(
        "World size %d; device batch %d in micro-batches of %d (%d accumulation steps).",
        env.world_size,
        cfg.device_batch_size(env.world_size),
        cfg.device_train_microbatch_size,
        cfg.grad_accum_steps(env.world_size),
    )
    if env.is_main and not cfg.dry_run:
        claim_save_folder(
            LaunchOptions.from_train_config(cfg), launch, cfg
        )  # the launch's first write: cleans up, then writes config.yaml
        for name, mix in (mixes or {}).items():
            mix.write(Path(cfg.save_folder) / "train_data", name)
    barrier()  # nobody writes into save_folder before rank 0 has made it this run's
    layout = ParallelLayout.of_run(cfg, env)  # the one layout of the launch: its meshes, what each rank reads
    train_loader = build_stage_dataloader(
        cfg.model,
        DataContext.from_train_config(cfg),
        stages.stages[0],
        layout.data_parallel_size,
        layout.data_parallel_rank,
        dataset,
    )
    options = ParallelizeOptions.from_train_config(cfg, training=True)
    model, whole = build_training_model(
        cfg.model, layout, options, cfg.pipeline_parallel
    )  # a pipeline: its stages
    active = whole.num_active_params()
    log.info(
        "Model: %s parameters (%s without embeddings%s), %.2f GFLOPs/token.",
        f"{whole.num_params():,}",
        f"{whole.num_params(include_embedding=False):,}",
        f"; {active:,} active per token" if active != whole.num_params() else "",
        whole.num_flops_per_token() / 1e9,
    )
    optimizer = build_optimizer(cfg.optimizer, model, skip_steps=cfg.stability.skip_spikes.enabled)
    train_module = build_train_module(cfg, env, model, optimizer, build_scheduler(cfg.scheduler), cfg.train_module)
    trainer = Trainer(cfg, env, train_module, train_loader, evaluators, stages, callbacks, layout)
    log_speed_setup(cfg, trainer)
    plan = launch.restore
    if plan is not None:
        trainer.restore(plan.info, plan.load_optimizer_state, plan.load_trainer_state)
    if cfg.force_save_unsharded:
        trainer.checkpointer.save(trainer.state.global_step, sharded=False)
    if cfg.dry_run:  # with force_save_unsharded: the checkpoint is converted, and that was all
        log.info("Dry run: stopping before training.")
        return 0
    return trainer.fit()


def log_speed_setup(cfg: TrainConfig, trainer: Trainer) -> None:
    """One line naming what decides the speed, the attention kernel that will actually run included."""
    device = trainer.env.device
    has_bias = cfg.model.alibi or cfg.data.generate_attention_mask
    attention = describe_attention(cfg.model, device, trainer.autocast_dtype, has_bias)
    kernel = f" ({attention['sdpa_kernel']})" if attention["sdpa_kernel"] else ""
    if "windowed_layers" in attention:
        kernel += f"; {attention['windowed_layers']} windowed layer(s) on {attention['window_kernel']}"
    if cfg.model.has_linear_attention:
        linear = cfg.model.layer_kinds().count(LINEAR_ATTENTION)
        kernel += f"; {linear} linear-attention layer(s) on {describe_linear_attention(device)}"
    log.info(
        "Speed setup: autocast %s, attention %s%s, compile %s, fused_loss %s, metrics read back every %d "
        "step(s)%s.",
        trainer.autocast_dtype or "off (fp32)",
        attention["backend"],
        kernel,
        "per block" if cfg.compile is not None else "off",
        bool(cfg.fused_loss),
        trainer.collect_steps,
        f", fp32 matmul precision {cfg.float32_matmul_precision}" if device.type == "cuda" else "",
    )
