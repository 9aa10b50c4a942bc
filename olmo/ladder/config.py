"""The ladder's YAML: :class:`LadderConfig` (a family of model sizes trained from one OLMo base config), its
loading with ``--key=value`` overrides, and the checks on its values.

Every field has a docstring; unknown keys, wrong types and impossible values are
:class:`~olmo.exceptions.OLMoConfigurationError`\\ s naming the key (and the size) and the fix. What each size
turns into (batch, micro-batch, devices, learning rate, steps) is worked out by :mod:`olmo.ladder.plan`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import DictConfig
from omegaconf import OmegaConf as om
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ..config.cli import config_error, load_structured
from ..config.resolvers import register_resolvers
from ..config.sections import DecayShape
from ..exceptions import OLMoConfigurationError

__all__ = ["NAMED_SIZES", "SizeSpec", "BatchRule", "LRRule", "LadderConfig", "load_ladder", "hybrid_size_problems"]

NAMED_SIZES: dict[str, dict[str, Any]] = {
    "60M": dict(d_model=512, n_layers=14, n_heads=8, mlp_ratio=8),
    "150M": dict(d_model=768, n_layers=16, n_heads=12, mlp_ratio=8),
    "300M": dict(d_model=1024, n_layers=18, n_heads=16, mlp_ratio=8),
    "600M": dict(d_model=1536, n_layers=16, n_heads=16, mlp_ratio=8),
    "1B": dict(d_model=2048, n_layers=16, n_heads=16, mlp_ratio=8),
    "3B": dict(d_model=3072, n_layers=20, n_heads=24, mlp_ratio=8),
    "7B": dict(d_model=4096, n_layers=32, n_heads=32, mlp_hidden_size=22016),
    "13B": dict(d_model=5120, n_layers=40, n_heads=40, mlp_hidden_size=27648),
}
"""Shapes for size names, in OLMo's block design (SwiGLU, no biases; ``mlp_ratio: 8`` as OLMo-1B, OLMo-7B's and
OLMo-2-13B's MLP widths). The name is the non-embedding parameter count with that design (within 10%)."""

_SIZE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class SizeSpec:
    """One rung: a name (the folder ``dir/NAME``), its shape, and optional per-size overrides of the rules."""

    name: str = "???"
    """The size's name; a key of :data:`NAMED_SIZES` gives the shape (fields given here win), any other name
    needs one."""
    d_model: Optional[int] = None
    """Hidden size (``model.d_model``)."""
    n_layers: Optional[int] = None
    """Transformer blocks (``model.n_layers``)."""
    n_heads: Optional[int] = None
    """Attention heads (``model.n_heads``)."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for GQA; None keeps the base config's."""
    mlp_ratio: Optional[int] = None
    """MLP width as a multiple of ``d_model``; None keeps the base config's."""
    mlp_hidden_size: Optional[int] = None
    """Explicit MLP width (wins over ``mlp_ratio``); None keeps the base config's unless ``mlp_ratio`` is set."""
    max_duration: Optional[Union[int, str]] = None
    """This size's length in steps (``5000``) or tokens (``"2e9T"``) instead of ``chinchilla_multiple``."""
    global_batch_size: Optional[int] = None
    """This size's global batch in instances instead of the batch rule; must be divisible by devices x micro-batch."""
    rank_microbatch_size: Optional[int] = None
    """Instances per device per forward pass instead of the largest power of two that fits the device."""
    learning_rate: Optional[float] = None
    """Peak learning rate instead of the LR rule."""
    budgets: Optional[list[float]] = None
    """This size's token budgets instead of the ladder's ``budgets`` (``[]``: one run with the base schedule)."""

    @property
    def model_fields(self) -> dict[str, int]:
        """The shape fields this spec sets."""
        names = ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_ratio", "mlp_hidden_size")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


@dataclass
class BatchRule:
    """Target global batch in tokens as a function of the non-embedding parameter count N:
    ``tokens_coefficient * (N / reference_params) ** exponent`` (OLMo-core's ladder: 160 instances of 2048
    tokens at 108M parameters, growing as N^(2/3)). In instances of ``sequence_length``, it is rounded to a power
    of two (``round_to_power_of_two``) or to the nearest integer, then to a multiple of devices x micro-batch."""

    tokens_coefficient: float = 327_680.0
    """Tokens per batch at ``reference_params``."""
    reference_params: float = 108e6
    """Non-embedding parameters at which the batch is ``tokens_coefficient`` tokens."""
    exponent: float = 2 / 3
    """How the batch grows with N."""
    round_to_power_of_two: bool = True
    """Round the instances to the nearest power of two (in log space) rather than to the nearest integer."""


