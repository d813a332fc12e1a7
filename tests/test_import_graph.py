"""The package's imports point one way: no module imports, even from inside a function, a module
that imports it back, and the engine reaches neither the dev tooling nor the Airflow adapters.

A function-local import only hides a circle from the interpreter; it still ties two modules'
rules together, so every import counts here (module level, function level, ``TYPE_CHECKING``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "airflow_provider_lr"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
ENGINE = f"{PACKAGE}.engine"
# What the engine must never import: the dev tooling and the Airflow adapters.
ENGINE_FORBIDDEN = tuple(f"{PACKAGE}.{name}" for name in ("embedded", "hooks", "operators", "sensors", "triggers"))
# The engine's folders, lowest first (docs/architecture.md says what each owns). A module may import
# its own folder and the folders below it; "" is the engine's top-level modules (its words).
LAYERS = ("", "db", "store", "source", "tables", "sink", "session", "bulk", "site")


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``module`` imports anywhere in its body (``from a import b`` counts as
    ``a.b`` when that is a module, else as ``a``)."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    resolved = set()
    for target in targets:
        while target and target not in known:  # ``import a.b.c`` of a name inside a module: its module
            target = target.rpartition(".")[0]
        if target and target != module:
            resolved.add(target)
    return resolved


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_names(root)
    known = set(modules)
    return {name: imported(name, path, known) for name, path in sorted(modules.items())}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as ``[a, b, ..., a]``, or ``[]`` when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return []


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles until none is left, each found one cut at its closing edge to look for the next."""
    remaining = {module: set(targets) for module, targets in graph.items()}
    cycles = []
    while cycle := find_cycle(remaining):
        cycles.append(cycle)
        remaining[cycle[-2]].discard(cycle[-1])
    return cycles


def test_the_package_has_no_import_circle():
    cycles = find_cycles(import_graph())
    assert cycles == [], "import circles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_engine_imports_neither_the_embedded_tooling_nor_the_airflow_adapters():
    offenders = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module == ENGINE or module.startswith(ENGINE + ".")
        for target in sorted(targets)
        if target.startswith(ENGINE_FORBIDDEN)
    ]
    assert offenders == []


def layer(module: str) -> str | None:
    """The engine folder a module belongs to ("" for the engine's top-level modules), None outside it."""
    if module != ENGINE and not module.startswith(ENGINE + "."):
        return None
    parts = module[len(ENGINE) + 1 :].split(".") if module != ENGINE else []
    return parts[0] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from an engine folder into a folder above it (or into one not in ``LAYERS``)."""
    offenders = []
    for module, targets in sorted(graph.items()):
        here = layer(module)
        if here is None:
            continue
        for target in sorted(targets):
            there = layer(target)
            if there is None or there == here:
                continue
            if here not in LAYERS or there not in LAYERS or LAYERS.index(there) > LAYERS.index(here):
                offenders.append(f"{module} ({here or 'top'}) imports {target} ({there or 'top'})")
    return offenders


def test_the_engine_folders_are_layers():
    """No engine folder imports one above it, so no two folders import each other and each folder
    can be read knowing only the ones below."""
    offenders = upward_imports(import_graph())
    assert offenders == [], (
        "imports against the layer order " + " < ".join(n or "top" for n in LAYERS) + ":\n" + "\n".join(offenders)
    )


def test_every_engine_folder_has_a_place_in_the_layers():
    folders = {p.name for p in (ROOT / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS) - {""}


def test_the_layer_check_sees_two_folders_importing_each_other():
    """The detector itself: of a pair of folders importing each other, the upward import is reported."""
    graph = {f"{ENGINE}.sink.writes": {f"{ENGINE}.tables.sink"}, f"{ENGINE}.tables.snapshot": {f"{ENGINE}.sink.writes"}}
    assert upward_imports(graph) == [f"{ENGINE}.tables.snapshot (tables) imports {ENGINE}.sink.writes (sink)"]


def test_the_graph_sees_function_local_and_relative_imports(tmp_path: Path):
    """The detector itself: a circle closed only by a function-local relative import is found."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from airflow_provider_lr.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from . import a\n    return a\n")
    graph = import_graph(pkg)
    assert graph[f"{PACKAGE}.sub.b"] == {f"{PACKAGE}.sub.a"}
    assert find_cycles(graph) == [[f"{PACKAGE}.sub.a", f"{PACKAGE}.sub.b", f"{PACKAGE}.sub.a"]]
