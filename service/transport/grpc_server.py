"""The gRPC servers, built: the RPC port (PrefillMetadata, health overall and per service, reflection, an answer for
any other method) and the probe-only health port, each bound with its gate and its options, and stopped in order.
What each call runs is service/transport/grpc_calls.py; the ports' options and credentials are
service/transport/grpc_options.py.

Abuse and overload (docs/overload.md): every call on both gRPC ports passes :class:`~.gate.CallGate` (its request
in before it holds anything, a place in its lane, a share per peer); each connection opens at most
``max_streams_per_connection`` calls; a request message is at most what a valid request at the configured limits
can be; a call whose caller leaves before it starts is counted as shed "queue_deadline"; an answer is held in the
response budget until the call ends, and cancelled if its caller has not read it within ``response_drain_seconds``.

The server is the sync ``grpc.server``, not ``grpc.aio``: the work is CPU-bound numpy (or a GPU launch), and the
sync server with the gate serves more calls per core (docs/performance.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.config import ServiceConfig
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.overload.admission import DrainWatchdog
from indexer_service.service.overload.peers import unacknowledged_bytes
from indexer_service.service.process.addresses import host_port
from indexer_service.service.reasons import Port
from indexer_service.service.transport.gate import Accounting, CallGate, Lane
from indexer_service.service.transport.grpc_calls import UnknownMethodHandler, rpc_handlers
from indexer_service.service.transport.grpc_options import connection_options, server_credentials, server_options
from indexer_service.service.transport.health import HEALTH_SERVICE_NAME, HealthServicer
from indexer_service.service.transport.port_watch import RpcPortWatch
from indexer_service.service.transport.reflection import Reflection

log = logging.getLogger(__name__)

# What the health service reports on: overall ("") and the one real service.
HEALTH_NAMES = ("", SERVICE_NAME)


# How long the drain leaves connections open once no call is left, for their clients to read their last answers
# and close them (a client closes a connection the server has sent a GOAWAY on once its calls are over).
SETTLE_SECONDS = 0.5
# How long, once gRPC has stopped (and cancelled what still ran), the RPC threads get to leave the calls they
# were in: a computation is milliseconds; a thread stuck longer is logged and left (the threads are daemons).
POOL_STOP_SECONDS = 2.0
# How often the drain looks again at what it waits for.
SETTLE_POLL_SECONDS = 0.05


# Health's lane on each gRPC port: Check, List and the start of a Watch, each quick (nothing there waits for a
# send). Its places bound what silent or slow health calls can hold; the share keeps one peer from taking them all
# (the kubelet probes from its node's address, a peer of its own).
HEALTH_THREADS = 2
HEALTH_PLACES = 64
HEALTH_PEER_SHARE = 16


def make_gate(config: ServiceConfig, accounting: Accounting) -> CallGate:
    return CallGate(accounting, config.request_timeout_seconds)


@dataclass
class GrpcServer:
    """The RPC server and its parts that outlive start-up (the gate, the drain watchdog and reflection stop with
    it)."""

    server: grpc.Server
    port: int
    gate: CallGate
    lane: Lane
    watchdog: DrainWatchdog
    reflection: Reflection
    watch: RpcPortWatch | None = None

    def start(self) -> None:
        self.server.start()
        if self.watch is not None:
            self.watch.start()

    def stop(self, grace: float | None) -> None:
        """Within ``grace`` seconds (None: none, every call cancelled): let the RPCs in flight finish and their
        answers reach their clients (:meth:`_deliver_in_flight`), stop taking calls (the GOAWAY), give those then in
        flight what is left of the grace; then end the gate's threads."""
        if self.watch is not None:
            self.watch.stop()
        self.gate.end_waiting()  # calls that never sent their request do not hold the grace
        end = time.monotonic() + (grace or 0.0)
        if grace:
            self._deliver_in_flight(end)
        stopped = self.server.stop(None if grace is None else max(0.0, end - time.monotonic()))
        idle_since = None
        while not stopped.wait(SETTLE_POLL_SECONDS) and time.monotonic() < end:
            # A call that reached the gate between the first end_waiting and the stop (an attacker replacing each
            # silent call as it is ended does) would otherwise wait for its request through the whole grace.
            self.gate.end_waiting()
            now = time.monotonic()
            if not self.gate.idle():
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= SETTLE_SECONDS:
                # No call of ours left for a while: what remains is connections that ignore the GOAWAY. Closed
                # sooner, a connection whose last answer its client is still reading is reset, and the answer lost.
                self.server.stop(0)  # once: the wait below sees it through
                break
        stopped.wait()
        busy = self.gate.shutdown(POOL_STOP_SECONDS)
        if busy:
            log.warning("rpc_threads_still_busy count=%d after_seconds=%.1f", busy, POOL_STOP_SECONDS)
        self.watchdog.stop()
        self.reflection.close()

    def _deliver_in_flight(self, end: float) -> None:
        """Before the GOAWAY, until ``end`` at most: the RPCs queued or running now finish, then every answer being
        sent then is sent, then every byte sent on the port has reached its client (none of this process's
        connections there has any unacknowledged). The server takes calls meanwhile. After the GOAWAY, gRPC core
        closes a connection as soon as its last call's answer is in the kernel's send buffer; a client frame that
        arrives then (a window update as it reads) resets the connection, and the rest of that answer is lost
        (docs/service.md, "Shutdown")."""
        live, open_calls = self.lane.live, self.gate.open_calls
        running = set(live)
        if not _wait_for(lambda: running.isdisjoint(live), end):
            return
        sending = set(open_calls)
        if not _wait_for(lambda: sending.isdisjoint(open_calls), end):
            return
        # A client that stopped reading holds its bytes unacknowledged for good: given up, as an unread answer is,
        # after response_drain_seconds.
        _wait_for(lambda: not unacknowledged_bytes((self.port,)), min(end, time.monotonic() + self.watchdog.seconds))


