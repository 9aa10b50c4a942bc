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
