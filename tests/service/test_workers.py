"""Worker processes (``workers`` above 1, service/process/supervisor.py) against real processes on 127.0.0.1: two
workers share the gRPC port and both serve the client's calls; /metrics adds up over them; a worker killed with SIGKILL
is logged, counted, takes the replica out of readiness (min_ready_workers 2) and comes back (hangs, crash loops, SIGHUP,
leftovers: test_worker_faults.py); SIGTERM drains every worker and exits 0 with none left; the port is guarded; the
warmup compiles once; workers = 1 stays one process. And the parts: the CPU count from cgroup files, the client's choice
of connection."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.client import ChannelPool, IndexerClient
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.process import cgroups, supervisor
from indexer_service.service.process.workerproto import Handoff
from testkit.harness import INDEXER_SERVICE, LOOPBACK, ServiceProcess, clean_env, http_get, listen_flags, wait_for
from tests.service.conftest import StartServer, scrape

pytestmark = pytest.mark.slow

FAST = ("--workers", "2", "--backend", "numpy", "--warmup-target", "none")
INPUTS = ChunkInputs(np.array([0, 4, 10]), np.array([8, 20]), 4, 0, 2)


def workers_of(server: ServiceProcess) -> list[psutil.Process]:
    return psutil.Process(server.process.pid).children()


def health_port_status(server: ServiceProcess) -> int:
    with grpc.insecure_channel(f"{LOOPBACK}:{server.ports['health_port']}") as channel:
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def calls_in_parallel(address: str, threads: int = 4, calls: int = 40) -> int:
    errors: list[BaseException] = []
    # The kernel spreads connections over the workers by a hash: 16 leave one of 2 workers without any 1 time
    # in 32,768 (8, the client's default, 1 in 128).
    with IndexerClient(address, connections=16) as client:

        def run() -> None:
            try:
                for _ in range(calls):
                    assert client.build_chunk(INPUTS, timeout=10).cu_seq_lens.tolist() == [0, 2, 7]
            except BaseException as exc:
                errors.append(exc)

        pool = [threading.Thread(target=run) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(60)
    assert not errors, errors[0]
    return threads * calls


def test_two_workers_share_the_port_both_serve_and_metrics_add_up(start_server: StartServer) -> None:
    server = start_server(*FAST, "--log-level", "DEBUG")
    workers = workers_of(server)
    assert len(workers) == 2 and health_port_status(server) == health_pb2.HealthCheckResponse.SERVING
    made = calls_in_parallel(server.address)

    # Both workers answered: each logs its calls (DEBUG) with its slot.
    log = server.log()
    per_worker = [len(re.findall(rf"rpc method=BuildChunk code=OK .* worker={n}$", log, re.M)) for n in (0, 1)]
    assert sum(per_worker) == made and min(per_worker) > 0, per_worker
    # One /metrics for the replica, whichever worker answers it: counters and histograms add up over both.
    for _ in range(4):  # several scrapes, new connections: any worker may take them
        metrics = scrape(server)
        assert metrics.value("indexer_request_errors_total", method="BuildChunk", code="OK") is None
        count = sum(s.value for s in metrics.samples("indexer_request_duration_seconds_count", method="BuildChunk"))
        assert count == made
        assert metrics.value("indexer_worker_up", worker="0") == metrics.value("indexer_worker_up", worker="1") == 1
        assert metrics.value("indexer_worker_ready", worker="0") == 1 == metrics.value("indexer_ready")
        assert metrics.value("indexer_requests_in_flight", method="BuildChunk") == 0

    # The port is this replica's: another server asked for it is refused.
    other = subprocess.run(
        [
            INDEXER_SERVICE,
            "serve",
            *FAST,
            *listen_flags(grpc_port=server.grpc_port),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert other.returncode == 1 and f"cannot bind gRPC to {LOOPBACK}:{server.grpc_port}" in other.stderr


def test_a_killed_worker_is_logged_counted_unready_then_back(start_server: StartServer) -> None:
    """With ``min_ready_workers`` 2 of 2, a killed worker takes the replica out of readiness until it is back (with
    the default, 1, the replica stays ready: tests/service/test_worker_faults.py)."""
    server = start_server(*FAST, "--min-ready-workers", "2")
    victim = workers_of(server)[1]
    slot = "1" if f"worker started worker=1 pid={victim.pid}" in server.log() else "0"
    victim.send_signal(signal.SIGKILL)
    # Out of readiness at once (health port, /readyz), with the reason; then back, with a new process.
    wait_for(lambda: http_get(f"{server.http_url}/readyz")[0] == 503, 5, "/readyz 503")
    status, reason = http_get(f"{server.http_url}/readyz")
    assert status == 503 and f"worker {slot}" in reason, reason
    assert health_port_status(server) == health_pb2.HealthCheckResponse.NOT_SERVING
    wait_for(lambda: http_get(f"{server.http_url}/readyz")[0] == 200, 30, "the worker back")
    assert health_port_status(server) == health_pb2.HealthCheckResponse.SERVING
    assert len(workers_of(server)) == 2 and victim.pid not in {w.pid for w in workers_of(server)}
    metrics = scrape(server)
    assert metrics.value("indexer_worker_restarts_total", worker=slot, reason="killed") == 1
    assert metrics.value("indexer_worker_restarts_total", worker=slot, reason="exit") == 0
    assert metrics.value("indexer_worker_restarts_total", worker=str(1 - int(slot)), reason="killed") == 0
    assert metrics.value("indexer_worker_up", worker=slot) == 1 == metrics.value("indexer_ready")
    log = server.log()
    assert re.search(rf"worker exited worker={slot} pid={victim.pid} code=-9 killed by SIGKILL", log), log
    assert f"worker restarted worker={slot}" in log and "reason=killed" in log
    calls_in_parallel(server.address, threads=2, calls=10)


def test_sigterm_drains_every_worker_and_exits_0(start_server: StartServer) -> None:
    server = start_server(*FAST, "--shutdown-grace-seconds", "20")
    workers = workers_of(server)
    runtime = re.search(r"runtime=(\S+)", server.log()).group(1)
    assert Path(runtime).is_dir()
    errors: list[BaseException] = []
    ok = [0]
    stop = threading.Event()
    with IndexerClient(server.address, wait_for_ready=False) as client:

        def load() -> None:
            while not stop.is_set():
                try:
                    client.build_chunk(INPUTS, timeout=10)
                    ok[0] += 1
                except grpc.RpcError as exc:  # refused once draining: UNAVAILABLE, nowhere else to retry
                    if exc.code() is not grpc.StatusCode.UNAVAILABLE:
                        errors.append(exc)
                    time.sleep(0.01)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for thread in threads:
            thread.start()
        wait_for(lambda: ok[0] >= 100, 20, "calls before SIGTERM")
        code = server.terminate(timeout=40)
        stop.set()
        for thread in threads:
            thread.join(20)
    assert code == 0, server.log()
    assert not errors, errors[0]
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    log = server.log()
    assert log.count("service.process.server stopped drain_seconds=") == 2, log
    assert "service.process.supervisor stopped" in log, log
    assert not Path(runtime).exists()


def test_workers_warm_up_one_at_a_time_and_compile_once(start_server: StartServer, tmp_path: Path) -> None:
    """A cold cache: the first worker compiles the 3 keys, the second loads all three from what it wrote."""
    server = start_server(
        "--workers",
        "2",
        "--backend",
        "numpy",
        "--warmup-target",
        "cuda:90",
        env=clean_env(TRITON_CACHE_DIR=str(tmp_path / "cold-cache")),
    )
    sources: dict[int, list[str]] = {0: [], 1: []}  # each key's source as its worker logged it: what Triton did
    for source, worker in re.findall(r"warmup \d/3 key=\S+ seconds=[\d.]+ source=(\w+) .*?worker=(\d)", server.log()):
        sources[int(worker)].append(source)
    assert sorted(sources.values()) == [["cache"] * 3, ["compiler"] * 3], server.log()


@pytest.mark.all_cpus  # it pins a worker to each of two CPUs: never confined to one (tests/tiers.py)
def test_pinned_workers_each_run_every_thread_on_a_cpu_of_their_own(start_server: StartServer) -> None:
    """``pin_workers on`` with two workers: worker n and all its threads (the gRPC pool's, started after the
    pin, included) on the n-th CPU of the replica's set; the start-up log says so."""
    if len(psutil.Process().cpu_affinity()) < 2:
        pytest.skip("needs 2 CPUs")
    server = start_server(*FAST, "--pin-workers", "on")
    calls_in_parallel(server.address)  # the gRPC pool's threads exist now
    cpus = sorted(psutil.Process().cpu_affinity())[:2]
    pinned = {}
    for worker in workers_of(server):
        slot = Handoff.from_argv(worker.cmdline()[-1:]).slot
        assert len(worker.threads()) > 4
        pinned[slot] = set()
        for thread in worker.threads():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended since it was listed
                pinned[slot].add(frozenset(os.sched_getaffinity(thread.id)))
    assert pinned == {0: {frozenset({cpus[0]})}, 1: {frozenset({cpus[1]})}}
    assert f"cpus={cpus[0]},{cpus[1]} (pin_workers on)" in server.log()


