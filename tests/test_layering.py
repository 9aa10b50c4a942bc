"""The package is a stack of layers, shown by its packages: a package imports only packages of layers below its
own, and there is no import cycle among ``olmo.*`` modules. The layers are the table of ``docs/architecture.md``,
read from it here, so the page and this test cannot disagree. ``scripts/`` only calls the commands of ``olmo.cli``,
and tests import them, never a script by its path.

Imports are read with ``ast``, so an import inside a function counts as much as one at the top of a
module. Imports under ``if TYPE_CHECKING:`` never run; they count for the layer rules (the config layer may
not even name a model type) but not for cycles (``config.validation`` annotates with ``TrainConfig``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "olmo"
ORIGINAL_WORKER = "olmo_original_worker.py"
"""The one script that is not a command of ``olmo.cli``: it runs in the original OLMo's virtualenv."""

ARCHITECTURE = REPO / "docs/architecture.md"


def read_layer_table(text: str) -> list[set[str]]:
    """The layers of the table in ``docs/architecture.md``, bottom to top, as sets of module names.

    A row is ``| N | `name/`, `name.py` | what it holds |``: ``name/`` is the package ``olmo.name``, ``name.py``
    the module ``olmo.name``, and ``__init__.py`` the root package ``olmo``. Rows must count 0, 1, 2, ... .
    """
    layers: list[set[str]] = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        assert int(cells[0]) == len(layers), (
            f"{ARCHITECTURE.name}: layer {cells[0]} follows layer {len(layers) - 1}"
        )
        names = [name.strip().strip("`") for name in cells[1].split(",")]
        layers.append(
            {
                "olmo" if name == "__init__.py" else "olmo." + name.removesuffix("/").removesuffix(".py")
                for name in names
            }
        )
    return layers


