"""The Node client (clients/node, @grpc/grpc-js + @grpc/proto-loader) against a real server on 127.0.0.1: every
BuildChunk golden case, a bad request's code and message, the number-array pitfall, and health."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from testkit.harness import FAST_START, ServiceProcess
from tests.system.clients_support import GOLDEN_FILE, NODE_DIR, PROTOS, check_summary, node_missing
from tests.tools import needs_tool

pytestmark = needs_tool(node_missing())


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START) as process:
        yield process


def run_node(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["node", *args], cwd=NODE_DIR, capture_output=True, text=True, timeout=120)


def test_node_client_golden_cases_bad_request_and_health(server: ServiceProcess) -> None:
    run = run_node("check.js", server.address, str(PROTOS / "indexer/v1/indexer.proto"), str(GOLDEN_FILE))
    summary = check_summary(run, {"INVALID_ARGUMENT": "INVALID_ARGUMENT", "NOT_FOUND": "NOT_FOUND"})
    # The documented pitfall holds: a plain number array is cut to one byte per element and refused.
    assert summary["number_array"] is not None
    assert summary["number_array"]["message"].startswith("query_start_loc")


@pytest.mark.parametrize("args", [(), ("127.0.0.1:1",), ("127.0.0.1:1", "a.proto", "golden.json", "extra")])
def test_node_check_prints_its_usage_on_bad_arguments(args: tuple[str, ...]) -> None:
    run = run_node("check.js", *args)
    usage = "usage: node check.js HOST:PORT PATH/TO/indexer.proto PATH/TO/golden-cases.json\n"
    assert (run.returncode, run.stdout, run.stderr) == (2, "", usage)


def test_node_example_of_the_docs(server: ServiceProcess) -> None:
    run = run_node("example.js", server.address)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[:2] == ["health: SERVING", "cu_seq_lens: 0,2,3"]
