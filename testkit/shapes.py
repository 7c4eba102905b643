"""The attacks of issue 35's shapes on one server, each a function of its sizes: ``python -m benchmarks.attack`` runs
them at full size (rows ``undecodable-health``, ``silent-watches``, ``http-trailers``, ``silent-unary-calls``,
``idle-connections-many-peers``), tests/system/test_floods_gate.py smaller, each against a control run of the same
siege on the same server. Only the attacks are here; what watches them is :class:`testkit.siege.Siege`.

Loopback only: the gRPC attackers come from ``FLOOD_PEER`` (testkit.h2raw), the many peers from 127.0.0.2 up
(addresses of 127.0.0.0/8 reach 127.0.0.1 on Linux). Each attack ends with its loop or its ``with`` block.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from testkit.h2raw import CallLoopReport, RawSilentCalls, call_loop, each_in_process
from testkit.harness import LOOPBACK, ServiceProcess
from testkit.http1raw import HugeHeaderReport, IdleConnections, huge_trailer
from testkit.payloads import BUILD_CHUNK_PATH, H2_PREFACE, SMALL_BUILD_CHUNK
from testkit.streams import WATCH_PATH

UNDECODABLE = b"\xff\xff\xff"  # no protobuf message parses from it (a field tag of wire type 7)
HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"
NON_UTF8_PATH = HEALTH_CHECK_PATH.encode() + b"\xff"  # a :path grpcio cannot decode (it logged a traceback per call)
TRAILER_BYTES = 2**26  # the 64 MiB trailer field
SILENT_WATCHES_EACH = 4  # the issue's: as many as health's pool once had threads


def undecodable_calls(
    ports: dict[int, int],
    paths: tuple[str | bytes, ...],
    seconds_each: float,
    calls_each: int | None = None,
    together: bool = False,
) -> list[CallLoopReport]:
    """Calls of each of ``paths`` whose request does not parse (:data:`UNDECODABLE`), looped on ``ports[port]``
    connections of each port, each its own process with one call in flight, for ``seconds_each`` (or ``calls_each``
    calls a connection): each port and path in turn, or all of them at once (``together``). grpcio's own path for
    health's Watch kept ~20 KiB a call for good, and logged a traceback per Check."""
    loops = [
        [(LOOPBACK, port, path, UNDECODABLE, seconds_each, None, calls_each)] * connections
        for port, connections in ports.items()
        for path in paths
    ]
    if together:
        return each_in_process(call_loop, [loop for copies in loops for loop in copies], seconds_each)
    return [report for copies in loops for report in each_in_process(call_loop, copies, seconds_each)]


def silent_watches(server: ServiceProcess, each: int = SILENT_WATCHES_EACH) -> list[RawSilentCalls]:
    """One connection to each gRPC port (the health port, then the RPC port), ``each`` health Watch calls on it
    whose request never comes, a call the server ends replaced at once; to be opened with ``with``. They once held
    all of health's threads: new Watches got no status, and a SIGTERM waited out its whole grace."""
    return [RawSilentCalls(LOOPBACK, port, WATCH_PATH, 1, each) for port in (server.health_port, server.grpc_port)]


def silent_unary_calls(server: ServiceProcess, connections: int, each: int) -> RawSilentCalls:
    """``connections`` connections from one peer, each with ``each`` BuildChunk calls whose request never comes
    and no deadline, a call the server ends replaced at once; to be opened with ``with``. 3 x 100 once held every
    place under ``max_concurrent_rpcs``."""
    return RawSilentCalls(LOOPBACK, server.grpc_port, BUILD_CHUNK_PATH, connections, each)


@dataclass
class TrailerFlood:
    """What :func:`trailer_waves` saw: the lone trailer's report, then each of the waves'."""

    one: HugeHeaderReport
    many: list[HugeHeaderReport] = field(default_factory=list)
    waves: int = 0

    @property
    def reports(self) -> list[HugeHeaderReport]:
        return [self.one, *self.many]


def trailer_waves(
    port: int, wave: int, seconds: float, trailer_bytes: int = TRAILER_BYTES, max_waves: int | None = None
) -> TrailerFlood:
    """A BuildChunk over HTTP on ``port`` whose chunked body ends in a trailer field of ``trailer_bytes``, on one
    connection; then waves of ``wave`` such requests at once for ``seconds`` (at most ``max_waves`` waves). When
    trailers were outside ``http_max_header_bytes``, one took RSS from 64 to 218 MiB and 48 at once to 725 MiB."""
    body = SMALL_BUILD_CHUNK.SerializeToString()

    def one(_: object = None) -> HugeHeaderReport:
        return huge_trailer(LOOPBACK, port, BUILD_CHUNK_PATH, body, trailer_bytes)

    flood = TrailerFlood(one())
    end = time.monotonic() + seconds
    with ThreadPoolExecutor(max_workers=wave) as pool:
        while time.monotonic() < end and (max_waves is None or flood.waves < max_waves):
            flood.many += pool.map(one, range(wave))
            flood.waves += 1
    return flood


def many_peers(count: int) -> list[str]:
    """``count`` peer addresses, 127.0.0.2 and up (at most 253)."""
    return [f"127.0.0.{n}" for n in range(2, 2 + count)]


def idle_connections_of_many_peers(
    server: ServiceProcess, peers: list[str], each: int, connect_seconds: float = 5.0
) -> list[IdleConnections]:
    """From each of ``peers``, ``each`` connections to every port of ``server`` (the HTTP/2 preface on the gRPC
    ports, nothing on the HTTP ones), sending nothing more; to be opened (and closed) by the caller. Each peer stays
    under its per-peer cap, so only the ports' own caps, and their shares once crowded, bound them."""
    ports = [(server.grpc_port, H2_PREFACE), (server.health_port, H2_PREFACE), (server.http_port, b"")]
    if server.http_rpc_port:
        ports.append((server.http_rpc_port, b""))
    return [
        IdleConnections(LOOPBACK, port, each, greeting, source=peer, connect_seconds=connect_seconds)
        for peer in peers
        for port, greeting in ports
    ]
