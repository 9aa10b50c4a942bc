"""Where each stage of a staged run (``stages:`` in the config) begins and ends, in optimizer steps, and which
data it trains on.

Steps are counted from 1, as the trainer counts them: stage ``i`` trains steps ``start_step + 1`` through
``end_step``. A stage that gives ``data`` starts a new *data segment* with its own order, written to
``save_folder/train_data/stage{i}/``; a stage without ``data`` continues its segment (the previous stage's
data, at the position where it stopped). The first segment, when stage 0 has no ``data`` of its own, is the
run's ``data`` with its order in ``save_folder/train_data/``, exactly as in a run without stages. The
trainer's data position (``global_train_examples_seen_this_epoch`` and ``epoch``) always counts within the
current segment.

A run without ``stages`` is one stage of ``max_duration`` over the run's data, so the same code serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from torch.utils.data import DataLoader

from ..config import (
    DEFAULT_MAX_DURATION,
    DataConfig,
    KLEstimator,
    KLReferenceConfig,
    ModelConfig,
    SchedulerConfig,
    SchedulerUnits,
    TrainConfig,
)
from ..config.optim_sections import schedule_problems
from ..config.stage_sections import parse_duration_steps, stage_data_config, stage_sum_problem
from ..exceptions import OLMoConfigurationError
from .callback import Callback, StageContext

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo
    from ..data import DataContext, MemMapDataset
    from .checkpointer import Checkpointer

__all__ = [
    "Stage",
    "StagePlan",
    "plan_stages",
    "check_schedule_lengths",
    "check_boundary_checkpoint",
    "check_recorded_data",
    "mixture_file",
    "boundary_checkpoint_name",
    "build_stage_dataloader",
    "find_boundary_checkpoint",
    "order_dir_of",
    "StageCallback",
    "preflight_kl_reference",
]


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    start_step: int
    """Steps trained before this stage; its first step is ``start_step + 1``."""
    end_step: int
    """Its last step."""
    data: DataConfig
    segment: int
    """Index of the stage whose data this stage trains on (the first stage of its data segment)."""
    order_dir: str
    """Where the segment's data order is written, relative to ``save_folder``."""
    kl_beta: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.nll_diff
    scheduler: Optional[SchedulerConfig] = None
    data_key: str = "data"
    """Where the data of its segment is in the config: ``data``, or ``stages[i].data``."""

    @property
    def num_steps(self) -> int:
        return self.end_step - self.start_step


@dataclass(frozen=True)
class StagePlan:
    stages: tuple[Stage, ...]
    staged: bool = False
    """Whether the config has ``stages`` (a run without them is one implicit stage)."""

    @property
    def total_steps(self) -> int:
        return self.stages[-1].end_step

    def at(self, step: int) -> Stage:
        """The stage that trains step ``step`` (counted from 1; step 0 and steps past the end count as the first
        and the last stage)."""
        for stage in self.stages:
            if step <= stage.end_step:
                return stage
        return self.stages[-1]

    def after(self, steps_done: int) -> Stage:
        """The stage whose data the trainer's position refers to once ``steps_done`` steps are trained: the stage
        of the last trained step (the first stage before any)."""
        return self.at(max(steps_done, 1))

    def describe(self) -> str:
        """One line for a run's plan: the stages, their lengths, and what a KL stage costs."""
        parts = [f"{s.name} {s.num_steps:,} steps" + (" with KL" if s.kl_beta else "") for s in self.stages]
        kl = any(s.kl_beta for s in self.stages)
        cost = (
            "; a KL stage also holds the frozen reference (one more copy of the weights, sharded like them) and "
        )
        cost += "runs its forward pass every step (in the FLOPs and time here; its weights are not in the memory)"
        return f"{len(self.stages)} stages: " + ", ".join(parts) + (cost if kl else "")

    def segment_start(self, stage: Stage) -> int:
        """Steps trained before the data segment of ``stage`` began."""
        return self.stages[stage.segment].start_step


def boundary_checkpoint_name(stage: Stage) -> str:
    """The directory (in ``save_folder``) of the checkpoint written at the first step of a KL stage."""
    return f"stage{stage.index}-step{stage.start_step}"


class StageCallback(Callback):
    """Stage entry as a loop callback: a staged run logs each stage it enters (or resumes within); at the first
    step of a KL stage whose reference is the run itself (no ``kl_reference.load_path``), the checkpoint the
    reference is rebuilt from (``boundary_checkpoint_name``), written before the data moves on, so that its data
    position is the end of the previous stage's. The data switch and the train module's set-up stay with the loop."""

    def __init__(self, checkpointer: Checkpointer, reference_given: bool):
        self.checkpointer, self.reference_given = checkpointer, reference_given

    def on_stage(self, ctx: StageContext) -> None:
        stage = ctx.stage
        if ctx.staged:
            what = "begins" if ctx.at_boundary else f"continues (resumed at step {ctx.step})"
            estimator = f" ({stage.kl_estimator})" if stage.kl_beta else ""
            ctx.loop.log_event(
                ctx.step,
                f"Stage {stage.index} ({stage.name}) {what}: steps {stage.start_step + 1}-{stage.end_step}, "
                f"kl_beta {stage.kl_beta:g}{estimator}.",
            )
        if ctx.at_boundary and stage.kl_beta > 0 and not self.reference_given:
            ctx.loop.flush_metrics()
            self.checkpointer.save_named(ctx.step, boundary_checkpoint_name(stage))