@dataclass
class LRRule:
    """Peak learning rate ``coefficient * (N / reference_params) ** params_exponent * (B / reference_batch_tokens)
    ** batch_exponent`` (N non-embedding parameters, B the actual batch in tokens; OLMo-core's ladder: 0.0047 at
    108M, as N^(-1/3), independent of the batch), with a linear warmup of ``warmup_tokens_per_param * N`` tokens
    (OLMo-core: one token per parameter) into the base config's schedule."""

    coefficient: float = 0.0047
    """Peak learning rate at ``reference_params`` (and ``reference_batch_tokens``)."""
    reference_params: float = 108e6
    """Non-embedding parameters at which the rate is ``coefficient``."""
    params_exponent: float = -1 / 3
    """How the rate scales with N."""
    batch_exponent: float = 0.0
    """How the rate scales with the batch in tokens (0: not at all; 0.5: square-root scaling)."""
    reference_batch_tokens: float = 327_680.0
    """Batch in tokens at which the rate is ``coefficient`` (used when ``batch_exponent`` is not 0)."""
    warmup_tokens_per_param: float = 1.0
    """Warmup length in tokens per non-embedding parameter; must leave the warmup shorter than the run."""


@dataclass
class LadderConfig:
    """A scaling ladder: model sizes trained with one recipe, from one OLMo base config."""

    name: str = "???"
    """The ladder's name (run names are ``NAME-SIZE``)."""
    dir: str = "runs/ladder/${name}"
    """Where every size trains: ``dir/SIZE/`` is its save folder; ``dir/configs/SIZE.yaml`` its train config."""
    base_config: str = "???"
    """An OLMo train config (path relative to the current directory); every setting not set by the ladder (data,
    optimizer, schedule shape, precision, sharding, activation checkpointing, evaluators) is inherited."""
    train_overrides: list[str] = field(default_factory=list)
    """Train-config overrides (``key.path=value``) applied to the base config; the ladder's own settings (shape,
    batch, micro-batch, learning rate, warmup, duration, checkpoints, save folder, seed) are applied after them."""
    sizes: list[Any] = field(default_factory=list)
    """The rungs, smallest first: names of :data:`NAMED_SIZES` or ``{name, d_model, n_layers, n_heads, ...}`` (see
    :class:`SizeSpec`). The scaling law is fitted to these."""
    next_sizes: list[Any] = field(default_factory=list)
    """Sizes beyond the ladder, planned like the others (dry-run, run) but never fitted: ``results`` predicts their
    loss from the fit and shows it beside the measured loss once they have run."""
    sequence_length: int = 4096
    """Tokens per instance (``model.max_sequence_length``) for every size."""
    max_devices: int = 1
    """Most devices (data-parallel ranks) a size may use; a size uses fewer when its batch is smaller."""
    device_type: Optional[str] = None
    """The device every rank has: ``cpu``, ``H100 80GB``, ``A100 40GB``, ...; None is this machine's."""
    seed: int = 6198
    """Seed of every size (model init and data order)."""
    chinchilla_multiple: float = 1.0
    """Training tokens = ``chinchilla_multiple * 20 * N`` (N non-embedding parameters), rounded up to whole batches;
    a size's own ``max_duration`` wins."""
    batch: BatchRule = field(default_factory=BatchRule)
    """The global batch size rule."""
    lr: LRRule = field(default_factory=LRRule)
    """The learning rate and warmup rule."""
    max_rank_microbatch_size: int = 32
    """Largest micro-batch (instances per device per forward pass) tried; the largest power of two up to it that
    fits the device's memory (see :func:`olmo.ladder.estimates.estimate_memory`) is used."""
    checkpoints_per_run: int = 4
    """Checkpoints (and evaluations) per size, evenly spaced in steps; the last is at the final step."""
    sharded_checkpoints: bool = False
    """Save sharded checkpoints (``stepN/``) instead of unsharded ones (``stepN-unsharded/``)."""
    budgets: list[float] = field(default_factory=list)
    """Token budgets per size, as multiples of its length (``chinchilla_multiple`` x 20 N tokens, or its own
    ``max_duration``), e.g. ``[1, 2, 4]``. Empty: one run per size, with the base config's schedule. Given: each size
    trains a warmup-stable-decay schedule's stable phase once (``dir/SIZE/stable``, up to the largest budget's
    decay), and from its checkpoints one decay branch per budget (``dir/SIZE/budget-2x``: an ordinary resume with a
    new ``max_duration`` and ``scheduler.t_decay``), each a finished model at its budget."""
    decay_fraction: float = 0.2
    """With ``budgets``: each branch's decay (``scheduler.t_decay``) as a fraction of its budget; 0.1 to 0.2 is usual
    (the branch starts at ``(1 - decay_fraction) x`` its budget)."""
    decay_shape: str = "linear"
    """With ``budgets``: the branches' decay shape (``scheduler.decay_shape``: ``linear``, ``cosine`` or ``1-sqrt``),
    down to the base config's ``scheduler.alpha_f``."""
    assumed_mfu: float = 0.4
    """MFU assumed for the estimated wall time."""
    fit_metric: Optional[str] = None
    """The ``metrics.jsonl`` key whose final value the scaling law fits; None: the first
    ``eval/*/CrossEntropyLoss`` every finished size logged, else the training loss averaged over the last 10 steps."""


