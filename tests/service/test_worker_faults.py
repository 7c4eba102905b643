"""Workers that hang or die, against real processes on 127.0.0.1: a stopped worker (SIGSTOP) is found by the
supervisor's probes, killed and restarted, and no client call waits for it past the bound; a replica whose other
worker can serve stays ready while one is killed again and again (restarts back off), and its /metrics keeps its
size and its totals; SIGHUP drains like SIGTERM, and the supervisor's runtime directory is removed on the way out,
or by the next supervisor when one was killed. And the parts: the protocol's round trips, the leftover rule."""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2

from indexer_service.client import IndexerClient
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.service.config import load_config
from indexer_service.service.process.supervisor import RuntimeDir, remove_leftovers
from indexer_service.service.process.workerproto import Handoff, config_from_json, config_to_json
from testkit.harness import ServiceProcess, clean_env, http_get, wait_for
from tests.service.conftest import StartServer, scrape
from tests.service.test_workers import health_port_status

pytestmark = pytest.mark.slow

FAST = ("--workers", "2", "--backend", "numpy", "--warmup-target", "none")
INPUTS = ChunkInputs(np.array([0, 4, 10]), np.array([8, 20]), 4, 0, 2)
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A TMPDIR of its own for the supervisor's runtime directory: short (its probe sockets' paths must fit a
    unix socket's), and apart from other tests' supervisors."""
    path = Path(tempfile.mkdtemp(prefix="h2-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def worker_pid(server: ServiceProcess, slot: int) -> int:
    """The pid of the process now in ``slot``, from the supervisor's log."""
    found = re.findall(rf"worker (?:started|restarted) worker={slot} pid=(\d+)", server.log())
    assert found, server.log()
    return int(found[-1])


def wait_worker_ready(server: ServiceProcess, slot: int, pid: int, timeout: float = 30) -> None:
    wait_for(lambda: f"worker ready worker={slot} pid={pid}" in server.log(), timeout, f"worker {slot} pid {pid} ready")


def runtime_of(server: ServiceProcess) -> Path:
    return Path(re.search(r"runtime=(\S+)", server.log()).group(1))