def preflight_kl_reference(kl_reference: KLReferenceConfig, plan: StagePlan, model: ModelConfig) -> None:
    """Before anything is written, the model of ``kl_reference.load_path`` (when a stage of ``plan`` has a KL
    penalty), opened and checked against ``model`` as a restore of ``load_path`` is.

    :raises OLMoCheckpointError: naming the key when it cannot be this run's reference."""
    if kl_reference.load_path is None or not any(stage.kl_beta > 0 for stage in plan.stages):
        return
    from ..checkpoint.restore import preflight_reference

    preflight_reference(str(kl_reference.load_path), "kl_reference.load_path", "the KL reference", model)


def check_schedule_lengths(scheduler: SchedulerConfig, tokens_per_batch: int, plan: StagePlan) -> None:
    """Refuse a ``wsd`` schedule whose decay would start inside its warmup, now that every length is known in steps
    (validation checks durations in steps or tokens; one in epochs needs the data).

    :param scheduler: the run's schedule (``scheduler``); a stage's own is in ``plan``.
    :param tokens_per_batch: tokens per optimizer step, for a schedule in tokens.

    :raises OLMoConfigurationError: naming the schedule's keys and the longest ``t_decay`` that fits.
    """

    def span(steps: int, units: SchedulerUnits) -> int:
        return steps * tokens_per_batch if units == SchedulerUnits.tokens else steps

    problems = []
    if any(stage.scheduler is None for stage in plan.stages):  # the run's schedule spans the whole run
        problems += schedule_problems(scheduler, "scheduler", span(plan.total_steps, scheduler.units))
    for stage in plan.stages:
        if stage.scheduler is not None:
            where = f"stages[{stage.index}].scheduler"
            problems += schedule_problems(stage.scheduler, where, span(stage.num_steps, stage.scheduler.units))
    if problems:
        raise OLMoConfigurationError(" ".join(problems))


def plan_stages(cfg: TrainConfig, num_instances: Optional[Callable[[DataConfig], int]] = None) -> StagePlan:
    """The stages of ``cfg`` as step ranges (one stage of ``max_duration`` without ``stages``).

    :param num_instances: the number of instances of a data config, needed only for a duration in epochs
        (by default the memmap dataset is opened to count them).
    :raises OLMoConfigurationError: when the stages do not add up to a given ``max_duration``.
    """

    def count(data: DataConfig) -> int:
        if num_instances is not None:
            return num_instances(data)
        from ..data import DataContext, build_dataset

        return len(
            build_dataset(data, cfg.model, DataContext.from_train_config(cfg), include_instance_metadata=False)
        )

    def steps(duration: object, data: DataConfig) -> int:
        text = str(duration).strip()
        instances = count(data) if text.endswith("ep") else 0
        return parse_duration_steps(text, cfg.global_train_batch_size, cfg.tokens_per_batch, instances)

    if not cfg.stages:
        duration = DEFAULT_MAX_DURATION if cfg.max_duration is None else cfg.max_duration
        only = Stage(0, "stage0", 0, steps(duration, cfg.data), cfg.data, 0, "train_data")
        return StagePlan(_with_mixture_tokens((only,), cfg.global_train_batch_size, cfg.model.max_sequence_length))
    out: list[Stage] = []
    start, segment, order_dir, data, key = 0, 0, "train_data", cfg.data, "data"
    for i, sc in enumerate(cfg.stages):
        if sc.data is not None:
            segment, order_dir, key = i, f"train_data/stage{i}", f"stages[{i}].data"
            data = stage_data_config(cfg.data, sc.data, key)
        assert sc.max_duration is not None, "validate() reports a stage without max_duration"
        end = start + steps(sc.max_duration, data)
        name = sc.name or f"stage{i}"
        estimator = KLEstimator(sc.kl_estimator)
        out.append(Stage(i, name, start, end, data, segment, order_dir, sc.kl_beta, estimator, sc.scheduler, key))
        start = end
    stages = _with_mixture_tokens(tuple(out), cfg.global_train_batch_size, cfg.model.max_sequence_length)
    plan = StagePlan(stages, staged=True)
    if cfg.max_duration is not None:
        given = steps(cfg.max_duration, cfg.data)
        if given != plan.total_steps:
            raise OLMoConfigurationError(stage_sum_problem(cfg, plan.total_steps, given))
    return plan