def _ladder_error(e: OmegaConfBaseException, source: str) -> OLMoConfigurationError:
    if not isinstance(e, ConfigKeyError):
        return config_error(e, source)
    key = getattr(e, "full_key", None) or "?"
    parent, _, leaf = key.rpartition(".")
    node: Any = LadderConfig
    for part in parent.split(".") if parent else []:
        node = typing.get_type_hints(node).get(part) if dataclasses.is_dataclass(node) else None
    return _unknown_key(key, leaf, node, source)


def _unknown_key(key: str, leaf: str, schema: Any, source: str) -> OLMoConfigurationError:
    """An unknown key ``key`` (its last part ``leaf``, a field of none of ``schema``'s), with the closest field."""
    names = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
    close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.5)
    hint = f" Did you mean '{key[: len(key) - len(leaf)]}{close[0]}'?" if close else ""
    return OLMoConfigurationError(
        f"Unknown ladder key '{key}' ({source}).{hint} Remove or rename it; every ladder key is documented in "
        f"olmo/ladder/config.py."
    )


def load_ladder(path: Union[str, Path], overrides: Optional[list[str]] = None) -> LadderConfig:
    """Load a ladder YAML, apply ``--key.path=value`` overrides, resolve interpolations and check the values.

    :raises OLMoConfigurationError: naming the key (and size) for unknown keys, wrong types and bad values.
    """
    register_resolvers()
    ladder = load_structured(LadderConfig, path, overrides, _ladder_error)
    ladder.sizes = [_size_spec(s, f"sizes[{i}]") for i, s in enumerate(ladder.sizes)]
    ladder.next_sizes = [_size_spec(s, f"next_sizes[{i}]") for i, s in enumerate(ladder.next_sizes)]
    validate_ladder(ladder)
    return ladder


def _size_spec(item: Any, key: str) -> SizeSpec:
    """A size as given (a name, or a mapping) as a :class:`SizeSpec` with its shape filled in."""
    if isinstance(item, SizeSpec):
        return item
    if isinstance(item, (str, int)):
        item = {"name": str(item)}
    if not isinstance(item, (dict, DictConfig)):
        raise OLMoConfigurationError(
            f"{key}={item!r} is not a size: give a name ({', '.join(NAMED_SIZES)}) or a mapping such as "
            f"{{name: small, d_model: 256, n_layers: 4, n_heads: 4}}."
        )
    try:
        spec: SizeSpec = om.to_object(om.merge(om.structured(SizeSpec), om.create(dict(item))))  # type: ignore
    except ConfigKeyError as e:
        leaf = str(getattr(e, "key", None) or "?")
        raise _unknown_key(f"{key}.{leaf}", leaf, SizeSpec, "in a size") from None
    except OmegaConfBaseException as e:
        msg = str(getattr(e, "msg", None) or e).splitlines()[0].rstrip(".")
        raise OLMoConfigurationError(
            f"Invalid value for {key}.{getattr(e, 'full_key', '?')}: {msg}. Fix it in the YAML, or replace the whole "
            f"list with --{key.split('[')[0]}=[...]."
        ) from None
    named = NAMED_SIZES.get(spec.name, {})
    return dataclasses.replace(spec, **{k: v for k, v in named.items() if getattr(spec, k) is None})


