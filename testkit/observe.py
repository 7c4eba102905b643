"""What the victims of an attack see: probes like kubelet's, a well-behaved caller, and looping heavy callers.

Each runs on its own threads from ``with`` (or :meth:`start`) to :meth:`stop`, paced, and stops by itself at
``max_seconds`` so a test that forgets to stop it still ends.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testkit.harness import OWN_CONNECTION, CallRecord, LoadRun, channel, http_get

PROBE_TIMEOUT_SECONDS = 1.0  # kubelet's default probe timeout, and issue 10's target


class Paced:
    """``threads`` threads, each running ``step(thread_index)`` then sleeping ``interval``, until stopped or
    ``max_seconds`` passed: the observers here and the stream floods of testkit.streams."""

    def __init__(self, name: str, threads: int, interval: float, max_seconds: float) -> None:
        self.name, self.threads, self.interval, self.max_seconds = name, threads, interval, max_seconds
        self.begin = 0.0  # time.perf_counter() at start: records' times count from it
        self.begin_wall = 0.0  # time.time() at start, to line records up with other processes' clocks
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def step(self, thread_index: int) -> None:
        raise NotImplementedError

    def _run(self, thread_index: int) -> None:
        deadline = self.begin + self.max_seconds
        while not self._stop.is_set() and time.perf_counter() < deadline:
            self.step(thread_index)
            self._stop.wait(self.interval)

    def start(self) -> Self:
        self.begin, self.begin_wall = time.perf_counter(), time.time()
        self._threads = [
            threading.Thread(target=self._run, args=(n,), name=f"{self.name}-{n}", daemon=True)
            for n in range(self.threads)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60.0)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --- probes -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeRecord:
    target: str
    start: float  # seconds since the probes started
    seconds: float
    ok: bool  # answered 200 / SERVING (slower than the timeout counts as a miss too)


# How many of a target's misses a summary dates: enough to tell one stall of the host from a flood's opening.
MISSES_DATED = 20


@dataclass
class ProbeSummary:
    target: str
    probes: int
    in_time: int  # ok within the timeout
    worst_seconds: float
    # when the first MISSES_DATED probes that failed or came late started, in seconds since the probes started: misses
    # of every target at one moment are a stall of the host (or of the server), not a refusal of one port
    missed_at: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        return self.in_time / self.probes if self.probes else float("nan")


def grpc_health_check(
    address: str, timeout: float = PROBE_TIMEOUT_SECONDS, credentials: grpc.ChannelCredentials | None = None
) -> bool:
    """One grpc.health.v1 Check over a fresh connection, as kubelet's gRPC probe makes it (or, with
    ``credentials``, a TLS client): SERVING in time?"""
    options = [OWN_CONNECTION]
    with (
        grpc.secure_channel(address, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(address, options=options)
    ) as probe_channel:
        stub = health_pb2_grpc.HealthStub(probe_channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def http_probe(url: str, timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """One GET over a fresh connection: 200 in time?"""
    try:
        return http_get(url, timeout=timeout)[0] == 200
    except OSError:  # timed out, refused or reset
        return False


class Probes(Paced):
    """Every ``interval`` seconds each target is probed, one thread per target so a stuck probe delays no
    other: gRPC health on the main port (over TLS with ``grpc_credentials``), on the health port (when the server
    has one), /livez and /readyz."""

    def __init__(
        self,
        grpc_address: str,
        http_url: str,
        health_address: str | None = None,
        interval: float = 0.1,
        max_seconds: float = 600.0,
        grpc_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.targets: dict[str, Callable[[], bool]] = {
            "grpc-health": lambda: grpc_health_check(grpc_address, credentials=grpc_credentials),
            "livez": lambda: http_probe(f"{http_url}/livez"),
            "readyz": lambda: http_probe(f"{http_url}/readyz"),
        }
        if health_address is not None:
            self.targets["grpc-health-port"] = lambda: grpc_health_check(health_address)
        self._names = list(self.targets)
        super().__init__("probe", len(self._names), interval, max_seconds)
        self.records: list[ProbeRecord] = []
        self._lock = threading.Lock()

    def step(self, thread_index: int) -> None:
        name = self._names[thread_index]
        started = time.perf_counter()
        ok = self.targets[name]()
        seconds = time.perf_counter() - started
        in_time = ok and seconds <= PROBE_TIMEOUT_SECONDS
        with self._lock:
            self.records.append(ProbeRecord(name, started - self.begin, seconds, in_time))

    def summaries(self) -> dict[str, ProbeSummary]:
        with self._lock:
            records = list(self.records)
        by_target: dict[str, list[ProbeRecord]] = {name: [] for name in self._names}
        for record in records:
            by_target[record.target].append(record)
        return {
            name: ProbeSummary(
                name,
                len(mine),
                sum(r.ok for r in mine),
                max((r.seconds for r in mine), default=0.0),
                tuple(sorted(r.start for r in mine if not r.ok)[:MISSES_DATED]),
            )
            for name, mine in by_target.items()
        }

    def overall(self) -> ProbeSummary:
        """Every probe of every target together."""
        parts = self.summaries().values()
        return ProbeSummary(
            "all",
            sum(p.probes for p in parts),
            sum(p.in_time for p in parts),
            max((p.worst_seconds for p in parts), default=0.0),
        )


# --- callers ------------------------------------------------------------------------------------------------


class Callers(Paced):
    """``callers`` callers, each on its own connection, looping one unary call (``path``, serialized ``message``) with a
    ``timeout`` deadline, ``pause`` seconds apart; every call is a :class:`CallRecord`. A victim is one caller of a
    small request with a 1 s deadline; the heavy attackers are many callers of an expensive one."""

    def __init__(
        self,
        address: str,
        path: str,
        message: bytes,
        timeout: float = 1.0,
        callers: int = 1,
        pause: float = 0.02,
        max_seconds: float = 600.0,
    ) -> None:
        super().__init__("caller", callers, pause, max_seconds)
        self.message, self.timeout = message, timeout
        self.records: list[CallRecord] = []
        self._lock = threading.Lock()
        self._channels = [channel(address) for _ in range(callers)]
        self._calls = [ch.unary_unary(path) for ch in self._channels]  # bytes in, bytes out

    def step(self, thread_index: int) -> None:
        started = time.perf_counter()
        try:
            self._calls[thread_index](self.message, timeout=self.timeout)
            code, problem = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, problem = exc.code(), exc.details() or ""
        record = CallRecord(started - self.begin, time.perf_counter() - started, code, problem)
        with self._lock:
            self.records.append(record)

    def stop(self) -> None:
        super().stop()
        for ch in self._channels:
            ch.close()

    def connect(self, timeout: float) -> bool:
        """Open every caller's connection now, waiting at most ``timeout`` seconds in all: a caller already
        connected when an attack begins, as a scheduler's long-lived channel is. Whether all are ready."""
        deadline = time.monotonic() + timeout
        try:
            for ch in self._channels:
                grpc.channel_ready_future(ch).result(timeout=max(deadline - time.monotonic(), 0.0))
        except grpc.FutureTimeoutError:
            return False
        return True

    def run(self) -> LoadRun:
        """The calls so far as a :class:`LoadRun` (codes, latencies)."""
        with self._lock:
            records = sorted(self.records, key=lambda r: r.start)
        run = LoadRun(self.threads, time.perf_counter() - self.begin)
        run.records = records
        return run

    def calls_in(self, start: float = 0.0, stop: float = float("inf")) -> list[CallRecord]:
        """The calls started in ``[start, stop)`` (seconds since :meth:`start`)."""
        return [r for r in self.run().records if start <= r.start < stop]

    def ok_ratio(self, start: float = 0.0, stop: float = float("inf")) -> float:
        """OK calls among those started in ``[start, stop)`` (seconds since :meth:`start`)."""
        codes = [r.code for r in self.calls_in(start, stop)]
        return codes.count(grpc.StatusCode.OK) / len(codes) if codes else float("nan")


