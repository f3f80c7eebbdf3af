"""The size rule of docs/architecture.md stays true: no module under src/vitkit over 500 lines and no function
(or method) over 80. A file or function that grows past it is split by what it does, or its reason is written
down here beside its name."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).parents[1] / "src" / "vitkit"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_over_500_lines() -> None:
    over = {str(p.relative_to(PKG)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not over, f"modules over {MAX_FILE_LINES} lines (split them by what they do): {over}"


def test_no_function_over_80_lines() -> None:
    over = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over[f"{p.relative_to(PKG)}:{node.name}"] = lines
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def test_the_rule_sees_the_package() -> None:
    """The walk finds the package's modules (a wrong path would pass the two tests above vacuously)."""
    names = {str(p.relative_to(PKG)) for p in _modules()}
    assert {"models/vit.py", "cli.py", "serve/app.py"} <= names and len(names) > 100
