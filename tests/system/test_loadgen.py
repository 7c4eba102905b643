"""bench_workers' Go load generator (benchmarks/loadgen), built with its documented command, against a real
server: every call it counts reached the server and came back OK, and a bad flag is a usage error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.gobuild import go_grpc_missing
from testkit.harness import FAST_START, ServiceProcess, metric_total, scrape
from testkit.paths import REPO
from testkit.payloads import BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK
from tests.tools import needs_tool

pytestmark = needs_tool(go_grpc_missing())
SERVED = "indexer_request_duration_seconds_count"


@pytest.fixture(scope="module")
def loadgen() -> Path:
    # A subprocess, not an import: tests never import the benchmarks (test_layout.py).
    build = subprocess.run(
        [sys.executable, "-m", "benchmarks.loadgen"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return Path(build.stdout.splitlines()[-1])


def test_loadgen_calls_all_reach_the_server(loadgen: Path, tmp_path: Path) -> None:
    request = tmp_path / "small.request"
    request.write_bytes(SMALL_BUILD_CHUNK.SerializeToString())
    with ServiceProcess(*FAST_START) as server:
        before = metric_total(scrape(server.http_url), SERVED, method="BuildChunk")
        flags = f"-address {server.address} -method {BUILD_CHUNK_PATH} -request-file {request}"
        flags += " -in-flight 4 -connections 2 -seconds 1"
        run = subprocess.run([str(loadgen), *flags.split()], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        result = json.loads(run.stdout)
        served = metric_total(scrape(server.http_url), SERVED, method="BuildChunk") - before
    assert result["calls"] > 0
    assert result["errors"] == {}
    assert len(result["per_connection_calls"]) == 2
    assert sum(result["per_connection_calls"]) == result["calls"]
    assert 0 < result["p50_us"] <= result["p99_us"]
    assert 0.9 < result["elapsed"] < 5
    assert served >= result["calls"]  # the warm-up calls (one per connection) are not in calls


def test_loadgen_bad_flag_is_a_usage_error(loadgen: Path) -> None:
    run = subprocess.run([str(loadgen), "-no-such-flag"], capture_output=True, text=True, timeout=10)
    assert run.returncode != 0
    assert "no-such-flag" in run.stderr


def test_loadgen_window_out_of_range_is_a_usage_error(loadgen: Path) -> None:
    """-window is 0 (grpc-go's dynamic windows) or a static window HTTP/2 allows, never below its 65,535 bytes."""
    flags = "-address 127.0.0.1:1 -request-file /dev/null -window 100"
    run = subprocess.run([str(loadgen), *flags.split()], capture_output=True, text=True, timeout=10)
    assert run.returncode == 2
    assert "-window must be 0 or from 65535" in run.stderr


def test_one_connection_per_address_reaches_every_pod(loadgen: Path, tmp_path: Path) -> None:
    """The deployment shape of docs/clients.md: single-process servers (pods of one worker), and a client that
    opens one connection per address with round_robin, as grpc-go, grpc-js and tonic do by default: every server
    gets its share of the calls."""
    request = tmp_path / "small.request"
    request.write_bytes(SMALL_BUILD_CHUNK.SerializeToString())
    with (
        ServiceProcess(*FAST_START, "--workers", "1") as first,
        ServiceProcess(*FAST_START, "--workers", "1") as second,
    ):
        servers = (first, second)
        before = [metric_total(scrape(s.http_url), SERVED, method="BuildChunk") for s in servers]
        addresses = ",".join(s.address for s in servers)
        flags = f"-address {addresses} -method {BUILD_CHUNK_PATH} -request-file {request}"
        flags += " -in-flight 4 -connections 1 -seconds 1"
        run = subprocess.run([str(loadgen), *flags.split()], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        result = json.loads(run.stdout)
        served = [
            metric_total(scrape(s.http_url), SERVED, method="BuildChunk") - b
            for s, b in zip(servers, before, strict=True)
        ]
    assert result["errors"] == {}
    assert result["per_connection_calls"] == [result["calls"]]  # one ClientConn
    by_address = result["per_address_calls"]
    assert set(by_address) == {s.address for s in servers}
    assert sum(by_address.values()) == result["calls"]
    # round_robin: each call on the next address, so the two shares differ by the calls in flight at most
    assert abs(by_address[first.address] - by_address[second.address]) <= 4
    assert all(n >= by_address[s.address] for n, s in zip(served, servers, strict=True))


def test_bench_ablation_cut_servers_answer_the_services_bytes_and_are_measured(loadgen: Path, tmp_path: Path) -> None:
    """benchmarks/bench_ablation.py in one short round: each cut server starts and answers all three batches with the
    service's own bytes (it exits otherwise), and every server gets a figure for every phase."""
    out = tmp_path / "ablation.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_ablation",
            "--batches",
            "small-8",
            "--rounds",
            "1",
            "--seconds",
            "0.2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["batches"]["small-8"]
    assert set(rows) == {"echo", "service", "plane", "compute", "cached", "unbudgeted"}
    for server, row in rows.items():
        assert row["calls"] > 0 and row["p50_us"] > 0, server
        assert all(row[f"calls_per_s_{k}"] > 0 and row[f"server_cpu_us_per_call_{k}"] > 0 for k in (8, 32)), server
    printed = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("small-8 ")]
    assert printed == ["echo", "service", "plane", "compute", "cached", "unbudgeted"]
