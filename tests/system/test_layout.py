"""The test tree's own rules (issue 14, item 5): tests and their shared kit never import the benchmarks; what
both need lives in testkit/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from testkit.paths import REPO


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import statement of a file, at any depth (a lazy import counts)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("folder", ["tests", "testkit"])
def test_nothing_imports_benchmarks(folder: str) -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, module in imported_modules(path)
        if module == "benchmarks" or module.startswith("benchmarks.")
    ]
    assert not offenders, "imports of benchmarks (move what is shared into testkit/):\n" + "\n".join(offenders)