MAX_EXPONENT = 4
MAX_CHINCHILLA_MULTIPLE = 10_000


def validate_ladder(ladder: LadderConfig) -> None:
    """Check the values that types cannot, reporting every problem at once.

    :raises OLMoConfigurationError: listing each problem with its key and fix.
    """
    problems: list[str] = []
    if not _SIZE_NAME.match(ladder.name):
        problems.append(f"name={ladder.name!r} must be letters, digits, '.', '_' or '-' (it names the runs).")
    if not Path(ladder.base_config).is_file():
        problems.append(
            f"base_config={ladder.base_config!r} is not a file (paths are relative to the current directory). "
            f"Point it at an OLMo train config, e.g. configs/official/OLMo-1B.yaml."
        )
    if not ladder.sizes:
        problems.append("sizes is empty: list the rungs, e.g. sizes: [60M, 150M, 300M].")
    names = [s.name for s in [*ladder.sizes, *ladder.next_sizes]]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"size {dup!r} is listed more than once in sizes/next_sizes; give each size its own name.")
    for key, specs in (("sizes", ladder.sizes), ("next_sizes", ladder.next_sizes)):
        for i, spec in enumerate(specs):
            problems += _size_problems(spec, f"{key}[{i}]")
    positive = {
        "sequence_length": ladder.sequence_length,
        "max_devices": ladder.max_devices,
        "chinchilla_multiple": ladder.chinchilla_multiple,
        "max_rank_microbatch_size": ladder.max_rank_microbatch_size,
        "checkpoints_per_run": ladder.checkpoints_per_run,
        "batch.tokens_coefficient": ladder.batch.tokens_coefficient,
        "batch.reference_params": ladder.batch.reference_params,
        "lr.coefficient": ladder.lr.coefficient,
        "lr.reference_params": ladder.lr.reference_params,
        "lr.reference_batch_tokens": ladder.lr.reference_batch_tokens,
    }
    problems += [f"{k}={v} must be positive." for k, v in positive.items() if not v > 0]
    exponents = {
        "batch.exponent": ladder.batch.exponent,
        "lr.params_exponent": ladder.lr.params_exponent,
        "lr.batch_exponent": ladder.lr.batch_exponent,
    }
    problems += [
        f"{k}={v} must be between -{MAX_EXPONENT} and {MAX_EXPONENT} (scaling rules use about 2/3 for the batch and "
        f"-1/3 for the learning rate)."
        for k, v in exponents.items()
        if not -MAX_EXPONENT <= v <= MAX_EXPONENT
    ]
    if ladder.chinchilla_multiple > MAX_CHINCHILLA_MULTIPLE:
        problems.append(
            f"chinchilla_multiple={ladder.chinchilla_multiple} is more than {MAX_CHINCHILLA_MULTIPLE:,} "
            f"(= {20 * MAX_CHINCHILLA_MULTIPLE:,} tokens per parameter; Llama-3 8B trained ~1,900); use 0.5 to 100."
        )
    if ladder.lr.warmup_tokens_per_param < 0:
        problems.append(f"lr.warmup_tokens_per_param={ladder.lr.warmup_tokens_per_param} must be >= 0.")
    if not 0 < ladder.assumed_mfu <= 1:
        problems.append(f"assumed_mfu={ladder.assumed_mfu} must be in (0, 1], e.g. 0.4.")
    if not 0 <= ladder.seed < 2**32:
        problems.append(f"seed={ladder.seed} must be in [0, 2^32).")
    problems += _budget_problems(ladder.budgets, "budgets")
    if not 0 < ladder.decay_fraction < 1:
        problems.append(
            f"decay_fraction={ladder.decay_fraction} must be between 0 and 1 (exclusive): the share of each budget "
            f"spent decaying, e.g. 0.2."
        )
    shapes = [str(s) for s in DecayShape]
    if ladder.decay_shape not in shapes:
        problems.append(
            f"decay_shape={ladder.decay_shape!r} is not a decay shape; use one of {', '.join(shapes)}."
        )
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise OLMoConfigurationError(
            f"The ladder config has {len(problems)} problem(s); fix them in the YAML or with --key=value:\n{listing}"
        )


