"""Each size of a ladder as a train config and a run plan: the per-size arithmetic.

For a size with N non-embedding parameters (counted by the model's own code, see :func:`olmo.ladder.estimates.model_facts`):

1. the target global batch is ``batch.tokens_coefficient * (N / batch.reference_params) ** batch.exponent`` tokens,
   in instances of ``sequence_length`` rounded to a power of two (or the nearest integer);
2. the micro-batch is the largest power of two up to ``max_rank_microbatch_size`` (and the batch) whose estimated
   peak memory fits the device (:func:`olmo.ladder.estimates.estimate_memory`), with ``min(max_devices, batch / micro)``
   data-parallel devices; the batch is then rounded to a multiple of devices x micro-batch;
3. the learning rate is ``lr.coefficient * (N / lr.reference_params) ** lr.params_exponent`` (times the batch
   term when ``lr.batch_exponent`` is set), warmed up over ``lr.warmup_tokens_per_param * N`` tokens;
4. the run is ``chinchilla_multiple * 20 * N`` tokens, rounded up to whole batches;
5. ``checkpoints_per_run`` checkpoints and evaluations, every ``ceil(steps / checkpoints_per_run)`` steps and at
   the end.

A size's own ``global_batch_size``, ``rank_microbatch_size``, ``learning_rate`` or ``max_duration`` replaces its
rule. Sizes that cannot work are reported together, each naming the size and the fix.

With ``budgets`` (multiples ``m`` of that length, in steps ``L``), a size is one stable run and its decay branches
(:class:`Branch`): budget ``m`` is ``D = ceil(m * L)`` steps, of which the last ``T = max(1, round(decay_fraction *
D))`` decay; its branch resumes the stable run's checkpoint at step ``D - T``. The stable run (``scheduler.name:
wsd``, ``t_decay: 0``) is as long as the latest branch point, and checkpoints at every branch point besides its
evenly spaced ones. A branch is exactly the run that was configured to decay at its branch point from the start
(same data order, same optimizer state), so the stable phase is trained once for all the budgets.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

from omegaconf import DictConfig
from omegaconf import OmegaConf as om

from ..config import TrainConfig
from ..config.cli import load_yaml, parse_override
from ..config.stage_sections import MAX_STEPS, parse_duration_steps
from ..distributed.run_shape import RunShape
from ..exceptions import OLMoCliError, OLMoConfigurationError
from ..util import write_result_file
from .config import LadderConfig, SizeSpec, hybrid_size_problems
from .run_planner import DeviceSpec, ModelFacts, RunPlan, estimate_memory, model_facts, plan_run, resolve_device

__all__ = ["Rung", "Branch", "plan_ladder", "select_sizes", "checkpoint_steps", "write_rung_config"]


@dataclass
class Branch:
    """One token budget of a size with ``budgets``: a decay branch from the stable run's checkpoint at
    :attr:`start_step`."""

    multiple: float
    """The budget as a multiple of the size's length."""
    steps: int
    """The branch's last step (its ``max_duration``)."""
    decay_steps: int
    """Its ``scheduler.t_decay``: the branch trains steps ``steps - decay_steps + 1`` to ``steps``."""
    cfg: TrainConfig
    config_yaml: str

    @property
    def name(self) -> str:
        """``budget-2x``: the folder and the config's suffix."""
        return f"budget-{self.multiple:g}x"

    @property
    def start_step(self) -> int:
        """The stable run's step this branch resumes from."""
        return self.steps - self.decay_steps

    @property
    def save_folder(self) -> Path:
        return Path(self.cfg.save_folder)

    def summary(self, tokens_per_step: int, flops_per_token: int) -> dict[str, Any]:
        tokens = self.steps * tokens_per_step
        return {
            "budget": self.multiple,
            "name": self.name,
            "steps": self.steps,
            "tokens": tokens,
            "branch_step": self.start_step,
            "decay_steps": self.decay_steps,
            "load_path": self.cfg.load_path,
            "save_folder": str(self.save_folder),
            "train_flops": float(flops_per_token) * tokens,
            "branch_flops": float(flops_per_token) * self.decay_steps * tokens_per_step,
        }


