"""Product code says why, in the present, not what happened: no issue reference and no citation of the benchmark
notebook in service/, kernels/, protos/ or the Python client (a figure behind a choice is listed once in
docs/performance.md, which the code points at); and the formatter's output is the repository's, with at most a few
hand-kept tables."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.paths import REPO

PRODUCT_FOLDERS = ("service", "kernels", "protos", "clients/python/client")
PRODUCT_SUFFIXES = {".py", ".pyi", ".c", ".h", ".proto", ".toml"}
# "issue 20", "issues 10 and 12", "Issue #7": a tracker's number, which means nothing to a reader of the code.
ISSUE_REFERENCE = re.compile(r"\bissues?\s*#?\d", re.IGNORECASE)
# The benchmark notebook and its history, by file name: what the code rests on is in docs/performance.md.
NOTEBOOK_CITATION = re.compile(r"\b(?:RESULTS|history)\.md\b", re.IGNORECASE)
# A formatter escape: ruff's "fmt: skip" and "fmt: off" comments.
FORMATTER_ESCAPE = re.compile(r"#\s*fmt:\s*(?:skip|off)\b")
MAX_FORMATTER_ESCAPES = 10
# Folders of the checkout that are not the project's source: environments, caches, builds, other tools' packages.
NOT_SOURCE = {"node_modules", "build", "__pycache__"}


def product_files() -> Iterator[Path]:
    for folder in PRODUCT_FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and path.suffix in PRODUCT_SUFFIXES:
                yield path


def python_sources() -> Iterator[Path]:
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = sorted(d for d in subfolders if d not in NOT_SOURCE and not d.startswith("."))
        yield from (Path(folder) / name for name in sorted(files) if name.endswith(".py"))


def findings(pattern: re.Pattern[str], paths: Iterator[Path]) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in paths
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("(benchmarks, issue 20)", True),
        ("issue 12: 8 threads took longer", True),
        ("see Issue #7", True),
        ("issues 10 and 12", True),
        ("the tissue 3 cells", False),
        ("the issuer 2 signs", False),
        ("an issue with the peer", False),
        ("CPython gh-106905", False),
    ],
)
def test_an_issue_reference_is_told_from_prose(text: str, found: bool) -> None:
    assert bool(ISSUE_REFERENCE.search(text)) is found


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("(RESULTS.md, run 3)", True),
        ("the notebook, history.md", True),
        ("RESULTS = []", False),
        ("results/cpu-rpc.json", False),
        ("docs/performance.md", False),
    ],
)
def test_a_notebook_citation_is_told_from_code(text: str, found: bool) -> None:
    assert bool(NOTEBOOK_CITATION.search(text)) is found


def test_the_scans_read_the_product_code_and_the_tests() -> None:
    """Not vacuous: the C sources, the proto, the defaults and the Python modules are read, and this file too."""
    read = set(product_files())
    for cited in (
        "service/compute/fastpath.c",
        "protos/indexer/v1/indexer.proto",
        "service/config/default_config.toml",
    ):
        assert REPO / cited in read, cited
    assert REPO / "service" / "dataplane.py" in read
    assert REPO / "clients" / "python" / "client" / "__init__.py" in read
    assert Path(__file__) in set(python_sources())


def test_product_code_cites_no_issue() -> None:
    found = findings(ISSUE_REFERENCE, product_files())
    assert not found, "issue numbers in product code (say why instead):\n" + "\n".join(found)


def test_product_code_cites_no_benchmark_notebook() -> None:
    found = findings(NOTEBOOK_CITATION, product_files())
    assert not found, "the benchmark notebook cited in product code (cite docs/performance.md):\n" + "\n".join(found)


def test_few_formatter_escapes() -> None:
    found = findings(FORMATTER_ESCAPE, python_sources())
    assert len(found) <= MAX_FORMATTER_ESCAPES, "more formatter escapes than a few tables need:\n" + "\n".join(found)