class ReplicaWatch:
    """Samples the health port and /readyz on a thread until stopped: how many samples, how many answered not
    serving, and how many /readyz requests got no answer at all (``unanswered``): the HTTP ports are the workers'
    (each accepts on the inherited socket), so a request a worker had accepted when it was killed dies with it,
    as any of its connections does; the health port is the supervisor's."""

    def __init__(self, server: ServiceProcess) -> None:
        self.server = server
        self.samples = self.not_serving = 0
        self.bad: list[str] = []
        self.unanswered: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            health = health_port_status(self.server)
            try:
                status, body = http_get(f"{self.server.http_url}/readyz")
            except OSError as exc:  # a connection reset or closed unanswered, a timeout: not a verdict
                self.unanswered.append(repr(exc))
                continue
            self.samples += 1
            if health != SERVING or status != 200:
                self.not_serving += 1
                self.bad.append(f"health={health} readyz={status} {body.strip()}")

    def __enter__(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_a_stopped_worker_is_killed_within_the_bound_and_no_call_waits_for_it(
    start_server: StartServer,
) -> None:
    """SIGSTOP of one of 2 workers under client traffic with 30 s deadlines: the supervisor kills it once it has
    not answered for worker_hang_seconds (2 s here), logs and counts it as hung, restarts it; no call takes longer
    than the bound plus a margin for this shared machine, every call succeeds (the client retries what the kill
    cut); the replica stays ready and serving throughout."""
    hang = 2.0
    server = start_server(*FAST, "--worker-hang-seconds", str(hang))
    victim_slot = 1
    victim = worker_pid(server, victim_slot)
    durations: list[float] = []
    failures: list[BaseException] = []
    stop = threading.Event()
    with IndexerClient(server.address, connections=16) as client:

        def load() -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    client.build_chunk(INPUTS, timeout=30)
                except grpc.RpcError as exc:
                    failures.append(exc)
                durations.append(time.monotonic() - started)

        threads = [threading.Thread(target=load) for _ in range(4)]
        with ReplicaWatch(server) as watch:
            for thread in threads:
                thread.start()
            wait_for(lambda: len(durations) >= 100, 20, "calls before SIGSTOP")
            stopped_at = time.monotonic()
            os.kill(victim, signal.SIGSTOP)
            wait_for(lambda: "worker hung worker=1" in server.log(), hang + 10, "the hung worker killed")
            found_after = time.monotonic() - stopped_at
            replacement = wait_for(
                lambda: worker_pid(server, victim_slot) != victim and worker_pid(server, 1), 20, "restart"
            )
            wait_worker_ready(server, victim_slot, replacement)
            calls_then = len(durations)
            wait_for(lambda: len(durations) >= calls_then + 100, 20, "calls after the restart")
            stop.set()
            for thread in threads:
                thread.join(40)
    assert not failures, failures[0]
    # A call on the stopped worker waits until it is killed (hang + a probe interval + a supervisor step), then
    # is retried on a worker that answers; a call never waits its 30 s deadline out.
    assert max(durations) < hang + 3.0, sorted(durations)[-5:]
    # Silent since its last answer, up to a probe interval (hang / 4) and a supervisor step (0.2 s) before the stop.
    assert hang - hang / 4 - 0.25 <= found_after < hang + 5.0, found_after
    assert watch.not_serving == 0 and watch.samples > 20, watch.bad[:5]
    assert len(watch.unanswered) <= 1, watch.unanswered  # a request the stopped worker had accepted, at most
    log = server.log()
    assert re.search(rf"worker hung worker=1 pid={victim} silent_seconds=[\d.]+ worker_hang_seconds=2: killed", log)
    assert re.search(rf"worker exited worker=1 pid={victim} code=-9 killed by SIGKILL reason=hung", log), log
    assert f"worker restarted worker=1 pid={replacement} reason=hung restarts=1" in log
    metrics = scrape(server)
    assert metrics.value("indexer_worker_restarts_total", worker="1", reason="hung") == 1
    assert metrics.value("indexer_worker_restarts_total", worker="1", reason="killed") == 0
    assert metrics.value("indexer_worker_restarts_total", worker="0", reason="hung") == 0
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE


def test_a_crash_looping_worker_leaves_the_replica_ready_backs_off_and_metrics_keep_their_size(
    start_server: StartServer,
) -> None:
    """Worker 1 killed 6 times, each time once it is back: the replica (health port, /readyz, indexer_ready) stays
    ready all along (worker 0 serves, min_ready_workers 1); the restarts back off 0.1, 0.2, 0.4, 0.8, 0.8, 0.8 s
    (the backoff settings, shortened from 0.5 s doubling to 10 s to keep the test short); after
    every kill /metrics has the same series as after the first and the metrics directory the same files, and the
    request count is every call made, the dead workers' included."""
    server = start_server(
        *FAST, "--worker-restart-backoff-seconds", "0.1", "--worker-restart-backoff-max-seconds", "0.8"
    )
    metrics_dir = runtime_of(server) / "metrics"
    made = 0
    shapes: list[tuple[frozenset, tuple[str, ...]]] = []
    counts: list[float] = []
    with ReplicaWatch(server) as watch, IndexerClient(server.address, connections=16) as client:
        for _ in range(6):
            for _ in range(20):
                client.build_chunk(INPUTS, timeout=10)
            made += 20
            victim = worker_pid(server, 1)
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda v=victim: worker_pid(server, 1) != v, 30, "the restart")
            wait_worker_ready(server, 1, worker_pid(server, 1))
            # The dead worker's files are retired on the supervisor's next step.
            wait_for(lambda v=victim: not list(metrics_dir.glob(f"*_{v}.db")), 10, "the dead worker's files retired")
            text = http_get(f"{server.http_url}/metrics")[1]
            series = frozenset(re.findall(r"^(\w+(?:\{[^}]*\})?) ", text, re.M))
            shapes.append(
                (
                    frozenset(s for s in series if "indexer_worker_restarts_total" not in s),
                    tuple(sorted(re.sub(r"_\d+\.db$", "_PID.db", p.name) for p in metrics_dir.glob("*.db"))),
                )
            )
            m = scrape(server)
            counts.append(
                sum(s.value for s in m.samples("indexer_request_duration_seconds_count", method="BuildChunk"))
            )
            assert m.value("indexer_ready") == 1
    assert watch.not_serving == 0 and watch.samples > 20, watch.bad[:5]
    assert len(watch.unanswered) <= 6, watch.unanswered  # at most a request each killed worker had accepted
    assert all(shape == shapes[0] for shape in shapes), [set(s[0]) ^ set(shapes[0][0]) for s in shapes]
    assert counts == [20.0 * n for n in range(1, 7)], counts  # every call counted, none lost with its worker
    backoffs = [float(b) for b in re.findall(r"worker exited worker=1 .* restart_in_seconds=([\d.]+)", server.log())]
    assert backoffs == [0.1, 0.2, 0.4, 0.8, 0.8, 0.8], backoffs
    assert scrape(server).value("indexer_worker_restarts_total", worker="1", reason="killed") == 6


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sighup_drains_like_sigterm_and_leaves_no_runtime_directory(
    start_server: StartServer, short_tmpdir: Path, workers: str
) -> None:
    server = start_server(
        "--workers", workers, "--backend", "numpy", "--warmup-target", "none", env=clean_env(TMPDIR=str(short_tmpdir))
    )
    children = psutil.Process(server.pid).children()
    server.process.send_signal(signal.SIGHUP)
    assert server.process.wait(30) == 0, server.log()
    log = server.log()
    assert "shutdown signal=SIGHUP" in log and "stopped drain_seconds=" in log, log
    assert len(children) == (2 if workers == "2" else 0)
    assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)
    if workers == "2":
        assert len(re.findall(r"shutdown signal=SIGTERM worker=\d$", log, re.M)) == 2, log
    assert list(short_tmpdir.iterdir()) == []