@dataclass
class Rung:
    """One size of the ladder, planned."""

    spec: SizeSpec
    cfg: TrainConfig
    """The size's train config (base config + ``train_overrides`` + the ladder's settings), validated."""
    config_yaml: str
    """That config as YAML, before interpolations resolve (what ``run`` writes to ``dir/configs/SIZE.yaml``)."""
    plan: RunPlan
    target_batch_tokens: float
    """The batch rule's target, before rounding."""
    checkpoint_steps: list[int]
    """Steps at which checkpoints (and evaluations) are written."""
    is_next: bool
    """A size of ``next_sizes``: planned and runnable, but not part of the fit."""
    branches: list[Branch] = dataclasses.field(default_factory=list)
    """With ``budgets``: the decay branches, smallest budget first (then :attr:`cfg` is the stable run's)."""

    @property
    def name(self) -> str:
        return self.spec.name

    def compute(self) -> Optional[dict[str, float]]:
        """With branches: the training FLOPs of the stable run and the branches, against separate runs to each
        budget (None without branches)."""
        if not self.branches:
            return None
        per_step = float(self.plan.flops_per_token) * self.plan.global_batch_size_tokens
        stable = per_step * max(b.start_step for b in self.branches)
        decays = per_step * sum(b.decay_steps for b in self.branches)
        separate = per_step * sum(b.steps for b in self.branches)
        return {
            "stable_flops": stable,
            "branches_flops": decays,
            "total_flops": stable + decays,
            "separate_runs_flops": separate,
            "saving": separate / (stable + decays),
        }

    @property
    def save_folder(self) -> Path:
        return Path(self.cfg.save_folder)

    def summary(self) -> dict[str, Any]:
        """The plan as JSON values, with the size's name and the ladder's own numbers."""
        return {
            "size": self.name,
            **self.plan.as_dict(),
            "target_global_batch_size_tokens": self.target_batch_tokens,
            "target_global_batch_size_instances": self.target_batch_tokens / self.plan.sequence_length,
            "checkpoint_steps": self.checkpoint_steps,
            "save_folder": str(self.save_folder),
            "next_size": self.is_next,
            "budgets": [
                b.summary(self.plan.global_batch_size_tokens, self.plan.flops_per_token) for b in self.branches
            ],
            "compute": self.compute(),
        }