class HttpVictim(Paced):
    """One well-behaved caller of an RPC over HTTP (``POST url + path``, binary protobuf ``body``, a fresh connection
    per call, a 1 s timeout), ``pause`` seconds apart: what an HTTP client sees while the port is attacked."""

    def __init__(self, url: str, path: str, body: bytes, pause: float = 0.02, max_seconds: float = 600.0) -> None:
        super().__init__("http-victim", 1, pause, max_seconds)
        self.url, self.body = url + path, body
        self.outcomes: list[int | str] = []  # an HTTP status, or the error that ended the call

    def step(self, thread_index: int) -> None:
        request = urllib.request.Request(
            self.url, data=self.body, headers={"content-type": "application/x-protobuf"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=1.0) as answer:
                answer.read()
                outcome: int | str = answer.status
        except urllib.error.HTTPError as exc:
            outcome = exc.code
        except OSError as exc:
            outcome = type(exc).__name__
        self.outcomes.append(outcome)

    def figures(self) -> dict:
        calls = len(self.outcomes)
        return {"calls": calls, "ok_ratio": round(self.outcomes.count(200) / calls, 4) if calls else None}


class FreshClients(Paced):
    """Every ``interval`` seconds a new :class:`IndexerClient` (its own connections, client-side health checking
    on: a Watch stream must say SERVING before a call goes out) makes one small BuildChunk with a ``timeout``
    deadline and closes: what a scheduler that starts, or reconnects, sees. ``outcomes``: OK or the code."""

    def __init__(self, address: str, interval: float = 0.5, timeout: float = 2.0, max_seconds: float = 600.0) -> None:
        super().__init__("fresh-client", 1, interval, max_seconds)
        self.address, self.timeout = address, timeout
        self.outcomes: list[str] = []

    def step(self, thread_index: int) -> None:
        from indexer_service.client import IndexerClient
        from testkit.payloads import SMALL_BUILD_CHUNK

        with IndexerClient(self.address, timeout=self.timeout, max_attempts=1) as client:
            try:
                client.stub.BuildChunk(SMALL_BUILD_CHUNK, timeout=self.timeout, wait_for_ready=True)
                outcome = "OK"
            except grpc.RpcError as exc:
                outcome = exc.code().name
        self.outcomes.append(outcome)

    def ok_ratio(self) -> float:
        return self.outcomes.count("OK") / len(self.outcomes) if self.outcomes else float("nan")


# --- health Watch -------------------------------------------------------------------------------------------


class HealthWatch:
    """One open grpc.health.v1 Watch stream, as a client with client-side health checking keeps per replica:
    every status it is sent, and how and when the stream ended."""

    def __init__(self, address: str, max_seconds: float = 120.0) -> None:
        self._channel = grpc.insecure_channel(address, options=[OWN_CONNECTION])
        self._stream = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=max_seconds
        )
        self.statuses: list[str] = []
        self.end_code: grpc.StatusCode | None = None
        self.ended_at: float | None = None  # time.monotonic() when the stream ended
        self._thread = threading.Thread(target=self._follow, name="health-watch", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            for answer in self._stream:
                self.statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
            self.end_code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.end_code = exc.code()
        self.ended_at = time.monotonic()

    def wait_status(self, status: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while status not in self.statuses and time.monotonic() < deadline and self.ended_at is None:
            time.sleep(0.01)
        return status in self.statuses

    def wait_end(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return self.ended_at is not None

    def close(self) -> None:
        self._stream.cancel()
        self._thread.join(5.0)
        self._channel.close()
