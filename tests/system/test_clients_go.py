"""The Go client (clients/go: protoc-gen-go + protoc-gen-go-grpc code, built against Debian's Go libraries)
against a real server on 127.0.0.1: every BuildChunk golden case, a bad request's code and message, and health."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.harness import FAST_START, ServiceProcess
from tests.system.clients_support import GOLDEN_FILE, build_go_client, check_summary, go_missing
from tests.tools import needs_tool

pytestmark = needs_tool(go_missing())


@pytest.fixture(scope="module")
def go_binaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_go_client(tmp_path_factory.mktemp("go"))


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START) as process:
        yield process


def test_go_client_golden_cases_bad_request_and_health(go_binaries: dict[str, Path], server: ServiceProcess) -> None:
    run = subprocess.run(
        [str(go_binaries["check"]), server.address, str(GOLDEN_FILE)], capture_output=True, text=True, timeout=120
    )
    check_summary(run, {"INVALID_ARGUMENT": "InvalidArgument", "NOT_FOUND": "NotFound"})


@pytest.mark.parametrize("args", [(), ("127.0.0.1:1",), ("127.0.0.1:1", "golden.json", "extra")])
def test_go_check_prints_its_usage_on_bad_arguments(go_binaries: dict[str, Path], args: tuple[str, ...]) -> None:
    run = subprocess.run([str(go_binaries["check"]), *args], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout, run.stderr) == (2, "", "usage: check HOST:PORT PATH/TO/golden-cases.json\n")


def test_go_example_of_the_docs(go_binaries: dict[str, Path], server: ServiceProcess) -> None:
    run = subprocess.run([str(go_binaries["example"]), server.address], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[:2] == ["health: SERVING", "cu_seq_lens: [0 2 3]"]