def test_a_new_supervisor_removes_the_runtime_directory_of_a_killed_one(
    start_server: StartServer, short_tmpdir: Path
) -> None:
    """A supervisor killed by SIGKILL cannot remove its runtime directory (its workers die with it); the next one
    started with the same TMPDIR removes it at start, and says so. A directory without a lock (another program's,
    or an older version's) is left."""
    env = clean_env(TMPDIR=str(short_tmpdir))
    first = start_server(*FAST, env=env)
    left = runtime_of(first)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(10)
    assert left.is_dir()
    unlocked = short_tmpdir / "indexer-workers-unlocked"
    unlocked.mkdir()
    second = start_server(*FAST, env=env)
    assert f"removed the runtime directory of a supervisor that is gone path={left}" in second.log()
    assert not left.exists() and unlocked.is_dir() and runtime_of(second).is_dir()


# --- the parts ------------------------------------------------------------------------------------------------


def test_a_live_supervisors_runtime_directory_is_never_a_leftover(short_tmpdir: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmpdir))
    live = RuntimeDir()
    try:
        assert remove_leftovers(short_tmpdir) == [] and live.path.is_dir()
    finally:
        live.remove()
    assert not live.path.exists()


def test_the_config_and_the_handoff_survive_their_json_round_trip() -> None:
    config = replace(load_config(env={}), compress_ratios=(0, 4, 128), grpc_port=1234, worker_hang_seconds=2.5)
    assert config_from_json(config_to_json(config)) == config
    handoff = Handoff("/tmp/x", 1, 5, {"http": 3}, 42, -1)
    assert Handoff.from_argv(handoff.command()[-1:]) == handoff


def test_a_runtime_directory_too_long_for_the_probe_sockets_is_refused_and_removed(
    short_tmpdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = short_tmpdir / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(OSError, match="too long for a unix socket: set a shorter TMPDIR"):
        RuntimeDir()
    assert list(deep.iterdir()) == []
