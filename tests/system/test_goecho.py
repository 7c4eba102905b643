"""bench_rpc's Go echo (benchmarks/goecho), built with its documented command: it answers a canned request with
its canned response bytes, refuses any other request, and serves the load generator's calls without an error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from testkit.gobuild import go_grpc_missing
from testkit.harness import ServiceProcess, channel, clean_env
from testkit.paths import REPO
from testkit.payloads import BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK
from tests.tools import needs_tool

pytestmark = needs_tool(go_grpc_missing())


def built(package: str) -> Path:
    # A subprocess, not an import: tests never import the benchmarks (test_layout.py).
    build = subprocess.run([sys.executable, "-m", package], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    return Path(build.stdout.splitlines()[-1])


def test_go_echo_answers_canned_bytes_only_and_serves_the_load_generator(tmp_path: Path) -> None:
    echo, loadgen = built("benchmarks.goecho"), built("benchmarks.loadgen")
    request = SMALL_BUILD_CHUNK.SerializeToString()
    answer = b"\x0a\x03abc" * 100  # any bytes: the echo never parses them
    (tmp_path / "0.request").write_bytes(request)
    (tmp_path / "0.response").write_bytes(answer)
    with ServiceProcess(command=[str(echo), "-canned", str(tmp_path)], env=clean_env()) as server:
        with channel(server.address) as chan:
            call = chan.unary_unary(BUILD_CHUNK_PATH, request_serializer=None, response_deserializer=None)
            assert call(request, timeout=10) == answer
            with pytest.raises(grpc.RpcError) as refused:
                call(request + b"\x00", timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        flags = f"-address {server.address} -method {BUILD_CHUNK_PATH} -request-file {tmp_path / '0.request'}"
        run = subprocess.run(
            [str(loadgen), *flags.split(), "-in-flight", "4", "-connections", "2", "-seconds", "0.5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout)
    assert result["calls"] > 0 and result["errors"] == {}
