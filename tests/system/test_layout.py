"""The test tree's own rules (issue 14, item 5; issue 22 item 6): tests and their shared kit never import the
benchmarks, benchmarks never import the tests; what both need lives in testkit/."""

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


# (folder, a top-level package it must never import): tests and their shared kit never import the benchmarks,
# the benchmarks never import the tests; what both need lives in testkit/.
FORBIDDEN_IMPORTS = [("tests", "benchmarks"), ("testkit", "benchmarks"), ("testkit", "tests"), ("benchmarks", "tests")]


@pytest.mark.parametrize(("folder", "forbidden"), FORBIDDEN_IMPORTS, ids=[f"{a}-{b}" for a, b in FORBIDDEN_IMPORTS])
def test_nothing_imports_across_the_layers(folder: str, forbidden: str) -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, module in imported_modules(path)
        if module == forbidden or module.startswith(f"{forbidden}.")
    ]
    assert not offenders, f"imports of {forbidden} (move what is shared into testkit/):\n" + "\n".join(offenders)
