"""The refusal and restart reasons are one vocabulary each (service/reasons.py): no call site of the service (every
subpackage) or of the code that reads its metrics (testkit/, benchmarks/, scripts/) writes one as a raw string,
docs/service.md's metrics table lists exactly the enums' members, and a real server's /metrics has every reason's
series before the first refusal (alerts' rate() needs the 0)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path

from indexer_service.service.reasons import HttpRefusal, RestartReason, ShedReason
from indexer_service.service.rpcs import RPCS
from testkit.harness import ServiceProcess
from testkit.paths import REPO
from tests.service.conftest import scrape

VOCABULARIES: dict[str, type[StrEnum]] = {
    "indexer_requests_shed_total": ShedReason,
    "indexer_http_refused_total": HttpRefusal,
    "indexer_worker_restarts_total": RestartReason,
}
# Where reasons are written or read, besides service/reasons.py itself: the service (every subpackage, however deep)
# and the code outside it that reads its metrics and logs (the benchmarks' attack checks, the test kit, scripts).
# Tests are not scanned: their literal words are the independent expectation the enums are held to.
SCANNED_FOLDERS = ("service", "kernels", "protos", "clients", "testkit", "benchmarks", "scripts")
# String constants that equal a reason's word but are no reason (file name, value), each with what it is.
NOT_REASONS = {
    ("cgroups.py", "memory"),  # cgroup v1's memory controller folder (service/process/cgroups.py)
    ("bench_service_warmup.py", "memory"),  # the JSON results' key for the memory figures
}


def scanned_files() -> Iterator[Path]:
    """The hand-written Python of SCANNED_FOLDERS (generated protobuf modules and installed packages aside)."""
    for folder in SCANNED_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).parts
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or {"node_modules", "__pycache__"} & set(parts):
                continue
            if path != REPO / "service" / "reasons.py":
                yield path


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def raw_reasons(source: str) -> list[tuple[int, str]]:
    """(line, word) of every string constant in ``source``, docstrings aside, that is a reason's word."""
    words = {member.value for vocabulary in VOCABULARIES.values() for member in vocabulary}
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in words and id(node) not in docstrings
    ]


def test_no_module_writes_a_reason_as_a_raw_string() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {word!r}"
        for path in scanned_files()
        for line, word in raw_reasons(path.read_text())
        if (path.name, word) not in NOT_REASONS
    ]
    assert not found, "use service/reasons.py's enums: " + ", ".join(found)


def test_the_scan_reads_every_package_of_the_service() -> None:
    """Not vacuous: every folder of service/ holding Python (the root and each subpackage, at any depth) is read,
    and so are the benchmarks' attack checks, which read the refusal counters."""
    scanned = {path.parent for path in scanned_files()}
    folders = {path.parent for path in (REPO / "service").rglob("*.py") if "__pycache__" not in path.parts}
    assert len(folders) >= 5 and folders <= scanned, sorted(map(str, folders - scanned))
    assert REPO / "benchmarks" / "attack.py" in set(scanned_files())


def test_every_allowed_non_reason_is_still_written() -> None:
    """An allow-list entry no scanned file writes any more is dead: remove it."""
    written = {(path.name, word) for path in scanned_files() for _, word in raw_reasons(path.read_text())}
    assert written >= NOT_REASONS, sorted(NOT_REASONS - written)


def test_the_raw_string_check_finds_one() -> None:
    """The check above is worth something only if it sees a raw reason in a call and ignores docstrings."""
    source = '"""Sheds "memory"."""\nplane.shed(method, "heavy_lane", "busy")\nx = "not_a_reason"\n'
    assert raw_reasons(source) == [(2, "heavy_lane")]


def test_docs_metrics_table_lists_every_reason() -> None:
    table = (REPO / "docs" / "service.md").read_text()
    for metric, vocabulary in VOCABULARIES.items():
        (row,) = [line for line in table.splitlines() if line.startswith(f"| `{metric}` |")]
        listed = re.search(r"`reason`: ([a-z_, ]+)", row)
        assert listed, row
        assert [word.strip() for word in listed.group(1).split(",")] == list(vocabulary), metric


def test_every_reason_has_its_series_before_any_refusal(live_server: ServiceProcess) -> None:
    metrics = scrape(live_server)
    for method in RPCS:
        for reason in ShedReason:
            assert metrics.value("indexer_requests_shed_total", method=method, reason=reason) is not None, reason
    for reason in HttpRefusal:
        assert metrics.value("indexer_http_refused_total", reason=reason) is not None, reason