LAYERS = read_layer_table(ARCHITECTURE.read_text())
"""Bottom to top. ``olmo`` is the root ``__init__`` (``from olmo import OLMo`` re-exports, loaded on first use)."""
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def package_of(module: str) -> str:
    """``olmo.train.kl`` -> ``olmo.train``; ``olmo.optim`` -> itself; the root ``olmo`` -> itself."""
    return ".".join(module.split(".")[:2])


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, bool]:
    """``{imported olmo module: whether only under TYPE_CHECKING}`` for one module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def owner(name: str) -> str:
        # `from olmo.data import build_memmap_dataset` depends on olmo.data; `from olmo import config` on olmo.config.
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    found: dict[str, bool] = {}

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name == "olmo" or a.name.startswith("olmo.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source == "olmo" or source.startswith("olmo."):
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        for target in targets:
            dep = owner(target)
            if dep != module:
                found[dep] = found.get(dep, True) and type_only
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def _graph() -> dict[str, dict[str, bool]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _find_cycle(edges: dict[str, list[str]]) -> list[str]:
    """One import cycle as a path ``[a, b, ..., a]``, or [] when there is none."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(edges.get(node, [])):
            if state.get(dep) == "open":
                return [*stack[stack.index(dep) :], dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_import_graph_of_olmo_has_no_cycle():
    graph = _graph()
    # The package __init__ only re-exports names on first access; importing olmo.X runs it, but it imports
    # nothing that imports it back. Edges into it would be real dependencies and are kept.
    runtime = {m: [d for d, type_only in deps.items() if not type_only] for m, deps in graph.items()}
    cycle = _find_cycle(runtime)
    assert not cycle, "import cycle (counting imports inside functions): " + " -> ".join(cycle)


def test_every_package_imports_only_layers_below_its_own():
    graph = _graph()
    packages = {package_of(m) for m in graph}
    assert packages == set(LAYER_OF), (
        f"packages without a row in the layer table of docs/architecture.md: {packages - set(LAYER_OF)}; "
        f"rows naming no package: {set(LAYER_OF) - packages}"
    )
    upward = sorted(
        f"{module} imports {dep} ({package_of(module)} is layer {LAYER_OF[package_of(module)]}, "
        f"{package_of(dep)} is layer {LAYER_OF[package_of(dep)]})"
        for module, deps in graph.items()
        for dep in deps
        if package_of(dep) != package_of(module) and LAYER_OF[package_of(dep)] >= LAYER_OF[package_of(module)]
    )
    assert not upward, "imports of a package at the same layer or above:\n" + "\n".join(upward)


def test_the_layer_table_names_each_package_once_and_every_layer_in_order():
    # Guards the parser: the page's table is what the layer rules above enforce.
    names = [name for layer in LAYERS for name in layer]
    assert len(LAYERS) > 5 and len(names) == len(set(names)), LAYERS
    assert (
        LAYER_OF["olmo.exceptions"] == 0 and LAYER_OF["olmo.optim"] < LAYER_OF["olmo.train"] < LAYER_OF["olmo.cli"]
    )
    assert read_layer_table(
        "| layer | package |\n|---|---|\n| 0 | `a.py` | x |\n| 1 | `b/`, `__init__.py` | y |"
    ) == [
        {"olmo.a"},
        {"olmo.b", "olmo"},
    ]


def test_every_package_says_what_it_is_for_and_what_it_may_import():
    problems = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        name = ".".join(init.parent.relative_to(REPO).parts)
        if not doc:
            problems.append(f"{name} has no docstring")
        elif package_of(name) == name and name != "olmo" and "import" not in doc:
            problems.append(f"{name}'s docstring does not say which packages it may import")
    assert not problems, "\n".join(problems)


def test_the_finder_sees_imports_inside_functions_and_reports_the_path():
    # Guards the test itself: a function-level import must close a cycle, and the message must show the path.
    assert _find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    modules = _graph()
    assert "olmo.model" in modules["olmo.distributed.parallelize"]
    restore = modules["olmo.checkpoint.restore"]
    assert restore.get("olmo.model") is False  # imported inside a function, still an edge


def _is_command(module: str) -> bool:
    return module == "olmo.cli" or module.startswith("olmo.cli.")


def test_the_command_layer_is_imported_by_nothing_below_it():
    graph = _graph()
    assert "olmo.cli.train" in graph, "olmo/cli is not part of the import graph"
    downward = {m: sorted(filter(_is_command, deps)) for m, deps in graph.items() if not _is_command(m)}
    assert not any(downward.values()), (
        f"modules below olmo.cli import it: { {m: d for m, d in downward.items() if d} }"
    )
    # The original OLMo's worker loads this file into an interpreter where `olmo` is the original package.
    assert graph["olmo.bench.olmo_worker"] == {}, "olmo.bench.olmo_worker may import torch only"


def test_scripts_only_call_their_command_in_olmo_cli():
    problems = []
    for path in sorted(p for p in (REPO / "scripts").iterdir() if p.is_file()):
        text = path.read_text()
        if "sys.path" in text:
            problems.append(
                f"{path.name} mentions sys.path: scripts import the installed package (pip install -e .)"
            )
        if path.suffix != ".py" or path.name == ORIGINAL_WORKER:
            continue
        if len(text.splitlines()) > 40:
            problems.append(f"{path.name} has {len(text.splitlines())} lines: move its code into olmo/")
        if f"from olmo.cli.{path.stem} import main" not in text:
            problems.append(f"{path.name} does not import main from olmo.cli.{path.stem}")
    assert not problems, "\n".join(problems)


def test_tests_never_load_a_script_by_its_path():
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        text = path.read_text()
        if path != Path(__file__).resolve() and "spec_from_file_location" in text and "scripts" in text:
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"import olmo.cli.NAME instead of loading scripts/NAME.py by its path: {offenders}"


def test_tests_mirror_the_packages():
    folders = {
        p.name
        for p in (REPO / "tests").iterdir()
        if p.is_dir() and p.name not in ("fixtures", "golden", "__pycache__")
    }
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders <= packages, f"tests/ folders that name no package of olmo: {sorted(folders - packages)}"


RENAMES_ALLOWED = {
    "olmo/util/atomic.py": "the one atomic file write (atomic_write, atomic_file)",
    # Directory swaps, kept on purpose:
    "olmo/checkpoint/save.py": "replace_dir: a staged checkpoint, local upload or HF export renamed into place",
    "olmo/checkpoint/restore.py": "a damaged checkpoint moved aside at launch, so that it is never loaded",
    # Finished files of a staging folder moved into the output, one by one (not a temporary-file write).
    "olmo/data/memmap_writer.py": "publish(): the part-*.npy files of prepare_memmap_dataset's staging folder",
    "olmo/data/sft.py": "the output files of prepare_sft_data's staging folder",
}
"""Modules that may rename files or folders into place, and why. ``Path.replace`` cannot be told from
``str.replace`` without types, so it is not looked for: use ``os.replace``, as atomic.py does."""


def _calls(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every call of a plain name or attribute chain (``os.replace``, ``tmp.rename``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, func = [], node.func
            while isinstance(func, ast.Attribute):
                parts.append(func.attr)
                func = func.value
            parts.append(func.id if isinstance(func, ast.Name) else "?")
            found.append((node.lineno, ".".join(reversed(parts))))
    return found


def test_files_are_renamed_into_place_only_by_the_atomic_helpers_and_retries_are_not_hand_written():
    renames, retry_loops = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel, tree = str(path.relative_to(REPO)), ast.parse(path.read_text())
        if rel not in RENAMES_ALLOWED:
            renames += [
                f"{rel}:{line} {name}()"
                for line, name in _calls(tree)
                if name in ("os.replace", "os.rename", "os.renames", "shutil.move") or name.endswith(".rename")
            ]
        if rel != "olmo/util/retry.py":
            # A wait (time.sleep, Event.wait) in an exception handler inside a loop is a retry loop written by hand.
            for loop in (n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While))):
                for handler in (n for n in ast.walk(loop) if isinstance(n, ast.ExceptHandler)):
                    retry_loops += [
                        f"{rel}:{line} {name}()"
                        for line, name in _calls(handler)
                        if name in ("time.sleep", "sleep") or name.endswith(".wait")
                    ]
    assert not renames, (
        "rename files into place with olmo.util.atomic_write/atomic_file (directories: "
        f"olmo.checkpoint.save.replace_dir), or add the module to RENAMES_ALLOWED with the reason: {renames}"
    )
    assert not retry_loops, (
        "retry with olmo.util.call_with_retries (its stop= ends a wait early) instead of waiting in an except clause: "
        f"{sorted(set(retry_loops))}"
    )


def test_no_module_of_olmo_finds_the_source_checkout_from_its_own_path():
    # The package works wherever it is installed: a benchmark finds the scripts it runs beside its own script
    # (olmo.bench.scripts), configs are relative to the working directory, and only the tests know the checkout
    # (olmo.testing finds it from pytest's working directory).
    import re

    from_own_path = re.compile(r"__file__\)(\.resolve\(\))?\.(parents\[|parent\.parent)")
    assert from_own_path.search("REPO = Path(__file__).resolve().parents[2]")  # what olmo.util once held
    offenders = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if from_own_path.search(line)
    ]
    assert not offenders, (
        "modules of olmo/ that compute the source checkout from their own path; take the path from an argument, "
        "the working directory or the running script (olmo.bench.scripts.sibling_script) instead:\n"
        + "\n".join(offenders)
    )


