"""Components take their own config section, not the whole ``TrainConfig`` (issue 52, point 2).

Outside ``olmo/config/`` (which defines it) and ``olmo/cli/`` (the commands, which load it and hand each part its
sections), a function, method, constructor or dataclass field may name ``TrainConfig`` in an annotation only when
it is on :data:`TRAIN_CONFIG_ALLOWED`, with the reason: OLMo's own public signatures, which scripts written against
OLMo call, the launcher's assembly and the record of the run. Everything else takes its section(s)
(``cfg.optimizer``, ``cfg.data``, ...) or a small frozen options object of the few values it needs.

A train module reads its settings from what it was built with, never through its trainer (``self.trainer.cfg``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "olmo"

TRAIN_CONFIG_ALLOWED = {
    # OLMo's own public signatures, which scripts written against OLMo call.
    "olmo/checkpoint/olmo_checkpointers.py:Checkpointer.__init__": (
        "OLMo's Checkpointer(cfg, thread_count): writes the whole config into each checkpoint"
    ),
    "olmo/checkpoint/olmo_checkpointers.py:build_sharded_checkpointer": (
        "OLMo's build_sharded_checkpointer(cfg): the checkpointer writes the whole config into each checkpoint"
    ),
    "olmo/data/__init__.py:build_collator": "OLMo's build_collator(train_config); calls build_data_collator",
    "olmo/data/__init__.py:build_memmap_dataset": (
        "OLMo's build_memmap_dataset(cfg, cfg.data), DESIGN.md's inspection snippet; calls build_dataset"
    ),
    "olmo/data/__init__.py:build_eval_dataloader": (
        "OLMo's build_eval_dataloader(cfg, data_cfg, batch_size); calls build_eval_loader"
    ),
    "olmo/data/__init__.py:build_train_dataloader": (
        "OLMo's build_train_dataloader(cfg, world_size=..., rank=...); calls build_train_loader"
    ),
    "olmo/data/collator.py:DataCollator.from_train_config": "OLMo's DataCollator.from_train_config(train_config)",
    "olmo/data/custom_datasets.py:build_custom_dataset": "OLMo's build_custom_dataset(cfg); also takes cfg.data",
    "olmo/optim/__init__.py:build_optimizer": "OLMo's build_optimizer(cfg, model); also takes cfg.optimizer",
    "olmo/optim/scheduler.py:build_scheduler": (
        "OLMo's build_scheduler(cfg, sched_cfg=None); also takes cfg.scheduler"
    ),
    "olmo/tokenizer.py:Tokenizer.from_train_config": "OLMo's Tokenizer.from_train_config(train_config)",
    # Options objects built where the config is at hand, the run's assembly and its record.
    "olmo/checkpoint/restore.py:LaunchOptions.from_train_config": (
        "the launch's restore and save-folder settings, taken where the config is at hand (the command)"
    ),
    "olmo/data/builders.py:DataContext.from_train_config": (
        "the run-wide data settings (top-level keys) the data builders take, read where the config is at hand"
    ),
    "olmo/distributed/run_shape.py:RunShape.from_train_config": (
        "the settings that size a run before its launch (memory check, estimates, plans), read where the config is "
        "at hand"
    ),
    "olmo/eval/__init__.py:evaluators_of_run": (
        "the commands' one assembly of a run's evaluators (build_evaluators with its sections; the tensor-parallel "
        "share from the layout)"
    ),
    "olmo/train/batch_lookup.py:batch_rows": (
        "inspect_batch's lookup of a step's batch from a run's config.yaml: plans its stages and opens its data "
        "as the launch did"
    ),
    "olmo/train/build_module.py:build_train_module": (
        "the train module's own builder: a TrainModule subclass's from_config may read any section (issue 37 "
        "follow-up)"
    ),
    "olmo/train/checkpointer.py:Checkpointer.__init__": (
        "the record of the run: every checkpoint holds the whole config as its config.yaml (it also reads the "
        "save_* keys)"
    ),
    "olmo/train/stages.py:plan_stages": (
        "the run's stage plan, from its stages, data, max_duration, batch size and model at once; the stage "
        "checks take the plan"
    ),
    "olmo/distributed/parallelize.py:ParallelizeOptions.from_train_config": (
        "the options build_model applies (top-level keys), taken where the config is at hand"
    ),
    "olmo/distributed/layout.py:ParallelLayout.of_run": "the run's assembly: the layout of its parallel sections",
    "olmo/train/train_module.py:TrainModule.from_config": (
        "the train module's hook (issue 37): a TrainModule subclass builds itself from whichever sections it needs"
    ),
    "olmo/train/train_module.py:TransformerTrainModule.from_config": (
        "the hook of OLMo's step: takes the StepSettings it is built with from the config"
    ),
    "olmo/train/train_module.py:BasicTrainModule.from_config": (
        "the hook of the smallest module: optimizer.learning_rate and max_grad_norm"
    ),
    "olmo/train/trainer.py:Trainer.__init__": (
        "the run's assembly, as OLMo's Trainer(cfg=...): builds the loop's parts (stage plan, data feed, "
        "checkpointer, monitors, sinks, callbacks) each from its own sections"
    ),
    # Whole-run commands and plans: their product or their input is a whole run's config.
    "olmo/bench/train_step.py:run": (
        "the benchmark command's body: builds and measures a whole run from its config, as the launch does"
    ),
    "olmo/ladder/mesh_plan.py:plan_meshes": (
        "scripts/plan.py's body: each mesh is the config with other parallel sections, checked as a launch would"
    ),
    "olmo/ladder/plan.py:Branch.cfg": (
        "the ladder's product: a decay branch's train config, written as its YAML and trained by scripts/train.py"
    ),
    "olmo/ladder/plan.py:Rung.cfg": (
        "the ladder's product: a size's train config, written as its YAML and trained by scripts/train.py"
    ),
    "olmo/ladder/run_planner.py:plan_run": (
        "the dry run's plan of a whole run: its stages, batch, schedule, precision and memory at once"
    ),
}
"""``file:qualified name`` of each function, method or dataclass field outside ``olmo/config/`` and ``olmo/cli/``
that takes (or holds) the whole ``TrainConfig``, and why. Keep it short: a new entry needs a reason that a section
or an options object cannot serve."""

TRAINER_CFG_READS_ALLOWED: dict[str, tuple[int, str]] = {}
"""``file: (reads, reason)`` of the modules of ``olmo/train/`` and ``olmo/eval/`` that still read ``trainer.cfg``:
the count may only go down (lower it with the reads you remove; the entry goes at 0)."""

_NAMES_TRAIN_CONFIG = re.compile(r"\bTrainConfig\b")


def takes_train_config(tree: ast.Module, rel: str) -> list[str]:
    """``rel:Class.name`` (or ``rel:name``) of every function, method (``__init__`` and classmethods too) with a
    parameter annotated with a type that names ``TrainConfig``, and of every class field annotated so, at any depth
    of ``tree``."""
    found: list[str] = []

    def annotated(annotation: ast.expr | None) -> bool:
        return annotation is not None and bool(_NAMES_TRAIN_CONFIG.search(ast.unparse(annotation)))

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found.extend(
                    f"{rel}:{prefix}{child.name}.{field.target.id}"
                    for field in child.body
                    if isinstance(field, ast.AnnAssign)
                    and isinstance(field.target, ast.Name)
                    and annotated(field.annotation)
                )
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
                if any(p is not None and annotated(p.annotation) for p in params):
                    found.append(f"{rel}:{prefix}{child.name}")
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _library_modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(("olmo/config/", "olmo/cli/")):
            out.append((rel, ast.parse(path.read_text())))
    return out


def test_only_the_allowed_functions_take_the_whole_train_config():
    found = {name for rel, tree in _library_modules() for name in takes_train_config(tree, rel)}
    offenders = sorted(found - TRAIN_CONFIG_ALLOWED.keys())
    assert not offenders, (
        "these take (or hold) the whole TrainConfig: give each its own section (cfg.data, cfg.optimizer, cfg.model, "
        "...) or a small frozen options object of the values it needs, built where the config is at hand (the "
        "command); only OLMo's own public signatures and the run's assembly and record may go in "
        "TRAIN_CONFIG_ALLOWED, with the reason:\n" + "\n".join(offenders)
    )
    stale = sorted(TRAIN_CONFIG_ALLOWED.keys() - found)
    assert not stale, f"TRAIN_CONFIG_ALLOWED names what is gone or no longer takes a TrainConfig: {stale}"


def test_the_rule_sees_every_kind_of_function_and_field():
    # Guards the finder: methods, constructors, classmethods, nested functions, fields, string annotations and
    # unions all count; a function named otherwise (not build_*) too.
    sample = ast.parse(
        "class Options:\n"
        "    cfg: Optional[TrainConfig] = None\n"
        "    n: int = 0\n"
        "    @classmethod\n"
        "    def from_train_config(cls, cfg: 'TrainConfig'): ...\n"
        "    def __init__(self, *, cfg: TrainConfig | None): ...\n"
        "def check(a: int, train: TrainConfig) -> TrainConfig:\n"
        "    def inner(c: TrainConfigLike): ...\n"
        "def ok(cfg: DataConfig) -> None: ...\n"
    )
    assert takes_train_config(sample, "m.py") == [
        "m.py:Options.cfg",
        "m.py:Options.from_train_config",
        "m.py:Options.__init__",
        "m.py:check",
    ]


def trainer_cfg_reads(tree: ast.Module) -> int:
    """How many times ``tree`` reads ``cfg`` off a trainer: ``self.trainer.cfg``, ``trainer.cfg``, or ``host.cfg``
    after ``host = self.trainer``."""
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and ast.unparse(node.value).endswith("trainer")
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def is_trainer(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and (node.id == "trainer" or node.id in aliases)) or (
            isinstance(node, ast.Attribute) and node.attr == "trainer"
        )

    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "cfg" and is_trainer(node.value)
    )


def test_no_train_module_reads_the_config_through_its_trainer():
    reads = {}
    for path in sorted((PACKAGE / "train").glob("*.py")) + sorted((PACKAGE / "eval").glob("*.py")):
        count = trainer_cfg_reads(ast.parse(path.read_text()))
        if count:
            reads[path.relative_to(REPO).as_posix()] = count
    allowed = {rel: count for rel, (count, _) in TRAINER_CFG_READS_ALLOWED.items()}
    assert reads == allowed, (
        f"reads of trainer.cfg by file {reads}, allowed {allowed}: a train module takes the sections it needs when it "
        "is built (its from_config), not through its trainer; when you removed reads, lower "
        "TRAINER_CFG_READS_ALLOWED to match"
    )
    sample = "class M:\n    def f(self):\n        host = self.trainer\n        return self.trainer.cfg, host.cfg, trainer.cfg.x, self.cfg\n"
    assert trainer_cfg_reads(ast.parse(sample)) == 3


def _trainer_uses(path: Path) -> set[str]:
    """The names read off ``self.trainer`` in ``path`` (``self.trainer.x``, and ``host.x`` after ``host =
    self.trainer``)."""
    tree = ast.parse(path.read_text())
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == "self.trainer"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and (ast.unparse(node.value) == "self.trainer" or ast.unparse(node.value) in aliases)
    }


def test_train_modules_use_only_what_the_step_host_offers():
    """A train module reads the trainer through :class:`olmo.train.train_module.StepHost` only (config, process
    group, where the run is, three ways to report back), never its state, monitors or checkpointer."""
    from olmo.train.train_module import StepHost

    offered = {name for name in dir(StepHost) if not name.startswith("_")} | set(StepHost.__annotations__)
    for path in sorted((PACKAGE / "train").glob("*.py")) + sorted((PACKAGE / "eval").glob("*.py")):
        extra = _trainer_uses(path) - offered
        assert not extra, (
            f"{path.relative_to(REPO)} reads self.trainer.{sorted(extra)}: add it to StepHost or pass it"
        )
    uses = _trainer_uses(PACKAGE / "train/train_module.py")
    assert {"global_step", "add_step_metrics", "local_work", "count_filtered", "tokens_seen"} <= uses
