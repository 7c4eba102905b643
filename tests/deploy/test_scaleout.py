"""Scaling out as deploy/README.md describes it, on one machine: several server processes on 127.0.0.1 behind
the client's round-robin (what a headless Service's DNS gives it in a cluster), retries of UNAVAILABLE, and
readiness keeping calls off a replica that is still warming up."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from indexer_service.client import IndexerClient
from indexer_service.kernels.inputs import ChunkInputs
from tests.deploy.support import QSL, RATIO, SEQ_LENS, Server, server_shutdown_seconds, wait_for

# Warmup has its own tests; these replicas serve at once (INDEXER_WARMUP_TARGET=none) to keep the suite fast.
NO_WARMUP = {"INDEXER_WARMUP_TARGET": "none"}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Iterator[list[Server]]:
    servers: list[Server] = []
    try:
        yield servers
    finally:
        for server in servers:
            server.stop(signal.SIGKILL)


@pytest.fixture
def fleet(replicas: list[Server], tmp_path_factory) -> list[Server]:
    """Three ready replicas. Like a ReplicaSet, it replaces those a previous test took down, so the tests share
    the start-up cost but not each other's state."""
    while len(replicas) < 3:
        replicas.append(Server(tmp_path_factory.mktemp("replica"), "replica", **NO_WARMUP))
    for n, server in enumerate(replicas):
        if server.process.poll() is not None:
            server.stop()
            replicas[n] = Server(tmp_path_factory.mktemp("replica"), "replica", **NO_WARMUP)
    for server in replicas:  # started together above: their start-ups overlap
        server.wait_ready()
    return list(replicas)


class Load:
    """Threads calling BuildChunk through one client until stopped (or 30 s at most), counting outcomes."""

    def __init__(self, client: IndexerClient, threads: int = 4) -> None:
        self.client = client
        self.ok = 0
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 30
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                meta = self.client.build_chunk(ChunkInputs(QSL, SEQ_LENS, RATIO, 0, 2), timeout=10)
                assert meta is not None and meta.cu_seq_lens.tolist() == [0, 2, 7]
                with self._lock:
                    self.ok += 1
            except BaseException as exc:
                with self._lock:
                    self.errors.append(exc)

    def wait_for_calls(self, count: int, timeout: float = 20) -> None:
        start = self.ok
        wait_for(lambda: self.ok - start >= count or self.errors, timeout, f"{count} more calls")

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)


def calls_per_server(servers: list[Server]) -> list[float]:
    return [server.calls() for server in servers]


CALLS = 240


def test_round_robin_spreads_calls_over_every_replica(fleet: list[Server]) -> None:
    inputs = ChunkInputs(QSL, SEQ_LENS, RATIO, 0, 2)
    with IndexerClient([s.address for s in fleet]) as client:

        def every_replica_serves() -> bool:
            # Each connection joins the rotation once its own health watch says SERVING, one after another.
            client.build_chunk(inputs)
            return all(calls > 0 for calls in calls_per_server(fleet))

        wait_for(every_replica_serves, 20, "every replica in the rotation")
        before = calls_per_server(fleet)
        for _ in range(CALLS):
            client.build_chunk(inputs)
        connections = len(client.pool.channels)
    spread = [after - b for after, b in zip(calls_per_server(fleet), before, strict=True)]
    assert sum(spread) == CALLS
    # Round-robin on each of the client's connections, the connections taken in turn: a third each, give or
    # take one call per connection where its rotation started.
    assert min(spread) >= CALLS // 3 - connections, f"calls per replica: {spread}"


def test_client_resolves_a_dns_target(fleet: list[Server]) -> None:
    """The cluster path, resolver included: dns:///NAME:PORT with the same service config. Here the name
    resolves to one loopback address; in a cluster, the headless Service's name to one per ready pod."""
    replica = fleet[0]
    before = replica.calls()
    with IndexerClient(f"dns:///localhost:{replica.grpc_port}") as client:
        for _ in range(10):
            assert client.build_chunk(ChunkInputs(QSL, SEQ_LENS, RATIO, 0, 2)) is not None
    assert replica.calls() - before == 10


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_replica_lost_under_load_fails_no_call(fleet: list[Server], sig: signal.Signals) -> None:
    """SIGKILL: a crashed pod (connections reset mid-call). SIGTERM: a deleted or rolled pod (NOT_SERVING,
    then drain). Either way the client retries UNAVAILABLE elsewhere and the caller sees nothing."""
    victim, survivors = fleet[-1], fleet[:-1]
    with IndexerClient([s.address for s in fleet]) as client:
        load = Load(client)
        try:
            load.wait_for_calls(150)
            # The victim may be a replacement for a replica an earlier test took down, in the client's rotation
            # once its connection's health watch says SERVING: until it has served, losing it proves nothing.
            wait_for(lambda: victim.calls() > 0, 20, "a call served by the victim (else losing it proves nothing)")
            started = time.monotonic()
            victim.process.send_signal(sig)
            if sig is signal.SIGTERM:
                # The pod's budget: it must be gone well inside terminationGracePeriodSeconds.
                victim.process.wait(server_shutdown_seconds({}) + 5)
                assert victim.process.returncode == 0, victim.log()[-2000:]
            else:
                victim.process.wait(5)
            exit_seconds = time.monotonic() - started
            survivors_before = calls_per_server(survivors)
            load.wait_for_calls(300)
        finally:
            load.stop()
    assert not load.errors, f"{len(load.errors)} calls failed, first: {load.errors[0]!r}"
    gained = [after - b for after, b in zip(calls_per_server(survivors), survivors_before, strict=True)]
    assert all(g > 0 for g in gained), f"a survivor stopped serving: {gained}"
    assert exit_seconds < server_shutdown_seconds({}) + 5


def test_readiness_keeps_calls_off_a_warming_replica(fleet: list[Server], tmp_path: Path) -> None:
    """A new replica (as the HPA or a rollout adds one) takes no call until its warmup has finished, then its
    share. The warmup here is a real, cold one (an empty Triton cache)."""
    ready = fleet[0]
    warming = Server(tmp_path, "warming", TRITON_CACHE_DIR=str(tmp_path / "cold-cache"))
    try:
        warming.wait_listening()
        with IndexerClient([ready.address, warming.address]) as client:
            load = Load(client, threads=2)
            try:
                saw_warming = False
                # Polls while warmup runs; bounded by wait_ready below. The counts are read before /readyz: a
                # replica still warming after they were read was warming when they were (it never goes back), so
                # a call it answered was a call that reached it warming; read after, they may hold the first
                # calls of a replica that became ready in between.
                while True:
                    answered, refused = warming.calls(), warming.calls(code="UNAVAILABLE")
                    if warming.http("/readyz")[0] != 503:
                        break
                    saw_warming = True
                    assert answered == 0
                    assert refused == 0, "calls reached a warming replica"
                    time.sleep(0.05)
                    if warming.process.poll() is not None:
                        break
                warming.wait_ready(timeout=120)
                calls_during_warmup = load.ok
                wait_for(lambda: warming.calls() >= 20, 20, "the new replica gets its share")
            finally:
                load.stop()
        assert saw_warming, "warmup was over before the first look: nothing was checked"
        assert calls_during_warmup > 0, "no call was made while the replica warmed up"
        assert not load.errors, f"{len(load.errors)} calls failed, first: {load.errors[0]!r}"
        assert warming.calls(code="UNAVAILABLE") == 0
    finally:
        warming.stop(signal.SIGKILL)
