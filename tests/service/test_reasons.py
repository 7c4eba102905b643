"""The refusal and restart reasons are one vocabulary each (service/reasons.py): no call site of the service
writes one as a raw string, docs/service.md's metrics table lists exactly the enums' members, and a real
server's /metrics has every reason's series before the first refusal (alerts' rate() needs the 0)."""

from __future__ import annotations

import ast
import re
from enum import StrEnum

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
# String constants of the service that equal a reason's word but are no reason (file, value).
NOT_REASONS = {
    ("cgroups.py", "memory"),  # cgroup v1's memory controller folder
}


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


def test_no_service_module_writes_a_reason_as_a_raw_string() -> None:
    found = [
        f"service/{path.name}:{line}: {word!r}"
        for path in sorted((REPO / "service").glob("*.py"))
        if path.name != "reasons.py"
        for line, word in raw_reasons(path.read_text())
        if (path.name, word) not in NOT_REASONS
    ]
    assert not found, "use service/reasons.py's enums: " + ", ".join(found)


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