def _with_mixture_tokens(
    stages: tuple[Stage, ...], global_train_batch_size: int, max_sequence_length: int
) -> tuple[Stage, ...]:
    """The stages, where a data segment trains on a mixture whose ``tokens`` is null, with the segment's own
    length filled in: the mixture draws exactly the instances its stages train (the stages of one segment keep
    sharing one data config)."""
    out = list(stages)
    for segment in sorted({s.segment for s in stages}):
        members = [s for s in stages if s.segment == segment]
        mixture = members[0].data.mixture
        if mixture is None or mixture.tokens is not None:
            continue
        instances = sum(s.num_steps for s in members) * global_train_batch_size
        data = replace(members[0].data, mixture=replace(mixture, tokens=instances * max_sequence_length))
        for s in members:
            out[s.index] = replace(s, data=data)
    return tuple(out)


def mixture_file(stage: Stage) -> str:
    """The file in ``save_folder/train_data/`` that records the mixture of the data segment ``stage`` begins:
    ``mixture.json`` for the first, ``mixture-{stage name}.json`` for a later stage's own."""
    from ..data.mixture import MIXTURE_FILE

    return MIXTURE_FILE if stage.index == 0 else f"mixture-{stage.name}.json"


def check_recorded_data(
    save_folder: str, seed: int, plan: StagePlan, dataset_of: Callable[[DataConfig], MemMapDataset], fix: str
) -> None:
    """Before a resume writes anything: every data segment's files hold what the run recorded when it began, in its
    mixture record (``mixture.json``: each source's instances) and its data orders' records
    (``global_indices*.npy.json``: the instances numbered, the seed). Files that grew, shrank or were replaced since
    (a glob that matches more files) would change the instances the checkpoint's data position points at.

    :param seed: the run's ``seed`` (a data config's own ``seed`` wins).
    :param fix: how to use the data as it is now instead, for the message (e.g. a new run from the checkpoint).
    :raises OLMoDataError: naming the record, what changed and how to proceed.
    """
    from ..data import data_order_seed
    from ..data.mixture import check_recorded_mixture
    from ..data.order_file import read_order_record
    from ..exceptions import OLMoDataError

    for stage in plan.stages:
        if stage.segment != stage.index:
            continue
        key, dataset = stage.data_key, dataset_of(stage.data)
        if dataset.mixture_plan is not None:
            record = Path(save_folder) / "train_data" / mixture_file(stage)
            check_recorded_mixture(record, dataset.mixture_plan, f"{key}.mixture", fix)
        n, order_seed = len(dataset), data_order_seed(stage.data, seed)
        for order in sorted(order_dir_of(save_folder, stage).glob("global_indices*.npy")):
            held = read_order_record(order) or {}
            numbered = held.get("num_instances")
            if not isinstance(numbered, int) or (numbered, held.get("seed")) == (n, order_seed):
                continue  # no record (the order is then compared entry by entry), or the data as recorded
            if numbered != n:
                change = (
                    f"{key}'s files hold {n:,} instances now: they grew, shrank or were replaced since the run began "
                    f"(a glob that matches more files, say), or model.max_sequence_length changed"
                )
            else:
                change = f"its seed is {order_seed} now ({key}.seed, else seed): set it back to {held.get('seed')}"
            raise OLMoDataError(
                f"The run's data order '{order}' numbers {numbered:,} instances shuffled with seed "
                f"{held.get('seed')}, but {change}: its positions would name other instances than the run trained "
                f"on. Restore the files or settings as they were; or, for the data as it is now, {fix}."
            )


def order_dir_of(save_folder: str, stage: Stage) -> Path:
    """The absolute directory of the data order ``stage`` trains on, in the run's ``save_folder``."""
    return Path(save_folder) / stage.order_dir


def build_stage_dataloader(
    model: ModelConfig,
    context: DataContext,
    stage: Stage,
    world_size: int,
    rank: int,
    dataset: Optional[MemMapDataset] = None,
) -> DataLoader:
    """The training DataLoader of ``stage``'s data segment (see :func:`olmo.data.build_train_loader`): the first
    segment starts at ``context.epoch`` as a run without stages does, a later one at epoch 0.

    :param model: the run's ``model`` section (the instances' length).
    :param context: the run's data settings (:meth:`olmo.data.DataContext.from_train_config`).
    :param dataset: the segment's data, already opened (its files are then not looked at again).
    """
    from ..data import build_train_loader

    staged = replace(context, epoch=context.epoch if stage.segment == 0 else None)
    work_dir = order_dir_of(context.save_folder, stage)
    return build_train_loader(
        stage.data, model, staged, world_size=world_size, rank=rank, work_dir=work_dir, dataset=dataset
    )


