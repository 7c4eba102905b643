"""Floods of long-lived streams (issue 19): reflection streams or unary calls that never send a request, and health
Watch streams whose flow-control window stays shut. Each runs from ``with`` to its end and stops by itself at
``max_seconds``; loopback only."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2

from testkit.h2raw import RawGrpcConnection
from testkit.harness import OWN_CONNECTION
from testkit.observe import Paced

REFLECTION_PATH = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
WATCH_PATH = "/grpc.health.v1.Health/Watch"


def sends_nothing(until: threading.Event, seconds: float = 30.0) -> Iterator[bytes]:
    """A call's request stream that sends no message and half-closes once ``until`` is set (or after ``seconds``):
    a caller whose request never comes."""
    until.wait(seconds)
    yield from ()


class SilentCalls(Paced):
    """``connections`` connections, each opening ``streams_each`` calls of ``path`` that send nothing (a client
    that asked for reflection and walked away; a unary call whose request never comes, ``unary_response``), each
    reopened ``reopen_pause`` seconds after the server ended it, until :meth:`stop`. (The pause keeps this a flood
    of held streams: with none, the refusals become a flood of calls of their own, the rapid-reset test's subject,
    on the test's own 2 cores.)"""

    def __init__(
        self,
        address: str,
        connections: int,
        streams_each: int,
        reopen_pause: float = 0.5,
        max_seconds: float = 120.0,
        path: str = REFLECTION_PATH,
        unary_response: bool = False,
    ) -> None:
        super().__init__("silent-call", connections * streams_each, reopen_pause, max_seconds)
        self.address, self.connections, self.streams_each = address, connections, streams_each
        self.path, self.unary_response = path, unary_response
        self.opened = 0
        self.ended: dict[str, int] = {}  # how the server ended streams: status code names
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def step(self, thread_index: int) -> None:
        """One stream on the thread's connection, held until the server ends it."""
        chan = self._channels[thread_index // self.streams_each]
        requests = sends_nothing(self._stop, self.max_seconds)
        try:
            if self.unary_response:  # a future: the call itself would wait for the answer
                call = chan.stream_unary(self.path).future(requests, timeout=self.max_seconds)
            else:
                call = chan.stream_stream(self.path)(requests, timeout=self.max_seconds)
            with self._lock:
                self.opened += 1
            if self.unary_response:
                call.result()
            else:
                for _ in call:
                    pass
            code = "OK"
        except ValueError:  # the channel was closed: the flood is over
            return
        except grpc.RpcError as exc:
            code = exc.code().name
        with self._lock:
            self.ended[code] = self.ended.get(code, 0) + 1

    def start(self) -> SilentCalls:
        self._channels = [
            grpc.insecure_channel(self.address, options=[OWN_CONNECTION]) for _ in range(self.connections)
        ]
        return super().start()

    def stop(self) -> None:
        self._stop.set()
        for chan in self._channels:  # ends the streams still held
            chan.close()
        super().stop()


class BlockedWatchers(Paced):
    """``rate`` new connections a second, each advertising a flow-control window of 0 and opening
    ``streams_each`` health Watch streams: the server can send them no status. Held open until :meth:`stop`
    (at most ``max_connections``)."""

    def __init__(
        self,
        host: str,
        port: int,
        rate: float,
        streams_each: int = 2,
        max_connections: int = 400,
        max_seconds: float = 600.0,
    ) -> None:
        super().__init__("blocked-watchers", 1, 1.0 / rate, max_seconds)
        self.host, self.port, self.streams_each = host, port, streams_each
        self.max_connections = max_connections
        self.connections: list[RawGrpcConnection] = []
        self.streams = 0
        self._request = health_pb2.HealthCheckRequest(service="").SerializeToString()

    def step(self, thread_index: int) -> None:
        """One more connection and its streams, up to ``max_connections``."""
        if len(self.connections) >= self.max_connections:
            return
        try:
            conn = RawGrpcConnection(self.host, self.port, initial_window_size=0)
            conn.wait_settings()
        except OSError:
            return
        self.connections.append(conn)
        for _ in range(self.streams_each):
            if conn.start_call(WATCH_PATH, self._request) is not None:
                self.streams += 1

    def ended_by_server(self) -> int:
        return sum(s.ended for conn in self.connections for s in conn.streams.values())

    def stop(self) -> None:
        super().stop()
        for conn in self.connections:
            conn.close()