def _size_problems(spec: SizeSpec, key: str) -> list[str]:
    out: list[str] = []
    where = f"{key} (size {spec.name!r})"
    if not _SIZE_NAME.match(spec.name):
        out.append(f"{where}: the name must be letters, digits, '.', '_' or '-' (it names the folder dir/NAME).")
    missing = [k for k in ("d_model", "n_layers", "n_heads") if getattr(spec, k) is None]
    if missing:
        out.append(
            f"{where} has no {', '.join(missing)}: use a known size name ({', '.join(NAMED_SIZES)}) or give the "
            f"shape, e.g. {{name: {spec.name}, d_model: 256, n_layers: 4, n_heads: 4}}."
        )
    for k, v in spec.model_fields.items():
        if v <= 0:
            out.append(f"{where}: {k}={v} must be positive.")
    if spec.d_model and spec.n_heads and spec.d_model % spec.n_heads:
        out.append(f"{where}: d_model={spec.d_model} must be divisible by n_heads={spec.n_heads}.")
    for k in ("global_batch_size", "rank_microbatch_size", "learning_rate"):
        v = getattr(spec, k)
        if v is not None and not v > 0:
            out.append(f"{where}: {k}={v} must be positive (or left out to use the rule).")
    if spec.budgets is not None:
        out += _budget_problems(spec.budgets, f"{where}: budgets")
    if spec.max_duration is not None and str(spec.max_duration).strip().endswith("ep"):
        out.append(
            f"{where}: max_duration={spec.max_duration!r} is in epochs, which depend on the data; give steps "
            f"(5000) or tokens ('2e9T')."
        )
    return out


def hybrid_size_problems(layer_types: Optional[list[str]], linear_attention: Any, spec: SizeSpec) -> list[str]:
    """What keeps a size from scaling a hybrid base config (``model.layer_types`` with linear-attention layers): its
    layers must hold whole cycles of the pattern (else sizes differ in their ratio of layer kinds), and the
    recurrence's sizes (``model.linear_attention``) must follow each size's ``d_model`` and ``n_heads`` (null),
    not stay the base's."""
    if not layer_types or "linear_attention" not in layer_types or linear_attention is None:
        return []
    out: list[str] = []
    where = f"size {spec.name!r}"
    if spec.n_layers and spec.n_layers % len(layer_types):
        out.append(
            f"{where}: n_layers={spec.n_layers} is not a multiple of the {len(layer_types)} entries of the base "
            f"config's model.layer_types={list(layer_types)}, so its share of linear-attention layers would differ "
            f"from the other sizes'; give it a multiple of {len(layer_types)}."
        )
    fixed = [
        k
        for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
        if getattr(linear_attention, k) is not None
    ]
    if fixed:
        keys = ", ".join(f"model.linear_attention.{k}={getattr(linear_attention, k)}" for k in fixed)
        out.append(
            f"{where}: the base config fixes {keys}, which would stay the same at every size; set "
            f"{'it' if len(fixed) == 1 else 'them'} to null in train_overrides (e.g. "
            f"model.linear_attention.{fixed[0]}=null), so that each size derives them from its d_model and n_heads "
            f"as OLMo Hybrid does (key_head_dim = int(0.75 * d_model / n_heads), value_head_dim = 2 x that)."
        )
    return out


MAX_BUDGETS = 16


def _budget_problems(budgets: list[float], key: str) -> list[str]:
    """What is wrong with a list of budgets (multiples of a size's length)."""
    out = [
        f"{key}: {b} must be a positive multiple of the size's length, e.g. 1, 2 or 4."
        for b in budgets
        if not b > 0
    ]
    out += [
        f"{key}: {b} is more than {MAX_CHINCHILLA_MULTIPLE:,} times the size's length; budgets are usually 0.5 to 16."
        for b in budgets
        if b > MAX_CHINCHILLA_MULTIPLE
    ]
    if len(set(budgets)) != len(budgets):
        out.append(f"{key}={budgets} lists a budget twice; list each once.")
    if len(budgets) > MAX_BUDGETS:
        out.append(f"{key} has {len(budgets)} budgets; at most {MAX_BUDGETS} (each is a decay branch to train).")
    return out