def check_kl_reference(
    save_folder: str,
    kl_reference: KLReferenceConfig,
    model: ModelConfig,
    plan: StagePlan,
    restored: Optional[str],
    restored_step: int,
) -> None:
    """Before any work: a launch that resumes inside a KL stage (after its first step) needs the checkpoint of
    the stage's first step, which holds its reference (unless ``kl_reference.load_path`` names one).

    :param save_folder: the run's ``save_folder``, where the trainer saved that checkpoint.
    :param model: the run's ``model`` section, which the reference's shapes must match.
    :param restored: the checkpoint this launch restores with its trainer state, or None.
    :raises OLMoCheckpointError: naming the checkpoint that is missing and what to do.
    """
    from ..checkpoint import inspect_checkpoint
    from ..checkpoint.restore import RestorePlan, preflight_restore
    from ..exceptions import OLMoCheckpointError

    stage = plan.at(restored_step + 1)
    if restored is None or stage.kl_beta == 0 or kl_reference.load_path is not None:
        return
    if restored_step <= stage.start_step:
        return  # the snapshot is taken when the stage begins
    found = find_boundary_checkpoint(save_folder, stage, restored)
    if found is None:
        raise OLMoCheckpointError(
            f"The launch resumes at step {restored_step}, inside KL stage {stage.index} ({stage.name}), whose "
            f"reference is the model at its first step, saved as '{Path(save_folder) / boundary_checkpoint_name(stage)}'; "
            f"that checkpoint is missing (not in save_folder nor next to '{restored}'). Copy it there, resume from a "
            f"checkpoint at or before step {stage.start_step}, or name the reference with --kl_reference.load_path."
        )
    # Opened and checked as a --load_path is, before anything is written: damaged, partial, of another step or run,
    # or of another shape.
    info = inspect_checkpoint(str(found), "the KL reference")
    try:
        check_boundary_checkpoint(save_folder, stage, found, info, restored)
        preflight_restore(RestorePlan(info, load_optimizer_state=False, load_trainer_state=False), model)
    except OLMoCheckpointError as e:
        raise type(e)(
            f"The reference of KL stage {stage.index} ({stage.name}), '{found}', cannot be used: {e} Copy the stage's "
            f"first-step checkpoint back, resume from a checkpoint at or before step {stage.start_step}, or name the "
            f"reference with --kl_reference.load_path."
        ) from None


def check_boundary_checkpoint(
    save_folder: str, stage: Stage, found: Path, info: CheckpointInfo, restored: Optional[str]
) -> None:
    """The checkpoint ``found`` where :func:`find_boundary_checkpoint` looked is the one this trainer saved when
    ``stage`` began: committed (its marker), of the stage's first step, and of this run (its ``save_folder``, or the
    run ``restored`` belongs to), not a link to another run's.

    :raises OLMoCheckpointError: saying which of these it is not.
    """
    from ..checkpoint import MARKER
    from ..exceptions import OLMoCheckpointError
    from ..util import is_url

    if not info.marked:
        raise OLMoCheckpointError(
            f"it has no {MARKER} marker, which this trainer writes last into every checkpoint, so the save or copy "
            f"that made it did not finish."
        )
    if info.step != stage.start_step:
        raise OLMoCheckpointError(
            f"it is a checkpoint of step {info.step}, not of step {stage.start_step} where stage {stage.index} began."
        )
    runs = {Path(save_folder).resolve()}
    if restored is not None and not is_url(restored):
        runs.add(Path(restored).parent.resolve())
    if found.is_symlink() and found.resolve().parent not in runs:
        raise OLMoCheckpointError(
            f"it is a link to '{found.resolve()}', a checkpoint of another run, not this run's model at step "
            f"{stage.start_step} (to use that model on purpose, name it with --kl_reference.load_path)."
        )


def find_boundary_checkpoint(save_folder: str, stage: Stage, restored: Optional[str]) -> Optional[Path]:
    """The checkpoint of ``stage``'s first step: in the run's ``save_folder``, or else next to ``restored`` (the
    checkpoint a launch resumed from, e.g. another run's with ``--load_path``); None when neither holds it."""
    from ..util import is_url

    name = boundary_checkpoint_name(stage)
    candidates = [Path(save_folder) / name]
    if restored is not None and not is_url(restored):
        candidates.append(Path(restored).parent / name)
    return next((c for c in candidates if c.is_dir()), None)


def no_kl_penalty_error(module: str, stage_index: int) -> OLMoConfigurationError:
    return OLMoConfigurationError(
        f"train_module={module} does not train a KL penalty, but stages[{stage_index}].kl_beta > 0. Leave "
        f"train_module unset (staged runs use olmo.train.kl.KLTrainModule), or give a subclass of olmo.train.kl.KLTrainModule."
    )
