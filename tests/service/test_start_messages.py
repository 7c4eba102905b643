"""What a newcomer reads: the first log line says what is starting, before anything heavy is imported; the ready
line names every address; a process that does not need torch never loads it (the supervisor, the numpy backend
without a warmup, ``keys``); ``check`` says which kind of port it reached. Real server processes throughout."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from indexer_service.service.observability.version import build
from testkit.harness import FAST_START, INDEXER_SERVICE, ServiceProcess, clean_env
from tests.service.conftest import StartServer

VERSION = importlib.metadata.version("indexer-service")


def maps_torch(pid: int) -> bool:
    """Whether the process has torch's shared library mapped (it has imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def maps_triton(pid: int) -> bool:
    """Whether the process has Triton's shared library mapped (it has imported Triton)."""
    return "libtriton" in Path(f"/proc/{pid}/maps").read_text()


def addresses(server: ServiceProcess) -> str:
    return (
        f"grpc={server.address} health=127.0.0.1:{server.health_port} http=127.0.0.1:{server.http_port} "
        f"http_rpc=127.0.0.1:{server.http_rpc_port}"
    )


@pytest.mark.parametrize(
    ("workers", "mode", "ready"),
    [
        ("1", "mode=one process", "ready backend=numpy warmup=skipped"),
        ("2", "mode=supervisor of 2 worker", "ready workers=2"),
    ],
    ids=["one-process", "supervisor"],
)
def test_the_first_line_says_what_starts_and_the_ready_line_where_it_listens(
    start_server: StartServer, workers: str, mode: str, ready: str
) -> None:
    server = start_server(*FAST_START, "--workers", workers)
    lines = server.log().splitlines()
    first = lines[0]
    assert " start pid=" in first and f"indexer-service {VERSION} commit={build()['commit']} " in first, lines[:3]
    assert f" {mode}" in first
    assert "backend=numpy warmup_target=none" in first
    assert any(ready in line and line.endswith(addresses(server)) for line in lines), server.log()


def test_the_start_and_the_stop_are_each_said_once_for_both_http_ports(start_server: StartServer) -> None:
    """uvicorn says "Started server process", "Shutting down" and "Finished server process" for each server it runs,
    one per HTTP port: the process's own `listening` and `stopped` lines say it once, naming both ports, and
    uvicorn's are not written."""
    server = start_server(*FAST_START)
    assert server.terminate() == 0
    lines = server.log().splitlines()
    uvicorn = ("Started server process", "Shutting down", "Finished server process")
    assert not [
        line for line in lines if " uvicorn.error " in line and line.split(" uvicorn.error ")[1].startswith(uvicorn)
    ]
    (listening,) = [line for line in lines if " listening " in line]
    assert listening.endswith(f"http=127.0.0.1:{server.http_port} http_rpc=127.0.0.1:{server.http_rpc_port}")
    assert sum(" stopped drain_seconds=" in line for line in lines) == 1, lines


def test_a_numpy_server_without_warmup_never_loads_torch(start_server: StartServer) -> None:
    server = start_server(*FAST_START, "--workers", "2")
    processes = [psutil.Process(server.pid), *psutil.Process(server.pid).children()]
    assert len(processes) == 3
    assert [maps_torch(p.pid) for p in processes] == [False, False, False]


def test_no_process_loads_torch_when_the_workers_compile_ahead_of_time(start_server: StartServer) -> None:
    """The supervisor never imports Triton or torch; its workers' ahead-of-time warmup (no GPU) compiles and proves
    with Triton and never imports torch either (the start's largest cost, which nothing there needs)."""
    server = start_server("--workers", "2", "--backend", "numpy")  # as `make serve` on a CPU host, on any host
    children = psutil.Process(server.pid).children()
    assert not maps_torch(server.pid) and not maps_triton(server.pid)
    # The control: each worker's warmup compiled with Triton.
    assert len(children) == 2 and all(maps_triton(child.pid) for child in children)
    assert not any(maps_torch(child.pid) for child in children)


def test_keys_needs_no_torch() -> None:
    script = (
        "import sys\nfrom indexer_service.service.process.cli import main\nmain(['keys'])\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=clean_env())
    assert out.returncode == 0, out.stderr
    *keys, imported = out.stdout.splitlines()
    assert len(keys) == 3 and imported == "False"


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [INDEXER_SERVICE, "check", *args], capture_output=True, text=True, timeout=60, env=clean_env()
    )


def test_check_says_which_port_it_reached(start_server: StartServer) -> None:
    server = start_server(*FAST_START)
    rpc = check(server.address)
    assert rpc.returncode == 0, rpc.stdout + rpc.stderr
    assert rpc.stdout.splitlines()[0] == (
        f"reached address={server.address} port=rpc: indexer.v1.PrefillMetadata, grpc.health.v1 and reflection"
    )
    health_address = f"127.0.0.1:{server.health_port}"
    health = check(health_address)
    assert health.returncode == 0, health.stdout + health.stderr
    first, second = health.stdout.splitlines()
    assert first.startswith(f"reached address={health_address} port=health-only: it serves grpc.health.v1 alone")
    # The health port's refusal of GetWarmupStatus names the RPC port the server bound.
    assert first.endswith(
        f"the RPCs and the warmup status are on the RPC port (grpc_port: {server.grpc_port} on this server)"
    )
    assert second == "health overall=SERVING indexer.v1.PrefillMetadata=SERVING"
