"""Floods of long-lived streams (issue 19): reflection streams that never send a request, and health Watch
streams whose flow-control window stays shut. Each runs from ``with`` to its end and stops by itself at
``max_seconds``; loopback only."""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from testkit.h2raw import RawGrpcConnection
from testkit.harness import OWN_CONNECTION

REFLECTION_PATH = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
WATCH_PATH = "/grpc.health.v1.Health/Watch"


class IdleReflectionStreams:
    """``connections`` connections, each opening ``streams_each`` reflection streams that send nothing (a
    client that asked for reflection and walked away), each reopened ``reopen_pause`` seconds after the server
    ended it, until :meth:`close`. (The pause keeps this a flood of held streams: with none, the refusals
    become a flood of calls of their own, the rapid-reset test's subject, on the test's own 2 cores.)"""

    def __init__(
        self, address: str, connections: int, streams_each: int, reopen_pause: float = 0.5, max_seconds: float = 120.0
    ) -> None:
        self.address, self.connections, self.streams_each = address, connections, streams_each
        self.reopen_pause = reopen_pause
        self.max_seconds = max_seconds
        self.opened = 0
        self.ended: dict[str, int] = {}  # how the server ended streams: status code names
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _requests(self):
        self._stop.wait(self.max_seconds)
        return
        yield  # a generator that sends nothing and ends when the flood stops

    def _hold(self, chan: grpc.Channel) -> None:
        call = chan.stream_stream(REFLECTION_PATH)
        deadline = time.monotonic() + self.max_seconds
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                stream = call(self._requests(), timeout=self.max_seconds)
            except ValueError:  # the channel was closed: the flood is over
                return
            with self._lock:
                self.opened += 1
            try:
                for _ in stream:
                    pass
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with self._lock:
                self.ended[code] = self.ended.get(code, 0) + 1
            self._stop.wait(self.reopen_pause)

    def __enter__(self) -> IdleReflectionStreams:
        self._channels = [
            grpc.insecure_channel(self.address, options=[OWN_CONNECTION]) for _ in range(self.connections)
        ]
        self._threads = [
            threading.Thread(target=self._hold, args=(chan,), daemon=True)
            for chan in self._channels
            for _ in range(self.streams_each)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for chan in self._channels:
            chan.close()
        for thread in self._threads:
            thread.join(10.0)


class BlockedWatchers:
    """``rate`` new connections a second, each advertising a flow-control window of 0 and opening
    ``streams_each`` health Watch streams: the server can send them no status. Held open until :meth:`close`
    (at most ``max_connections``)."""

    def __init__(self, host: str, port: int, rate: float, streams_each: int = 2, max_connections: int = 400) -> None:
        self.host, self.port, self.rate, self.streams_each = host, port, rate, streams_each
        self.max_connections = max_connections
        self.connections: list[RawGrpcConnection] = []
        self.streams = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blocked-watchers", daemon=True)

    def _run(self) -> None:
        request = health_pb2.HealthCheckRequest(service="").SerializeToString()
        while not self._stop.is_set() and len(self.connections) < self.max_connections:
            try:
                conn = RawGrpcConnection(self.host, self.port, initial_window_size=0)
                conn.wait_settings()
            except OSError:
                self._stop.wait(1.0 / self.rate)
                continue
            self.connections.append(conn)
            for _ in range(self.streams_each):
                if conn.start_call(WATCH_PATH, request) is not None:
                    self.streams += 1
            self._stop.wait(1.0 / self.rate)

    def ended_by_server(self) -> int:
        return sum(s.ended for conn in self.connections for s in conn.streams.values())

    def __enter__(self) -> BlockedWatchers:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10.0)
        for conn in self.connections:
            conn.close()