def test_workers_are_pinned_only_on_cpus_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` pins where the CPU quota equals the CPU set and there is a worker per CPU; not where the set is
    shared (no quota, a smaller quota) or larger than the workers."""
    monkeypatch.setattr(cgroups.os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    for quota, workers, mode, expected in (
        (4.0, 4, "auto", [4, 5, 6, 7]),
        (3.5, 4, "auto", None),
        (None, 4, "auto", None),
        (2.0, 4, "auto", None),
        (4.0, 2, "auto", None),
        (None, 2, "on", [4, 5]),
        (None, 8, "on", None),
        (4.0, 4, "off", None),
    ):
        monkeypatch.setattr(cgroups, "cpu_quota", lambda q=quota: q)
        assert supervisor.worker_cpus(workers, mode)[0] == expected, (quota, workers, mode)


def test_one_worker_is_the_single_process(start_server: StartServer) -> None:
    server = start_server("--workers", "1", "--backend", "numpy", "--warmup-target", "none")
    assert workers_of(server) == []
    metrics = scrape(server)
    assert metrics.value("indexer_ready") == 1 and not metrics.samples("indexer_worker_up")
    assert "service.process.supervisor" not in server.log()


# --- the parts ------------------------------------------------------------------------------------------------


def test_cpus_from_a_cgroup_v2_quota_and_its_parents(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "pod" / "container").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu\n")
    (root / "pod" / "cpu.max").write_text("300000 100000\n")
    (root / "pod" / "container" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/pod/container\n")
    assert cgroups.cpu_quota(root, proc) == 3.0
    (root / "pod" / "container" / "cpu.max").write_text("150000 100000\n")
    assert cgroups.cpu_quota(root, proc) == 1.5
    (root / "pod" / "cpu.max").write_text("max 100000\n")
    (root / "pod" / "container" / "cpu.max").write_text("max 100000\n")
    assert cgroups.cpu_quota(root, proc) is None


def test_memory_limit_from_cgroup_v2_on_the_path_and_v1(tmp_path: Path) -> None:
    """The smallest ``memory.max`` from this process's cgroup up to the root (v2); v1's file, its huge "no limit"
    being none."""
    root = tmp_path / "cgroup"
    (root / "pod" / "container").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "pod" / "memory.max").write_text("1073741824\n")
    (root / "pod" / "container" / "memory.max").write_text("max\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/pod/container\n")
    assert cgroups.memory_limit(root, proc) == 2**30
    (root / "pod" / "memory.max").write_text("max\n")
    assert cgroups.memory_limit(root, proc) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("536870912\n")
    assert cgroups.memory_limit(v1, proc) == 2**29
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroups.memory_limit(v1, proc) is None


def test_cpus_from_a_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu,cpuacct").mkdir()
    (tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroups.cpu_quota(tmp_path, tmp_path / "none") == 2.5
    (tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroups.cpu_quota(tmp_path, tmp_path / "none") is None


def test_auto_workers_take_the_smaller_of_quota_rounded_up_and_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for quota, expected in ((None, 4), (1.5, 2), (0.2, 1), (8.0, 4), (3.0, 3)):
        monkeypatch.setattr(cgroups, "cpu_quota", lambda q=quota: q)
        assert supervisor.resolve_workers(0)[0] == expected, quota
    assert supervisor.resolve_workers(6) == (6, "setting")


def test_the_client_sends_each_call_on_the_connection_with_fewest_in_flight() -> None:
    pool = ChannelPool(lambda extra: object(), 3)
    assert [pool.acquire() for _ in range(3)] == [0, 1, 2]  # ties in turn
    pool.release(1)
    assert pool.acquire() == 1  # the only one with nothing in flight
    for index in (0, 1, 2):
        pool.release(index)
    assert sorted(pool.acquire() for _ in range(3)) == [0, 1, 2]


def test_the_client_opens_separate_connections(start_server: StartServer) -> None:
    server = start_server("--workers", "1", "--backend", "numpy", "--warmup-target", "none")
    with IndexerClient(server.address, connections=3) as client:
        for _ in range(6):
            client.build_chunk(INPUTS)
        peers = {
            c.laddr
            for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == server.grpc_port and c.status == "ESTABLISHED"
        }
    assert len(peers) == 3, peers


def test_reserving_the_port_refuses_one_in_use() -> None:
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        with pytest.raises(OSError, match="cannot bind gRPC"):
            supervisor.reserve_grpc_port(LOOPBACK, busy.getsockname()[1])
    held, port = supervisor.reserve_grpc_port(LOOPBACK, 0)
    with held, pytest.raises(OSError, match="cannot bind gRPC"):
        supervisor.reserve_grpc_port(LOOPBACK, port)  # a second replica on the same port
