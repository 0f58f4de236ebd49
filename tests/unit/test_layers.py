"""The package's shape: layers and no import cycles. (Size is judged by reading, not by a line
counter: caps on lines produced classes split by ruler and glued by inheritance.)

Layers (a module imports only from its own layer or below, also inside functions):
``api, http < engine < proxy, envs < workflow < trainer < service, launch, view, cli, demo``. Imports under ``if TYPE_CHECKING:`` and in a package's lazy
``__getattr__`` do not count (they never run at import time / are the public facade).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "areal_env"

LAYERS = {
    "api": 0,
    "http": 0,
    "engine": 1,
    "proxy": 2,
    "envs": 2,
    "workflow": 3,
    "trainer": 4,
    "service": 5,
    "launch": 5,
    "view": 5,
    "cli": 5,
    "demo": 5,
    "__init__": 6,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return LAYERS["__init__"]
    return LAYERS[parts[1]]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path) -> set[str]:
    """Package modules ``module`` imports at run time (anywhere in the file)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if (
            isinstance(node, ast.FunctionDef)
            and node.name == "__getattr__"
            and path.name == "__init__.py"
        ):
            return  # the lazy public facade
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("areal_env"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if base.startswith("areal_env"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(m, p) if i in mods and i != m} for m, p in mods.items()}


def test_no_module_imports_a_higher_layer(graph):
    bad = [
        f"{m} (layer {_layer(m)}) imports {i} (layer {_layer(i)})"
        for m, deps in graph.items()
        for i in sorted(deps)
        if _layer(i) > _layer(m)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles(graph):
    """Packages' ``__init__`` modules are skipped as edges' targets: importing ``a.b.c`` runs
    ``a.b``'s ``__init__``, which is not a dependency of the importer's code."""
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    edges = {m: {d for d in deps if d not in packages} for m, deps in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d) :], d])
            elif d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _from_imports(path: Path, module: str) -> list[tuple[str, str]]:
    """``(source module, name)`` of every ``from areal_env... import name`` in ``path``."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if base.startswith("areal_env"):
                out.extend((base, a.name) for a in node.names)
    return out


def test_private_names_stay_in_their_module():
    """A ``_name`` is its module's own: no other module (package, tests, benches, examples)
    imports it; what another module needs gets a public name."""
    repo = ROOT.parent
    files = dict(_modules())
    for folder in ("tests", "bench", "examples", "agents", "client"):
        for path in sorted((repo / folder).rglob("*.py")) if (repo / folder).is_dir() else []:
            files[f"{folder}:{path.relative_to(repo)}"] = path
    crossing = [
        f"{module} imports {name} from {source}"
        for module, path in files.items()
        for source, name in _from_imports(path, module if ":" not in module else "x")
        if name.startswith("_") and not name.startswith("__") and source != module
    ]
    assert not crossing, "\n".join(crossing)


def test_no_module_re_exports_another_modules_names():
    """Names are imported from where they live: no ``__all__`` lists a name its module only
    imported (a facade that keeps an old import path alive). The package's own lazy
    ``areal_env.__all__`` is the public surface, not a re-export."""
    found = []
    for module, path in _modules().items():
        if module == "areal_env":
            continue
        tree = ast.parse(path.read_text())
        exported: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                exported = set(ast.literal_eval(node.value))
        imported = {name for source, name in _from_imports(path, module) if source != module}
        found += [f"{module} re-exports {name}" for name in sorted(exported & imported)]
    assert not found, "\n".join(found)
