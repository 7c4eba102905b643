"""Product code says why, in the present, not what happened: no issue reference, no citation of the benchmark
notebook and no measured figure in service/, kernels/, protos/ or the Python client (a figure behind a choice is
listed once in docs/performance.md, or in the document that owns its topic, which the code points at); and the
formatter's output is the repository's, with at most a few hand-kept tables."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.paths import PRODUCT_FOLDERS, REPO

PRODUCT_SUFFIXES = {".py", ".pyi", ".c", ".h", ".proto", ".toml"}
# "issue 20", "issues 10 and 12", "Issue #7": a tracker's number, which means nothing to a reader of the code.
ISSUE_REFERENCE = re.compile(r"\bissues?\s*#?\d", re.IGNORECASE)
# The benchmark notebook and its history, by file name: what the code rests on is in docs/performance.md.
NOTEBOOK_CITATION = re.compile(r"\b(?:RESULTS|history)\.md\b", re.IGNORECASE)
# A measured figure: an amount (a number with a unit of size, time or share) given as a measurement, not as a limit
# or a default, which are the contract ("16 KiB default", "at most 32 MiB", "every 0.2 s"): an estimate of one
# ("about 18 KiB", "~10 KiB"); a run beside it ("reproduced: SIGTERM 0.3 s", "tracemalloc over an 8 MB answer");
# what a count of things cost ("8,192 chunks: 1.2 s"); what it was ("(before 57 %)"); or a ratio told as an outcome
# ("4x its size", "1.3x faster"). A figure may break over two comment lines, so each line is read with the next.
_AMOUNT = r"[+-]?\d[\d,]*(?:\.\d+)?\s?(?:[KMG]i?B|bytes|[uµnm]?s|(?:milli|micro)?seconds|%)(?![\w])"
MEASURED_FIGURE = re.compile(
    rf"(?:\babout|\baround|\broughly|~)\s*{_AMOUNT}"
    rf"|\b(?:measured|reproduced|took|timed|profiled|benchmarked|tracemalloc|perf stat|py-spy)\b[^.;]{{0,60}}?{_AMOUNT}"
    rf"|{_AMOUNT}[^.;]{{0,60}}?\b(?:measured|reproduced)\b"
    rf"|\b\d[\d,]* [a-z][\w-]*(?: [a-z][\w-]*)?: {_AMOUNT}"
    rf"|(?:\(before:?|\bbefore:|\bwas|\bwere|\bused to|\bpreviously|\bformerly)\s+{_AMOUNT}"
    r"|\b\d[\d,]*(?:\.\d+)?x (?:faster|slower|cheaper|costlier|as fast|as slow|its|the)\b",
    re.IGNORECASE,
)
# What a comment line starts with, left out where a line is read with the next.
_COMMENT_MARK = re.compile(r"^\s*(?:#|//|/?\*+/?)?\s*")
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


def figure_lines(text: str) -> list[int]:
    """The numbers of the lines where a measured figure starts, each line read with the next one (its comment mark
    left out), so that a figure broken over two lines is found, on the line where it starts."""
    lines = [_COMMENT_MARK.sub("", line) for line in text.splitlines()]
    found = []
    for number, line in enumerate(lines, 1):
        following = lines[number] if number < len(lines) else ""
        match = MEASURED_FIGURE.search(f"{line} {following}")
        if match and match.start() < len(line):
            found.append(number)
    return found


def measured_figures(paths: Iterator[Path]) -> list[str]:
    found = []
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()
        found += [f"{path.relative_to(REPO)}:{n}: {lines[n - 1].strip()}" for n in figure_lines("\n".join(lines))]
    return found


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


@pytest.mark.parametrize(
    ("text", "found"),
    [
        # as product code held them
        ("an idle connection costs about 18 KiB of RSS", True),
        ("far below what would cost memory that matters (each ~10 KiB: 20 MiB at the total)", True),
        ("(reproduced: SIGTERM 0.3 s into a cold-cache warmup)", True),
        ("the text and its bytes; tracemalloc over an 8 MB answer", True),
        ("would otherwise buy seconds of CPU (8,192 chunks: 1.2 s)", True),
        ("the protobuf answer and 4x its size more", True),
        ("2,000 of them: 37.7 MiB with grpcio's HealthServicer", True),
        ("victim 864 of 864 (before 57 %)", True),
        ("the gate measured 204.8 us a call", True),
        ("# a figure broken over two comment lines: about\n# 18 KiB each", True),
        ("/* or two lines of a C comment's: it took\n * 0.3 s */", True),
        ("the pool is 1.3x faster", True),
        # the contract, and prose with numbers that is not a measurement
        ("bounded per connection (16 KiB default)", False),
        ("serve blocks up to that size (at most 32 MiB) from the heap", False),
        ("every 0.2 s, every 0.05 s while the last check cut connections", False),
        ("so the answer grows about 4x per step", False),
        ("a 1 us budget arrives as up to a millisecond", False),
        ("the smallest measured size from which Triton was faster", False),
        ("(64 KiB + 32 bytes a sequence)", False),
        ("a call cut before 10 s have passed is counted", False),
        ("one page fault and a zero-fill per 4 KiB on the next call", False),
        ("Request latency spans from a tiny batch (the first bucket, 100 us) to seconds", False),
    ],
)
def test_a_measured_figure_is_told_from_a_limit(text: str, found: bool) -> None:
    assert figure_lines(text) == ([1] if found else [])


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


def test_product_code_gives_no_measured_figure() -> None:
    found = measured_figures(product_files())
    assert not found, (
        "measured figures in product code's comments and docstrings (put the figure in the document that owns the "
        "topic, docs/performance.md for a choice it rests on, and point there):\n" + "\n".join(found)
    )


def test_few_formatter_escapes() -> None:
    found = findings(FORMATTER_ESCAPE, python_sources())
    assert len(found) <= MAX_FORMATTER_ESCAPES, "more formatter escapes than a few tables need:\n" + "\n".join(found)