def select_sizes(ladder: LadderConfig, names: Optional[list[str]]) -> list[SizeSpec]:
    """The specs named (all of ``sizes`` then ``next_sizes`` when None).

    :raises OLMoCliError: for a name the ladder does not have.
    """
    specs = [*ladder.sizes, *ladder.next_sizes]
    if not names:
        return specs
    by_name = {s.name: s for s in specs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise OLMoCliError(
            f"Size(s) {', '.join(map(repr, unknown))} not in ladder {ladder.name!r}: its sizes are "
            f"{', '.join(s.name for s in ladder.sizes)}"
            + (f"; its next_sizes {', '.join(s.name for s in ladder.next_sizes)}" if ladder.next_sizes else "")
            + ". Pick one with --size, or add it to sizes."
        )
    return [by_name[n] for n in names]


def plan_ladder(ladder: LadderConfig, names: Optional[list[str]] = None) -> list[Rung]:
    """Plan the sizes named (every size when None), smallest first as listed.

    :raises OLMoConfigurationError: listing every size that cannot be planned, each with its fix.
    """
    base = _Base.load(ladder)
    device = resolve_device(ladder.device_type, base.gpu_flops_available)
    next_names = {s.name for s in ladder.next_sizes}
    rungs, problems = [], []
    for spec in select_sizes(ladder, names):
        try:
            rungs.append(_plan_size(ladder, base, spec, device, spec.name in next_names))
        except OLMoConfigurationError as e:
            problems.append(str(e))
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise OLMoConfigurationError(
            f"Ladder {ladder.name!r}: {len(problems)} size(s) cannot be planned:\n{listing}"
        )
    return rungs


@dataclass(frozen=True)
class _Base:
    """The base config with ``train_overrides``: as YAML (interpolations kept), and the shape of the loaded config."""

    raw: DictConfig
    shape: RunShape
    gpu_flops_available: Optional[float]
    """``speed_monitor.gpu_flops_available``: the device's peak, when given."""

    @classmethod
    def load(cls, ladder: LadderConfig) -> _Base:
        try:
            cfg = TrainConfig.load(ladder.base_config, ladder.train_overrides)
        except OLMoConfigurationError as e:
            raise OLMoConfigurationError(f"base_config={ladder.base_config!r} with train_overrides: {e}") from None
        raw = load_yaml(Path(ladder.base_config))
        if ladder.train_overrides:
            dotlist = [parse_override(o, TrainConfig) for o in ladder.train_overrides]
            raw = cast(DictConfig, om.merge(raw, om.from_dotlist(dotlist)))
        return cls(raw, RunShape.from_train_config(cfg), cfg.speed_monitor.gpu_flops_available)

    def shaped(self, spec: SizeSpec, sequence_length: int) -> RunShape:
        """The base config's shape with the size's model: enough to count parameters and estimate memory."""
        model = dataclasses.replace(self.shape.model, **_model_fields(spec, sequence_length))
        return dataclasses.replace(self.shape, model=model)

    def with_settings(self, spec: SizeSpec, settings: dict[str, Any]) -> tuple[TrainConfig, str]:
        """The size's train config and its YAML: the base with ``settings`` (dotted key -> value) merged in
        before interpolations resolve, so that ``${run_name}`` and the like follow them, as CLI overrides do."""
        # JSON values are YAML flow scalars: names and paths survive the dotlist parser whatever they contain.
        dotlist = [f"{k}={json.dumps(v)}" for k, v in settings.items()]
        text = om.to_yaml(om.merge(self.raw, om.from_dotlist(dotlist)))
        with tempfile.TemporaryDirectory(prefix="olmo-ladder-") as tmp:
            path = Path(tmp) / f"{spec.name}.yaml"
            path.write_text(text)
            try:
                return TrainConfig.load(path), text
            except OLMoConfigurationError as e:
                raise OLMoConfigurationError(f"size {spec.name!r}: {e}") from None


def _model_fields(spec: SizeSpec, sequence_length: int) -> dict[str, Any]:
    """The ``model`` fields a size sets."""
    fields: dict[str, Any] = {**spec.model_fields, "max_sequence_length": sequence_length}
    if spec.mlp_ratio is not None and spec.mlp_hidden_size is None:
        fields["mlp_hidden_size"] = None  # the ratio must win over a width in the base config
    return fields


MAX_BATCH_TOKENS = 10**9
"""The largest global batch the batch rule may give: 250x OLMo-2's 4M tokens."""


def _target_instances(ladder: LadderConfig, n_params: int) -> tuple[float, int]:
    """The batch rule: (target tokens, instances rounded as the rule says)."""
    rule = ladder.batch
    tokens = rule.tokens_coefficient * (n_params / rule.reference_params) ** rule.exponent
    instances = max(1.0, tokens / ladder.sequence_length)
    if rule.round_to_power_of_two:
        return tokens, 2 ** round(math.log2(instances))
    return tokens, max(1, math.floor(instances + 0.5))


def _micro_and_devices(
    ladder: LadderConfig, spec: SizeSpec, run: RunShape, facts: ModelFacts, device: DeviceSpec, instances: int
) -> tuple[int, int]:
    """The largest micro-batch (a power of two, or the size's own) that fits the device, and the devices it uses."""
    if spec.rank_microbatch_size is not None:
        candidates = [spec.rank_microbatch_size]
    else:
        top = 2 ** int(math.log2(max(1, min(ladder.max_rank_microbatch_size, instances))))
        candidates = [2**k for k in range(int(math.log2(top)), -1, -1)]
    for micro in candidates:
        devices = min(ladder.max_devices, max(1, instances // micro))
        memory = estimate_memory(run, facts, devices, device, micro)
        if memory.total <= device.memory_bytes:
            return micro, devices
    gb = 1e9
    own = spec.rank_microbatch_size is not None
    what = f"rank_microbatch_size={micro}" if own else "a micro-batch of 1 instance"
    state = (memory.params + memory.grads + memory.optimizer) / gb
    raise OLMoConfigurationError(
        f"size {spec.name!r}: {what} of {ladder.sequence_length} tokens needs ~{memory.total / gb:.1f} GB per device "
        f"on {devices} x {device.name} (weights, gradients and optimizer state {state:.1f} GB, activations "
        f"{memory.activations / gb:.1f} GB, loss {memory.loss / gb:.1f} GB), more than its "
        f"{device.memory_bytes / gb:.1f} GB. "
        + ("Lower its rank_microbatch_size, or set" if own and micro > 1 else "Set")
        + " activation checkpointing (--train_overrides=[activation_checkpointing=whole_layer]), fused_loss or a "
        "shorter sequence_length; raise max_devices to shard the weights over more devices; or use a device_type "
        "with more memory."
    )


def checkpoint_interval(max_steps: int, per_run: int) -> int:
    """Steps between ``per_run`` evenly spaced checkpoints: ``ceil(max_steps / per_run)``."""
    return max(1, math.ceil(max_steps / per_run))


def checkpoint_steps(max_steps: int, per_run: int) -> list[int]:
    """The steps ``per_run`` evenly spaced checkpoints fall on: every :func:`checkpoint_interval`, and the end."""
    interval = checkpoint_interval(max_steps, per_run)
    return sorted({*range(interval, max_steps + 1, interval), max_steps})


def _plan_size(ladder: LadderConfig, base: _Base, spec: SizeSpec, device: DeviceSpec, is_next: bool) -> Rung:
    shaped = base.shaped(spec, ladder.sequence_length)
    if hybrid := hybrid_size_problems(shaped.model.layer_types, shaped.model.linear_attention, spec):
        raise OLMoConfigurationError(" ".join(hybrid))
    facts = model_facts(shaped)
    n = facts.num_non_embedding_params
    try:
        target_tokens, instances = _target_instances(ladder, n)
        if not target_tokens <= MAX_BATCH_TOKENS:
            raise OverflowError
    except (OverflowError, ValueError):
        raise OLMoConfigurationError(
            f"size {spec.name!r}: the batch rule batch.tokens_coefficient={ladder.batch.tokens_coefficient} x "
            f"({n:,} / batch.reference_params={ladder.batch.reference_params}) ^ batch.exponent={ladder.batch.exponent} "
            f"is not a batch a run can have (at most {MAX_BATCH_TOKENS:.0e} tokens). Use the rule's usual values (e.g. exponent 2/3) or give the "
            f"size a global_batch_size."
        ) from None
    if spec.global_batch_size is not None:
        instances = spec.global_batch_size
    micro, devices = _micro_and_devices(ladder, spec, shaped, facts, device, instances)
    unit = micro * devices
    if spec.global_batch_size is None:
        instances = max(unit, math.floor(instances / unit + 0.5) * unit)
    elif instances % unit:
        lower, upper = max(unit, instances // unit * unit), (instances // unit + 1) * unit
        raise OLMoConfigurationError(
            f"size {spec.name!r}: global_batch_size={instances} is not divisible by devices ({devices}) x "
            f"micro-batch ({micro}) = {unit}. Set its global_batch_size to {lower} or {upper}, or set its "
            f"rank_microbatch_size to a divisor of {instances // devices if instances >= devices else instances}."
        )
    batch_tokens = instances * ladder.sequence_length
    rule = ladder.lr
    lr = spec.learning_rate or (
        rule.coefficient
        * (n / rule.reference_params) ** rule.params_exponent
        * (batch_tokens / rule.reference_batch_tokens) ** rule.batch_exponent
    )
    if spec.max_duration is not None:
        length = float(parse_duration_steps(spec.max_duration, instances, batch_tokens, 0))
    else:
        length = ladder.chinchilla_multiple * 20 * n / batch_tokens
    budgets = ladder.budgets if spec.budgets is None else spec.budgets
    longest = length * max(budgets, default=1.0)
    if not longest <= MAX_STEPS:
        raise OLMoConfigurationError(
            f"size {spec.name!r}: its length ({length:.3g} steps of {batch_tokens:,} tokens"
            + (f", times budget {max(budgets):g}" if budgets else "")
            + f") is more than {MAX_STEPS:.0e} steps. Lower chinchilla_multiple (0.5 to 100 is usual), the budgets "
            "or the size's max_duration."
        )
    steps = max(1, math.ceil(length))
    warmup = math.ceil(rule.warmup_tokens_per_param * n / batch_tokens)
    if warmup >= steps:
        raise OLMoConfigurationError(
            f"size {spec.name!r}: the warmup ({warmup} steps = lr.warmup_tokens_per_param "
            f"{rule.warmup_tokens_per_param} x {n:,} parameters) is not shorter than the run ({steps} steps of "
            f"{batch_tokens:,} tokens). Lower lr.warmup_tokens_per_param or raise chinchilla_multiple."
        )
    lengths = _branch_lengths(ladder, spec, sorted(budgets), length, warmup)
    if lengths:
        steps = max(d - t for _, d, t in lengths)  # the stable run ends at the latest branch point
    settings = _train_settings(ladder, spec, instances, micro, lr, warmup, steps)
    if lengths:
        settings.update(_stable_settings(ladder, spec))
    cfg, text = base.with_settings(spec, settings)
    try:
        cfg.validate(devices)
    except OLMoConfigurationError as e:
        raise OLMoConfigurationError(f"size {spec.name!r}: {e}") from None
    plan = plan_run(cfg, devices, None, ladder.device_type, mfu=ladder.assumed_mfu, facts=facts)
    branches = [
        _branch(ladder, base, spec, settings, devices, multiple, total, decay)
        for multiple, total, decay in lengths
    ]
    saves = checkpoint_steps(steps, ladder.checkpoints_per_run)
    saves = sorted({*saves, *(b.start_step for b in branches)})
    return Rung(spec, cfg, text, plan, target_tokens, saves, is_next, branches)


def _branch_lengths(
    ladder: LadderConfig, spec: SizeSpec, budgets: list[float], length: float, warmup: int
) -> list[tuple[float, int, int]]:
    """Each budget's (multiple, steps, decay steps), checked: every branch point after the warmup, no two the same.

    :raises OLMoConfigurationError: naming the size, the budget and the fix.
    """
    out: list[tuple[float, int, int]] = []
    for multiple in budgets:
        total = max(1, math.ceil(multiple * length - 1e-9))
        decay = max(1, round(ladder.decay_fraction * total))
        if total - decay < warmup:
            raise OLMoConfigurationError(
                f"size {spec.name!r}: budget {multiple:g} ({total} steps) would branch at step {total - decay}, "
                f"inside the warmup ({warmup} steps), with decay_fraction={ladder.decay_fraction}. Drop that budget, "
                f"lower decay_fraction or lr.warmup_tokens_per_param, or raise chinchilla_multiple."
            )
        if out and out[-1][1] == total:
            raise OLMoConfigurationError(
                f"size {spec.name!r}: budgets {out[-1][0]:g} and {multiple:g} are both {total} steps. Drop one, or "
                f"raise chinchilla_multiple so that they differ."
            )
        out.append((multiple, total, decay))
    return out


def _stable_settings(ladder: LadderConfig, spec: SizeSpec) -> dict[str, Any]:
    """What makes a size's run the stable phase of its branches: a WSD schedule without a decay, in its own folder."""
    return {
        "run_name": f"{ladder.name}-{spec.name}-stable",
        "save_folder": str(Path(ladder.dir) / spec.name / "stable"),
        "scheduler.name": "wsd",
        "scheduler.t_decay": 0,
        "scheduler.decay_shape": ladder.decay_shape,
    }


def _branch(
    ladder: LadderConfig,
    base: _Base,
    spec: SizeSpec,
    stable: dict[str, Any],
    devices: int,
    multiple: float,
    total: int,
    decay: int,
) -> Branch:
    """The train config of one budget's decay branch: the stable run's, resumed from its checkpoint at ``total -
    decay`` with ``max_duration=total`` and ``scheduler.t_decay=decay``, saving into its own folder."""
    name = f"budget-{multiple:g}x"
    suffix = "" if ladder.sharded_checkpoints else "-unsharded"
    stable_folder = Path(stable["save_folder"])
    settings = {
        **stable,
        "run_name": f"{ladder.name}-{spec.name}-{name}",
        "save_folder": str(stable_folder.parent / name),
        "load_path": str(stable_folder / f"step{total - decay}{suffix}"),
        "max_duration": total,
        "scheduler.t_decay": decay,
        "save_interval" if ladder.sharded_checkpoints else "save_interval_unsharded": total,  # the end only
        "eval_interval": total,
    }
    cfg, text = base.with_settings(spec, settings)
    try:
        cfg.validate(devices)
    except OLMoConfigurationError as e:
        raise OLMoConfigurationError(f"size {spec.name!r}, budget {multiple:g}: {e}") from None
    return Branch(multiple, total, decay, cfg, text)


def _train_settings(
    ladder: LadderConfig, spec: SizeSpec, instances: int, micro: int, lr: float, warmup: int, steps: int
) -> dict[str, Any]:
    """Everything the ladder sets in a size's train config (dotted key -> value)."""
    interval = checkpoint_interval(steps, ladder.checkpoints_per_run)
    sharded = ladder.sharded_checkpoints
    return {
        **{f"model.{k}": v for k, v in _model_fields(spec, ladder.sequence_length).items()},
        "run_name": f"{ladder.name}-{spec.name}",
        "seed": ladder.seed,
        "save_folder": str(Path(ladder.dir) / spec.name),
        "global_train_batch_size": instances,
        "device_train_microbatch_size": micro,
        "device_train_batch_size": None,
        "device_train_grad_accum": None,
        "optimizer.learning_rate": lr,
        "scheduler.units": "steps",
        "scheduler.t_warmup": warmup,
        "scheduler.t_max": None,
        "max_duration": steps,
        "stop_at": None,
        "stop_after": None,
        "save_interval": interval if sharded else None,
        "save_interval_unsharded": None if sharded else interval,
        "save_num_checkpoints_to_keep" if sharded else "save_num_unsharded_checkpoints_to_keep": -1,
        "eval_interval": interval,
        "no_pre_train_checkpoint": True,  # a step-0 checkpoint tells the fit nothing
    }


def write_rung_config(ladder: LadderConfig, rung: Rung, branch: Optional[Branch] = None) -> Path:
    """Write the rung's train config to ``dir/configs/SIZE.yaml`` (a branch's to ``dir/configs/SIZE-budget-2x.yaml``)
    atomically, since every rank of a launch writes the same file, and return its path."""
    name = rung.name if branch is None else f"{rung.name}-{branch.name}"
    path = Path(ladder.dir) / "configs" / f"{name}.yaml"
    write_result_file(path, rung.config_yaml if branch is None else branch.config_yaml)
    return path
