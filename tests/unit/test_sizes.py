"""The package stays readable in one sitting per piece (issue 54's rules for the tree): the
``Checkpointer`` facade (``api.py``) under 600 lines, no class over 400 lines, no function over
60. A piece that grows past them is split where its concerns part, not allowed here."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hpcckpt"
API_LINES, CLASS_LINES, FUNCTION_LINES = 600, 400, 60


def _oversized(tree: ast.AST, path: Path) -> list[str]:
    found = []
    for node in ast.walk(tree):
        end = getattr(node, "end_lineno", None)
        if end is None:
            continue
        lines = end - node.lineno + 1
        if isinstance(node, ast.ClassDef) and lines > CLASS_LINES:
            found.append(f"class {node.name} ({path}:{node.lineno}): {lines} lines > {CLASS_LINES}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > FUNCTION_LINES:
            found.append(f"function {node.name} ({path}:{node.lineno}): {lines} lines > {FUNCTION_LINES}")
    return found


def test_the_checker_finds_an_oversized_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    assert _oversized(ast.parse(f"def f():\n{body}\n"), Path("planted.py"))
    assert not _oversized(ast.parse("def f():\n    return 1\n"), Path("planted.py"))


def test_no_class_or_function_is_oversized() -> None:
    found = [line for path in sorted(PACKAGE.rglob("*.py"))
             for line in _oversized(ast.parse(path.read_text()), path.relative_to(PACKAGE.parent))]
    assert not found, "\n".join(found)


def test_the_checkpointer_facade_is_short() -> None:
    lines = len((PACKAGE / "api.py").read_text().splitlines())
    assert lines < API_LINES, f"hpcckpt/api.py has {lines} lines (< {API_LINES}): move a concern out of the facade"
