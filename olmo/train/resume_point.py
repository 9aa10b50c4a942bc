"""What a launch that continues a checkpoint's trainer state must have: steps left to train, and a learning rate that
continues where the checkpoint left it (a *decay branch* of a WSD schedule starts its decay at or after the step it
loads). Checked before anything is written (:func:`check_resume_point`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

from ..config import DEFAULT_MAX_DURATION, SchedulerConfig, SchedulerType, SchedulerUnits
from ..exceptions import OLMoConfigurationError

if TYPE_CHECKING:
    from .stages import StagePlan

__all__ = ["check_resume_point"]


def check_resume_point(
    plan: StagePlan,
    restored: str,
    restored_step: int,
    in_save_folder: bool,
    *,
    scheduler: SchedulerConfig,
    tokens_per_batch: int,
    max_duration: Union[int, str, None],
    written: dict[str, Any],
) -> None:
    """Before anything is written: a launch that continues the trainer state of ``restored`` (at ``restored_step``)
    has steps left to train, and a WSD decay of the run's schedule that differs from the checkpoint's (a *decay
    branch*) starts at or after that step, so the learning rate continues where the checkpoint left it.

    :param in_save_folder: the checkpoint is the run's own (a resume); a finished run may be relaunched as is.
    :param scheduler: the run's ``scheduler``; ``tokens_per_batch``: tokens per optimizer step; ``max_duration``:
        the run's, as given (null: the default).
    :param written: the run's config as written (:meth:`olmo.config.TrainConfig.as_written`), whose schedule is
        compared with the one saved with ``restored``.
    :raises OLMoConfigurationError: naming the keys and the values that fit.
    """
    total = plan.total_steps
    duration = DEFAULT_MAX_DURATION if max_duration is None else max_duration
    length = "the stages' max_duration" if plan.staged else f"max_duration={duration}"
    if total < restored_step or (total == restored_step and not in_save_folder):
        if in_save_folder:
            fix = f"Set --max_duration to {restored_step} steps or more to resume the run"
        else:
            fix = (
                f"Set --max_duration to more than {restored_step} steps (a decay branch: {restored_step} plus the "
                f"decay's steps, given as --scheduler.t_decay)"
            )
        raise OLMoConfigurationError(
            f"{length} ({total:,} steps) ends {'at' if total == restored_step else 'before'} step {restored_step}, "
            f"the step of the checkpoint this launch continues ('{restored}'): it would train no step"
            f"{'' if in_save_folder else ' and write a new run folder holding only that checkpoint'}. {fix}, or "
            f"load an earlier checkpoint."
        )
    s = scheduler
    if plan.at(restored_step + 1).scheduler is not None or s.name != SchedulerType.wsd or not s.t_decay:
        return
    if _schedule_of(_saved_config(restored)) == _schedule_of(written):
        return  # the checkpoint's own schedule, continued
    per_step = tokens_per_batch if s.units == SchedulerUnits.tokens else 1
    end = s.t_max if s.t_max is not None else total * per_step
    start, at = end - s.t_decay, restored_step * per_step
    if start >= at:
        return
    units = "tokens" if per_step > 1 else "steps"
    if s.t_max is not None:
        keep_decay = f"--scheduler.t_max={at + s.t_decay}"
        end_key = f"scheduler.t_max={s.t_max}"
    else:
        keep_decay = f"--max_duration={restored_step + -(-int(s.t_decay) // per_step)}"
        end_key = f"{length} ({end:,} {units})"
    raise OLMoConfigurationError(
        f"The launch continues step {restored_step} of '{restored}' with a WSD decay that starts at {start:,} "
        f"{units} ({end_key} minus scheduler.t_decay={s.t_decay}), before that step ({at:,} {units}): the learning "
        f"rate would jump from the checkpoint's to one {100 * (at - start) / s.t_decay:.0f}% of the way down the "
        f"decay. A decay branch must start its decay at or after the step it loads: keep t_decay with "
        f"{keep_decay}, or keep the length with --scheduler.t_decay={end - at}, or branch from an earlier checkpoint "
        f"(one at or before {start:,} {units})."
    )


def _saved_config(checkpoint: str) -> Optional[dict]:
    """The ``config.yaml`` saved with ``checkpoint`` as plain data (never resolved), or None when it has none."""
    import yaml

    from ..checkpoint.safe_reads import fetch
    from ..exceptions import OLMoError

    try:
        loaded = yaml.safe_load(fetch(checkpoint, "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError, OLMoError):  # missing, unreadable or not YAML: unknown
        return None
    return loaded if isinstance(loaded, dict) else None


def _schedule_of(config: Optional[dict]) -> Optional[tuple]:
    """What decides a run's learning rate at each step, from a config as written (None when unknown)."""
    if config is None:
        return None
    keys = ("scheduler", "max_duration", "stages", "global_train_batch_size")
    model = config.get("model")
    return (*(config.get(k) for k in keys), model.get("max_sequence_length") if isinstance(model, dict) else None)
