"""What a launch restores and where it saves, decided and checked before anything is built or written.

:func:`plan_restore` picks the checkpoint (``--try_load_latest_save`` or ``--load_path``) and opens every
file it will read (safely, tensors memory-mapped); :func:`prepare_save_folder` checks that the save folder
can be written and holds no other run; after every other check has passed, rank 0 calls
:func:`claim_save_folder`, the first write of a launch, which makes the folder this run's.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..config import TrainConfig
from ..config.input_paths import RunInput, run_inputs
from ..exceptions import OLMoCheckpointError
from ..util import is_url, local_path_of, remove_path, unwritable_reason
from ..util.checkpoint_dirs import STEP_DIR, read_marker, unreadable_checkpoints
from .kept_inputs import Removal, check_inputs_kept, later_removals
from .olmo_formats import clean_model_state, load_train_state
from .safe_reads import (
    MARKER,
    check_optimizer_kind,
    check_trainer_state,
    describe_os_error,
    load_state_file,
    read_dcp_bytes_entries,
    read_dcp_metadata,
    safe_torch_load,
)
from .storage import (
    CheckpointInfo,
    ModelMismatchError,
    check_shapes,
    delete_checkpoint,
    inspect_checkpoint,
    list_checkpoints,
    sharded_model_shapes,
    trainer_state,
)

if TYPE_CHECKING:
    from .config_record import ConfigRecord

__all__ = [
    "preflight_reference",
    "LaunchOptions",
    "LaunchPlan",
    "RestorePlan",
    "plan_restore",
    "preflight_restore",
    "prepare_save_folder",
    "claim_save_folder",
    "check_kept_inputs",
    "planned_removals",
    "resumes_in_save_folder",
    "replaces_previous_run",
]

log = logging.getLogger(__name__)

# What a run writes into its save_folder; --save_overwrite removes these (and nothing else) from a folder
# that holds another run.
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "train_data",
    "data-indices",
    "wandb",
    "plots",
    "skipped_batches.json",
)
_RUN_PATTERNS = re.compile(
    r"^(step\d+(-unsharded)?|stage\d+-step\d+|\.(stage\d+-)?step\d+(-unsharded)?\.(tmp|old|damaged)-\w+|"
    r"eval-step\d+\.json)$"
)


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """What the restore plan and the checks of the save folder read from the config (top-level keys of OLMo's
    config); :meth:`from_train_config` takes them from one."""

    save_folder: str
    save_overwrite: bool = False
    """``save_overwrite``: a new run replaces the folder's previous run; a resume removes the newer checkpoints."""
    try_load_latest_save: bool = False
    """``try_load_latest_save``: restore the folder's newest checkpoint that opens, before ``load_path``."""
    load_path: Optional[str] = None
    reset_trainer_state: bool = False
    reset_optimizer_state: bool = False
    inputs: tuple[RunInput, ...] = ()
    """Every path the run reads (:func:`olmo.config.input_paths.run_inputs`): never deleted by the launch or run."""

    @classmethod
    def from_train_config(cls, cfg: TrainConfig) -> LaunchOptions:
        """The launch settings of ``cfg``, as they are now (``dpo.reference_path`` is one of the inputs once it is
        resolved)."""
        return cls(
            save_folder=cfg.save_folder,
            save_overwrite=cfg.save_overwrite,
            try_load_latest_save=cfg.try_load_latest_save,
            load_path=None if cfg.load_path is None else str(cfg.load_path),
            reset_trainer_state=cfg.reset_trainer_state,
            reset_optimizer_state=cfg.reset_optimizer_state,
            inputs=tuple(run_inputs(cfg)),
        )


