"""The package's import graph has no circle.

Every ``import`` of an hpcckpt module counts, at module level or inside a function (a
lazy import that works around a circle is still a circle in the design); only imports
under ``if TYPE_CHECKING:`` are left out, since they never run. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg`` itself.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hpcckpt"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _compiled() -> set[str]:
    """Compiled submodules (hpcckpt._native): leaves of the graph, never their package."""
    return {_module_name(p.with_name(p.name.split(".")[0] + ".py")) for p in PACKAGE.rglob("*.pyi")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    walk(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(tree)
    return found


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    leaves = _compiled()
    for module, path in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _base(module, path, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules.keys() | leaves else base
                           for a in node.names]
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_planted_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_hpcckpt_has_no_import_circle() -> None:
    circles = _circles(_edges(_modules()))
    assert not circles, "import circles in hpcckpt (move what both sides need into a module " \
        "below them):\n" + "\n".join(" <-> ".join(c) for c in circles)


# What each layer may import (docs/ARCHITECTURE.md, "Who may import whom"): the Slurm
# adapter only reads the environment and runs verbs; the store owns bytes and knows nothing
# of how or when they are written; engines know nothing of the job's lifecycle.
FORBIDDEN = {
    "cluster": {"api", "lifecycle", "ledger", "store", "engines", "criu", "jit", "cli"},
    "store": {"api", "engines", "lifecycle", "ledger", "cluster", "criu", "jit", "cli", "policy"},
    "engines": {"api", "lifecycle", "ledger", "cluster", "criu", "jit", "cli"},
    "lifecycle": {"api", "engines", "store", "criu", "jit", "cli", "own", "app"},
    # The modes share the lifecycle, not each other.
    "own": {"api", "engines", "criu", "jit", "cli", "app"},
    "app": {"api", "engines", "criu", "jit", "cli", "own"},
    "criu": {"api", "engines", "jit", "cli", "own", "app"},
    "jit": {"criu", "cli", "own", "app"},
    "levels": {"api", "engines", "lifecycle", "ledger", "cluster", "criu", "jit", "cli"},
    # The Checkpointer's parts serve the facade (api.py) and know no mode or supervisor.
    "checkpointer": {"api", "criu", "own", "jit", "cli"},
    # Data positions know nothing of checkpoints, the lifecycle or the modes.
    "data": {"api", "checkpointer", "engines", "lifecycle", "store", "cluster", "criu", "own", "jit", "cli"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_layers_import_only_what_is_below_them() -> None:
    bad = sorted(f"{a} imports {b}" for a, targets in _edges(_modules()).items() for b in targets
                 if _layer(b) in FORBIDDEN.get(_layer(a), set()))
    assert not bad, "imports across layers that docs/ARCHITECTURE.md forbids:\n" + "\n".join(bad)