# Which functions may take the whole TrainConfig: tests/test_layering_sections.py.


FIT_MAX_LINES = 40


def test_trainer_fit_reads_as_the_loop_itself_in_40_lines_or_fewer():
    tree = ast.parse((PACKAGE / "train/trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    fit = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "fit")
    assert fit.end_lineno is not None
    lines = fit.end_lineno - fit.lineno + 1
    assert lines <= FIT_MAX_LINES, (
        f"Trainer.fit is {lines} lines (at most {FIT_MAX_LINES}): what happens around a step belongs in a callback "
        "(olmo/train/callback.py, docs/architecture.md 'The training loop'), not in the loop."
    )


PRIVATE_NAMES_ALLOWED = {
    "_HYBRID_SHARD_ZERO2": "a member of OLMo's ShardingStrategy enum, whose name starts with an underscore in OLMo",
}
"""Underscore names a module may read off objects it does not define, with the reason."""


def _private_accesses(path: Path) -> list[str]:
    """``x._name`` in ``path`` where ``x`` is not ``self``/``cls``, ``_name`` is defined nowhere in the module, and
    ``x`` is not a module of another distribution (``os._exit``, torch's internals are their business)."""
    tree = ast.parse(path.read_text())
    defined, foreign = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Import):
            foreign.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("olmo"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("olmo"):
            foreign.update(a.asname or a.name for a in node.names)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and (root.id in ("self", "cls") or root.id in foreign):
            continue
        if node.attr in defined or node.attr in PRIVATE_NAMES_ALLOWED:
            continue
        out.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_module_reads_another_modules_underscore_attributes():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _private_accesses(path)]
    assert not found, (
        "these read an underscore attribute that their module does not define (another class's private state): "
        "give the owner a public method or property instead, or, for a rewind, ask the loop (ctx.loop.rewind):\n"
        + "\n".join(found)
    )


def test_the_private_access_check_sees_a_trainer_private_used_elsewhere(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\n\ndef roll_back(trainer):\n    os._exit(0)\n    return trainer._batches()\n")
    assert _private_accesses_at(sample) == ["sample.py:5: trainer._batches"]


def _private_accesses_at(path: Path) -> list[str]:
    global REPO
    saved, REPO = REPO, path.parent
    try:
        return _private_accesses(path)
    finally:
        REPO = saved


def test_no_two_library_modules_share_a_file_name():
    by_name: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py" or rel.parts[0] in ("cli", "bench"):  # named after their command
            continue
        # A plural is the same name to a reader (train/checkpointer.py beside checkpoint/checkpointers.py was).
        by_name.setdefault(path.stem.removesuffix("s"), []).append(str(rel))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"modules sharing a file name (rename one after what it holds): {shared}"


def test_the_data_package_imports_torch_only_when_a_name_needs_it():
    """``olmo.data`` names its modules lazily: the data preparation commands start without torch (3 s here), and
    every name of ``__all__`` still resolves, to the object its module defines."""
    import subprocess
    import sys

    probe = (
        "import sys, olmo.cli.prepare_memmap_dataset, olmo.cli.prepare_sft_data, olmo.cli.prepare_rl_prompts, olmo.rl; "
        "assert 'torch' not in sys.modules; "
        "import olmo.data as d; names = [getattr(d, n) for n in d.__all__]; assert 'torch' in sys.modules; "
        "assert set(d.__all__) <= set(dir(d)); print(len(names))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) == len(__import__("olmo.data", fromlist=["__all__"]).__all__)


# Each piece of the loop's state has one owner, which alone assigns it (everyone else calls the owner's methods).
STATE_OWNERS = {
    "global_step": "olmo/train/trainer_state.py",
    "global_train_examples_seen_this_epoch": "olmo/train/trainer_state.py",
    "global_train_tokens_seen": "olmo/train/trainer_state.py",
    "restored_step": "olmo/train/checkpointer.py",
}


def _state_writes(path: Path, source: str | None = None) -> list[str]:
    """``file:line: target`` for each assignment to one of :data:`STATE_OWNERS`' attributes outside its owner, and
    each ``getattr(..., "spike_detector")`` (a part of the TrainModule interface, read as such); ``source``: check
    this text as if it were ``path``'s."""
    out = []
    relative = path.relative_to(REPO).as_posix()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and STATE_OWNERS.get(target.attr, relative) != relative:
                out.append(f"{relative}:{node.lineno}: {ast.unparse(target)}")
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) >= 2:
            if isinstance(node.args[1], ast.Constant) and node.args[1].value == "spike_detector":
                out.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_loop_state_is_changed_only_by_its_owner():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _state_writes(path)]
    assert not found, (
        "these change the training loop's state from outside its owner (TrainerState's methods for the position, "
        "Checkpointer.mark_restored for the restored step; TrainModule.spike_detector is part of the interface):\n"
        + "\n".join(found)
    )
    feed = PACKAGE / "train" / "data_feed.py"
    sample = "s.global_step += 1\ns.epoch, s.global_train_examples_seen_this_epoch = 1, 0\nd = getattr(m, 'spike_detector')\n"
    assert [hit.split(": ", 1)[1] for hit in _state_writes(feed, sample)] == [
        "s.global_step",
        "s.global_train_examples_seen_this_epoch",
        "getattr(m, 'spike_detector')",
    ]