@dataclass(frozen=True)
class RestorePlan:
    """Which checkpoint a launch restores and what it takes from it."""

    info: CheckpointInfo
    load_optimizer_state: bool
    load_trainer_state: bool


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch restores (``restore``: None starts from scratch) and which checkpoints in ``save_folder`` it
    found unusable (``unusable``: damaged, or not what their names say), which are moved aside, never deleted."""

    restore: Optional[RestorePlan]
    unusable: tuple[str, ...] = ()


def plan_restore(cfg: LaunchOptions, model_cfg: Any, optimizer_cfg: Any) -> LaunchPlan:
    """Decide what this launch restores, and open every file of it (see :func:`preflight_restore`, which checks it
    against ``model_cfg`` and ``optimizer_cfg``, the run's ``model`` and ``optimizer`` sections).

    ``try_load_latest_save`` wins when ``save_folder`` holds a committed checkpoint (and then the reset
    flags are ignored: a restarted job must continue exactly); a damaged newest checkpoint is passed over,
    with a warning, for the newest one that opens (a checkpoint of another model shape is an error, not
    damage). Otherwise ``load_path``.

    :raises OLMoCheckpointError: if ``load_path`` cannot be restored (``kl_reference.load_path``:
        :func:`olmo.train.stages.preflight_kl_reference`).
    """
    unusable: list[str] = []
    if cfg.try_load_latest_save:
        for path in unreadable_checkpoints(cfg.save_folder):
            log.warning("Passing over checkpoint %s: its %s marker cannot be read.", path, MARKER)
            unusable.append(path)
        for candidate in reversed(list_checkpoints(cfg.save_folder)):
            try:
                plan = RestorePlan(inspect_checkpoint(candidate.path), True, True)
                preflight_restore(plan, model_cfg, optimizer_cfg)
            except ModelMismatchError:
                raise  # the config changed, not the checkpoint: never pass over good checkpoints for that
            except OLMoCheckpointError as e:
                log.warning("Passing over checkpoint %s for an older one: %s", candidate.path, e)
                unusable.append(candidate.path)
                continue
            if cfg.reset_trainer_state or cfg.reset_optimizer_state or cfg.load_path:
                log.info("try_load_latest_save found %s; ignoring load_path and the reset flags.", candidate.path)
            return LaunchPlan(plan, tuple(unusable))
        if unusable and cfg.load_path is None:
            log.warning("No checkpoint in '%s' could be restored; starting from scratch.", cfg.save_folder)
    if cfg.load_path is None:
        return LaunchPlan(None, tuple(unusable))
    info = inspect_checkpoint(cfg.load_path)
    load_optimizer_state = not cfg.reset_optimizer_state
    if load_optimizer_state and holds_model_only(info):
        log.info(
            "'%s' holds model weights only (e.g. written by convert_from_hf.py): the optimizer starts fresh, as "
            "with --reset_optimizer_state.",
            info.path,
        )
        load_optimizer_state = False
    plan = RestorePlan(info, load_optimizer_state, not cfg.reset_trainer_state)
    preflight_restore(plan, model_cfg, optimizer_cfg)
    return LaunchPlan(plan, tuple(unusable))


def holds_model_only(info: CheckpointInfo) -> bool:
    """Whether a local unsharded checkpoint of ours was committed without optimizer state on purpose: its marker
    lists the files committed, and ``optim.pt`` is not one of them. (A checkpoint that lost its ``optim.pt``
    after the commit still lists it, and its restore fails with the file named.)"""
    if info.sharded or info.layout != "olmo-trainer" or is_url(info.path):
        return False
    try:
        files = read_marker(Path(info.path) / MARKER).get("files")
    except OLMoCheckpointError:
        return False
    return isinstance(files, dict) and "optim.pt" not in files


def preflight_restore(plan: RestorePlan, model_cfg: Any, optimizer_cfg: Any = None) -> None:
    """Open every file the restore will read, safely, and compare the saved parameter shapes with the
    model ``model_cfg`` builds (on the meta device), the optimizer state with the optimizer ``optimizer_cfg`` names,
    and the trainer state with what a resume reads.

    Tensors are memory-mapped, not read, so this costs little even for large checkpoints; what it catches
    (a crafted or damaged file, another model's weights) would otherwise surface only after the launch
    had written ``config.yaml`` and the data order.

    :raises OLMoCheckpointError: naming the file at fault.
    """
    from ..model import OLMo

    info = plan.info
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in OLMo(model_cfg).state_dict().items()}
    ours = info.layout == "olmo-trainer"
    if info.sharded:
        folder = str(Path(info.path) / "model_and_optim")
        check_shapes(info.path, sharded_model_shapes(folder), expected)
        read_dcp_bytes_entries(folder, ("model.", "optim.") if plan.load_optimizer_state else ("model.",))
        if plan.load_optimizer_state and optimizer_cfg is not None and ours:
            entries = read_dcp_metadata(folder).state_dict_metadata
            sharded_keys = {k.rpartition(".")[2] for k in entries if k.startswith("optim.state.")}
            check_optimizer_kind(info.path, sharded_keys, optimizer_cfg.name)
        if plan.load_trainer_state:
            for path in sorted((Path(info.path) / "train").glob("rank*.pt")):
                state = load_train_state(path) if not ours else safe_torch_load(path)
                check_trainer_state(path, state, ours)
                _check_recorded_step(info, path, state)
        return
    saved = load_state_file(info.path, "model")
    check_shapes(info.path, clean_model_state(saved) if not ours else saved, expected)
    if plan.load_optimizer_state:
        optim = load_state_file(info.path, "optim")
        if optimizer_cfg is not None and ours and isinstance(optim.get("state"), dict):
            keys = {k for values in optim["state"].values() if isinstance(values, dict) for k in values}
            check_optimizer_kind(info.path, keys, optimizer_cfg.name)
    if plan.load_trainer_state:
        state = trainer_state(info)
        check_trainer_state(f"{info.path}/train.pt", state)
        _check_recorded_step(info, f"{info.path}/train.pt", state)


def preflight_reference(path: str, key: str, role: str, model_cfg: Any) -> None:
    """Open the model of checkpoint ``path`` (given by ``key``) that will be a run's frozen ``role`` (e.g. "the DPO
    reference") and check its shapes against ``model_cfg``, as a restore of ``load_path`` is checked.

    :raises OLMoCheckpointError: naming ``key`` and saying why it cannot be the ``role``."""
    try:
        preflight_restore(RestorePlan(inspect_checkpoint(path, key), False, False), model_cfg)
    except OLMoCheckpointError as e:
        raise type(e)(
            f"{key} '{path}' cannot be {role}: {e} The reference must be a checkpoint of this run's model shape."
        ) from None


def _check_recorded_step(info: CheckpointInfo, path: Any, state: dict[str, Any]) -> None:
    """The step a checkpoint's trainer state holds is the one its marker (or, without one, its folder name) says: a
    folder renamed, or filled with another checkpoint's files, would resume from one step under another's name."""
    name = info.path.rstrip("/").rsplit("/", 1)[-1]
    match = STEP_DIR.match(name)
    if not info.marked and match is None:
        return  # an original OLMo checkpoint in a folder of another name: nothing says which step it is
    recorded = int(state["global_step"])
    if recorded == info.step:
        return
    said = f"its {MARKER} marker" if info.marked else "its folder name"
    rename = f"step{recorded}" + ("" if info.sharded else "-unsharded")
    raise OLMoCheckpointError(
        f"Checkpoint '{info.path}' is not what its name says: {said} says step {info.step}, but its trainer state "
        f"'{path}' says global_step {recorded}, so it was renamed or another checkpoint's files were copied into it, "
        f"and resuming it would continue from step {recorded} as if it were step {info.step}. Rename it to {rename} "
        f"(and fix its marker) if the trainer state is right, or pick another checkpoint."
    )


def resumes_in_save_folder(save_folder: str, launch: LaunchPlan) -> bool:
    """Whether the launch restores a checkpoint of ``save_folder`` itself (a resume of the run, not a new run from
    another's checkpoint)."""
    return _resuming_here(Path(save_folder), launch.restore)


def replaces_previous_run(cfg: LaunchOptions, launch: LaunchPlan) -> bool:
    """Whether :func:`claim_save_folder` removes the previous run's files (``save_overwrite`` for a new run, neither
    resuming from the folder nor ``try_load_latest_save``)."""
    return (
        cfg.save_overwrite and not cfg.try_load_latest_save and not resumes_in_save_folder(cfg.save_folder, launch)
    )


def _same_place(a: str, b: str) -> bool:
    """Whether two checkpoint paths (relative, ``file://``, with a trailing slash or through links) name one place."""
    return os.path.realpath(local_path_of(a)) == os.path.realpath(local_path_of(b))


def _resuming_here(root: Path, plan: Optional[RestorePlan]) -> bool:
    return (
        plan is not None and not is_url(plan.info.path) and Path(plan.info.path).parent.resolve() == root.resolve()
    )


def _check_writable(root: Path) -> None:
    reason = unwritable_reason(root)
    if reason is not None:
        raise OLMoCheckpointError(
            f"save_folder '{root}' cannot be written: {reason}. Choose a writable folder with --save_folder "
            f"(it is created if missing)."
        )


def prepare_save_folder(cfg: LaunchOptions, launch: LaunchPlan) -> None:
    """Check that ``save_folder`` can be written, holds no other run (unless ``save_overwrite``), and that nothing the
    run reads lies where the launch or the run deletes (:func:`check_kept_inputs`).

    Writes nothing; :func:`claim_save_folder` acts on it once every other check has passed.

    :raises OLMoCheckpointError: naming the flag that resolves the conflict.
    """
    root, plan = Path(cfg.save_folder), launch.restore
    _check_writable(root)
    check_kept_inputs(cfg, launch)
    if cfg.save_overwrite:
        return
    existing = list_checkpoints(root)
    resuming_here = _resuming_here(root, plan)
    # With --try_load_latest_save and no committed checkpoint yet, the folder holds a launch of this run
    # that died before its first save: starting over in it is exactly what a restart should do.
    restarting_unsaved = cfg.try_load_latest_save and plan is None and not existing
    holds_run = bool(existing) or (root / "config.yaml").exists()
    if (
        cfg.try_load_latest_save and plan is None and launch.unusable and existing
    ):  # says more than the refusal below
        names = ", ".join(Path(p).name for p in launch.unusable[:3])
        raise OLMoCheckpointError(
            f"save_folder '{root}' already holds a run, but none of its checkpoints can be restored ({names}; the "
            f"warnings above say why each was passed over). Repair them (rename one back, finish a copy), load one "
            f"with --load_path to see its error, or pass --save_overwrite to move them aside and start over."
        )
    if not resuming_here and not restarting_unsaved and holds_run:
        raise OLMoCheckpointError(
            f"save_folder '{root}' already holds a run (config.yaml or checkpoints). Resume it with "
            f"--try_load_latest_save, pick a new --save_folder, or pass --save_overwrite to replace it."
        )
    if resuming_here:
        assert plan is not None
        newer = [c.path for c in existing if c.step > plan.info.step and c.path not in launch.unusable]
        if newer:
            raise OLMoCheckpointError(
                f"Resuming from step {plan.info.step} would overwrite newer checkpoints in '{root}' "
                f"({', '.join(Path(p).name for p in newer[:3])}). Resume from the newest with "
                f"--try_load_latest_save, or pass --save_overwrite to replace them."
            )


def claim_save_folder(cfg: LaunchOptions, launch: LaunchPlan, config: ConfigRecord) -> None:
    """Make ``save_folder`` this run's and write its ``config.yaml`` (``config``, the run's whole config); rank 0
    calls it after every check, before writing anything else.

    * Checkpoints found unusable (:attr:`LaunchPlan.unusable`) are moved aside (renamed to hidden
      ``.stepN.damaged-*`` entries), never deleted, so no later launch picks them up and this run can save those
      steps.
    * With ``save_overwrite`` alone, a new run removes the previous run's checkpoints and run files (the
      :data:`RUN_FILES` and ``step*``/``eval-step*.json`` entries; nothing else in the folder), and a run
      resuming from a checkpoint in the folder removes the checkpoints newer than it. Markers go first,
      so an interruption never leaves a half-deleted checkpoint that still looks committed. With
      ``try_load_latest_save`` too (as OLMo's launch scripts pass both), nothing is removed up front: the run
      replaces only what it writes again.
    * A symlink is removed or moved as a link; what it points to (perhaps another run's files) is never touched.
    """
    check_kept_inputs(cfg, launch)  # again, right before the removals: a caller may not have prepared the folder
    try:
        _clean_save_folder(cfg, launch)
        Path(cfg.save_folder).mkdir(parents=True, exist_ok=True)
        config.save(Path(cfg.save_folder) / "config.yaml")
    except OSError as e:
        raise OLMoCheckpointError(
            f"Could not write to save_folder '{cfg.save_folder}': {describe_os_error(e)}. Free some space or fix "
            f"the folder's permissions, or choose another --save_folder."
        ) from None


def _clean_save_folder(cfg: LaunchOptions, launch: LaunchPlan) -> None:
    root, plan = Path(cfg.save_folder), launch.restore
    for path in launch.unusable:
        aside = Path(path).with_name(f".{Path(path).name}.damaged-{uuid.uuid4().hex[:8]}")
        log.warning("Moving the unusable checkpoint %s aside to %s.", path, aside)
        if not Path(path).is_symlink():
            (Path(path) / MARKER).unlink(missing_ok=True)
        Path(path).rename(aside)
    if not cfg.save_overwrite or not root.is_dir():
        return
    if _resuming_here(root, plan):
        for c in _newer_checkpoints(root, launch):
            log.warning("Removing %s, newer than the checkpoint this run resumes from (--save_overwrite).", c.path)
            delete_checkpoint(c)
        return
    if not replaces_previous_run(cfg, launch):  # with try_load_latest_save: the run replaces what it writes again
        return
    doomed = _previous_run_entries(root)
    if not doomed:
        return
    log.warning(
        "Removing the previous run in '%s' (--save_overwrite): %s.", root, ", ".join(p.name for p in doomed[:8])
    )
    for c in list_checkpoints(root):
        if not Path(c.path).is_symlink():
            (Path(c.path) / MARKER).unlink()
    for entry in doomed:
        remove_path(entry)


def _previous_run_entries(root: Path) -> list[Path]:
    """The entries of ``root`` that a new run with ``--save_overwrite`` removes: the previous run's files."""
    return sorted(p for p in root.iterdir() if p.name in RUN_FILES or _RUN_PATTERNS.match(p.name))


def _newer_checkpoints(root: Path, launch: LaunchPlan) -> list[CheckpointInfo]:
    """The checkpoints of ``root`` newer than the one a launch resuming in it restores (``--save_overwrite`` removes
    them)."""
    plan = launch.restore
    assert plan is not None
    return [c for c in list_checkpoints(root) if c.step > plan.info.step and c.path not in launch.unusable]


def planned_removals(cfg: LaunchOptions, launch: LaunchPlan) -> list[Removal]:
    """What :func:`claim_save_folder` removes from ``save_folder`` (or moves aside) for this launch, and why."""
    root, plan = Path(cfg.save_folder), launch.restore
    out = [
        Removal(Path(p), "the launch moves aside (renames), as an unusable checkpoint") for p in launch.unusable
    ]
    if not cfg.save_overwrite or not root.is_dir():
        return out
    if _resuming_here(root, plan):
        assert plan is not None
        why = (
            f"--save_overwrite removes before this run starts, as a checkpoint newer than step {plan.info.step}, "
            f"which the run resumes from"
        )
        fix = "resume from the newest checkpoint (--try_load_latest_save)"
        return out + [Removal(Path(c.path), why, fix) for c in _newer_checkpoints(root, launch)]
    if replaces_previous_run(cfg, launch):
        why = "--save_overwrite removes before this run starts, with the rest of the previous run in the folder"
        out += [Removal(p, why) for p in _previous_run_entries(root)]
    return out


def check_kept_inputs(cfg: LaunchOptions, launch: LaunchPlan) -> None:
    """Refuse the launch when something it reads lies where it deletes: in what :func:`claim_save_folder` removes up
    front, or (for the references and data, read all along) in a checkpoint of ``save_folder`` that the run may
    delete later (:mod:`olmo.checkpoint.kept_inputs`). Writes nothing.

    :raises OLMoCheckpointError: naming the key, its path and the fix.
    """
    if is_url(cfg.save_folder):
        return
    plan = launch.restore
    now = planned_removals(cfg, launch)
    start_step = plan.info.step if plan is not None and plan.load_trainer_state else 0
    later = later_removals(cfg.save_folder, cfg.save_overwrite, start_step, [r.entry for r in now])
    # With try_load_latest_save, a checkpoint found in the folder wins, and load_path is not read.
    ignored = (
        plan is not None and cfg.load_path is not None and not _same_place(plan.info.path, str(cfg.load_path))
    )
    check_inputs_kept(cfg.save_folder, cfg.inputs, now, later, skip=("load_path",) if ignored else ())