def _wait_for(done: Callable[[], bool], end: float) -> bool:
    """Whether ``done()`` came true before ``end`` (``time.monotonic()``), looked at every SETTLE_POLL_SECONDS."""
    while not done():
        if time.monotonic() >= end:
            return False
        time.sleep(SETTLE_POLL_SECONDS)
    return True


def create_grpc_server(
    config: ServiceConfig,
    plane: DataPlane,
    health_servicer: HealthServicer,
    share_port: bool = False,
    probe_socket: Path | None = None,
    report: Callable[[str, bool], None] | None = None,
) -> GrpcServer:
    """The RPC server, bound (and, as gRPC binds, listening: it takes connections into its backlog from here on)
    but not started. ``share_port``: SO_REUSEPORT, for a worker of several; ``probe_socket``: a unix socket the
    server also listens on, plaintext, for health probes (its own watch's, the supervisor's); ``report``: told
    whether the port takes new callers (service/transport/port_watch.py), once :meth:`GrpcServer.start` ran."""
    shed = plane.shed_on(Port.GRPC)
    gate = make_gate(config, Accounting(plane.metrics, shed))
    lane = gate.lane("grpc", config.grpc_workers, config.max_concurrent_rpcs, config.max_concurrent_rpcs_per_peer)
    server = grpc.server(
        gate,  # not a ThreadPoolExecutor, though grpcio names one: it only submits to it (see CallGate)
        # No maximum_concurrent_rpcs: the gate refuses past max_concurrent_rpcs itself, counted, per lane.
        options=server_options(config, share_port),
    )
    watchdog = DrainWatchdog(config.response_drain_seconds)
    server.add_registered_method_handlers(SERVICE_NAME, rpc_handlers(plane, gate, lane, watchdog))
    health_lane = gate.lane("health", HEALTH_THREADS, HEALTH_PLACES, HEALTH_PEER_SHARE)
    health_servicer.register(server, gate, health_lane)
    reflection = Reflection(
        (SERVICE_NAME, HEALTH_SERVICE_NAME),
        config.reflection_max_streams,
        config.reflection_idle_seconds,
        shed,
        gate,
    )
    server.add_generic_rpc_handlers(reflection.handlers)
    unknown = UnknownMethodHandler(plane, gate, watchdog)
    server.add_generic_rpc_handlers((unknown,))  # last: what nobody else serves
    address = host_port(config.grpc_host, config.grpc_port)
    try:
        credentials = server_credentials(config)
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind gRPC to {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind gRPC to {address}")
    if probe_socket is not None:
        try:
            server.add_insecure_port(f"unix:{probe_socket}")
        except RuntimeError as exc:
            raise OSError(f"cannot bind the probe socket {probe_socket}: {exc}") from None
    watch = None if report is None else RpcPortWatch(gate, lane, report, probe_socket)
    return GrpcServer(server, port, gate, lane, watchdog, reflection, watch)


@dataclass
class HealthServer:
    """The probe listener and its gate."""

    server: grpc.Server
    port: int
    gate: CallGate

    def stop(self) -> None:
        self.gate.end_waiting()
        self.server.stop(0).wait()
        self.gate.shutdown(POOL_STOP_SECONDS)


def create_health_server(
    config: ServiceConfig, health_servicer: HealthServicer, accounting: Accounting, rpc_port: int | None = None
) -> HealthServer:
    """The probe listener: grpc.health.v1 only, plaintext (kubelet's gRPC probes speak no TLS), through a gate of
    its own (a probe never waits behind RPC work, its limit or its connections); its own cap on connections
    (``health_max_connections``) and the same idle and handshake bounds as the RPC port. A call to any other
    method is answered UNIMPLEMENTED naming the RPC port: ``rpc_port``, the port bound (``grpc_port`` may be 0),
    else ``grpc_port``."""
    gate = make_gate(config, accounting)
    lane = gate.lane("health", HEALTH_THREADS, HEALTH_PLACES, HEALTH_PEER_SHARE)
    server = grpc.server(
        gate,
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 4096),
            *connection_options(config, config.health_max_connections),
        ],
    )
    health_servicer.register(server, gate, lane)
    server.add_generic_rpc_handlers((HealthPortOnly(accounting.unknown_method, rpc_port or config.grpc_port),))
    address = host_port(config.grpc_host, config.health_port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind the gRPC health port to {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind the gRPC health port to {address}")
    return HealthServer(server, port, gate)


class HealthPortOnly(grpc.GenericRpcHandler):
    """The health port's answer to any method but health's: UNIMPLEMENTED, naming the port the RPCs are on,
    counted as method ``unknown``. Runs on the gate's refusal lane (no route)."""

    def __init__(self, count: Callable[[], None], rpc_port: int) -> None:
        self.count = count
        self.rpc_port = rpc_port

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        count, name, rpc_port = self.count, handler_call_details.method, self.rpc_port

        def refuse(requests: object, context: grpc.ServicerContext) -> None:
            count()
            where = f"port {rpc_port}" if rpc_port else "the gRPC port (grpc_port)"
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"this is the health port: it serves grpc.health.v1 only; call {name[:200]!r} on {where}",
            )

        return grpc.stream_stream_rpc_method_handler(refuse)
