"""The gRPC transport: a thin servicer over the data plane, wrapped for access logs and error mapping; health
(overall and per service, also on a probe-only listener) and reflection; every call through one gate.

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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from indexer_service.service.adapters import grpcio
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.config import ServiceConfig
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.errors import Code, ServiceError, Shed, UnknownMethod
from indexer_service.service.observability.logs import NEW_REQUEST_IDS, REQUEST_ID, REQUEST_ID_HEADER, request_id_from
from indexer_service.service.observability.metrics import UNKNOWN_METHOD
from indexer_service.service.overload.admission import Caller, DrainWatchdog
from indexer_service.service.overload.limits import max_request_bytes
from indexer_service.service.process.addresses import host_port
from indexer_service.service.reasons import ShedReason
from indexer_service.service.rpcs import RPCS
from indexer_service.service.transport.gate import Accounting, CallGate, Lane, never_started_reason
from indexer_service.service.transport.health import HEALTH_SERVICE_NAME, HealthServicer
from indexer_service.service.transport.port_watch import RpcPortWatch
from indexer_service.service.transport.reflection import Reflection

log = logging.getLogger(__name__)

# What the health service reports on: overall ("") and the one real service.
HEALTH_NAMES = ("", SERVICE_NAME)

Behavior = Callable[[object, grpc.ServicerContext], object]
Metadata = tuple[tuple[str, str | bytes], ...]

# The data plane's outcomes as gRPC statuses: the one place this transport maps them (same names).
GRPC_STATUS: dict[Code, grpc.StatusCode] = {code: grpc.StatusCode[code.name] for code in Code}
# Read once: each read of an enum member through its class costs ~80 ns (a metaclass lookup), twice per call.
STATUS_OK = grpc.StatusCode.OK


class GrpcCaller(Caller):
    """A gRPC call as the data plane sees it, one per call, made as the behaviour starts. Whether its caller still
    waits is known without asking gRPC each time: the ``deadline`` is read once, and :meth:`end`, added to the
    call's callbacks here, runs when the call is over, answered or not (gRPC runs the callbacks once the call has
    ended, on its polling thread: a cancel, an expiry, or after the status is sent). While the behaviour runs, the
    call can only end by its caller cancelling or its deadline passing, so ``ended`` then means CANCELLED (or
    DEADLINE_EXCEEDED: :meth:`gone` reads the deadline first). :meth:`end` also releases the answer's budget
    ticket, so one callback per call does both; a ticket granted after :meth:`end` ran is released by the data
    plane, whose last look at the caller after the reservation then sees ``ended``. ``trailers``: the call's
    trailing metadata. ``gone_at_start``: what :meth:`gone` said when the caller was made. ``metadata``: the
    caller's. :meth:`cancel_unread` is what the drain watchdog calls for an answer not read in time. ``open_call``
    reads and sets all that (service/adapters/grpcio.py: on grpcio's call state, or through the public methods)."""

    __slots__ = ("_context", "_method", "_plane", "gone_at_start", "metadata")

    def __init__(
        self,
        context: grpc.ServicerContext,
        plane: DataPlane,
        method: str,
        trailers: Metadata,
        open_call: Callable[..., tuple] = grpcio.open_call_fast,
    ) -> None:
        # Caller's fields set here rather than by its __init__ (the tests hold the two equal)
        self.held_per_answer_byte = 1.0
        self.ticket = None
        self.in_heavy_lane = False
        self._context = context
        self._plane = plane
        self._method = method
        # False before end() can run: end() only ever sets it True, and a cancel that ends the call as soon as the
        # call's lock is released must not be overwritten by this reading (the ticket would never be released)
        self.ended = False
        self.peer, self.deadline, self.metadata, ended = open_call(context, trailers, self.end)
        if ended:
            self.ended = True
        # A call that waited for a thread may start past its deadline or after its caller left.
        self.gone_at_start = self.gone()

    def end(self) -> None:
        self.ended = True
        ticket = self.ticket
        if ticket is not None:
            ticket.budget.give_back(ticket, None)  # Ticket.release without its frame

    def cancel_unread(self) -> None:
        ticket = self.ticket
        nbytes = 0 if ticket is None else ticket.nbytes
        self._plane.shed(self._method, ShedReason.UNREAD_RESPONSE, f"{nbytes} bytes unread by {self.peer}")
        self._context.cancel()


def rpc_handlers(
    plane: DataPlane, gate: CallGate, lane: Lane, watchdog: DrainWatchdog
) -> dict[str, grpc.RpcMethodHandler]:
    """PrefillMetadata's methods by name, registered with gRPC as such (``add_registered_method_handlers``: gRPC
    core matches a call's path, where a generic handler is asked in Python on every call), bytes in and bytes out:
    the data plane parses requests (grpcio's own deserializer would answer undecodable bytes with INTERNAL and a
    traceback, where the caller deserves INVALID_ARGUMENT, as over HTTP) and answers with wire bytes written from
    the result arrays (one copy, see service/codec.py). Each method's behaviour is the data plane's ``call`` in
    :func:`served`, routed to ``lane``; its refusing twins, which the gate runs past the lane's places or the
    caller's share of them, are counted as shed ``concurrency`` or ``peer_share``. A call that ends before it
    starts is counted as shed ``queue_deadline``."""

    def refusal(reason: ShedReason) -> Callable[..., bytes]:
        def refuse(method: str, request: object, caller: Caller) -> bytes:
            if reason is ShedReason.PEER_SHARE:
                message = (
                    f"busy: {caller.peer} already has {lane.peer_share} calls in the server "
                    "(max_concurrent_rpcs_per_peer); retry with backoff"
                )
            else:
                message = (
                    f"busy: {gate.held(lane)} calls in the server (max_concurrent_rpcs {lane.places}); "
                    "retry with backoff"
                )
            plane.shed(method, reason, message)  # the data plane never sees this call
            raise Shed(reason, message)

        return refuse

    never_started = {
        ShedReason.QUEUE_DEADLINE: "its deadline passed while it waited in the server",
        ShedReason.DEADLINE_ON_ARRIVAL: "its deadline had passed before its request was in",
        ShedReason.CALLER_CANCELLED: "its caller cancelled or reset it before it started",
    }
    gate.on_never_started = lambda method, reason, peer: plane.shed(method, reason, f"{never_started[reason]} ({peer})")
    wait_seconds, call_seconds = plane.metrics.call_wait_seconds, plane.metrics.call_seconds
    child = plane.metrics.child

    def timed(method: str, wait: float, total: float) -> None:
        child(wait_seconds, method).observe(wait)
        child(call_seconds, method).observe(total)

    gate.timed = timed
    refusals = {reason: refusal(reason) for reason in (ShedReason.CONCURRENCY, ShedReason.PEER_SHARE)}
    handlers = {}
    for method in RPCS:
        behavior = served(plane, method, plane.call, watchdog, gate.started)
        refusing = {
            reason: served(plane, method, refuse, watchdog, gate.started) for reason, refuse in refusals.items()
        }
        gate.route(behavior, method, lane, unary_request=True, refusing=refusing, count_never_started=True)
        handlers[method] = grpc.unary_unary_rpc_method_handler(behavior)  # no (de)serializers: bytes both ways
    return handlers


def served(
    plane: DataPlane,
    method: str,
    serve: Callable[..., bytes],
    watchdog: DrainWatchdog,
    started: threading.local,
) -> Behavior:
    """The one behaviour of a call to this server (KServe's interceptors in one function: each wrapper is a Python
    frame per call; grpcio's own interceptor pipeline rebuilds its wrappers on every call): ``serve(method, request,
    caller=...)`` (the data plane's ``call``, or a refusal) with its caller, a :class:`GrpcCaller`, whose end is
    known from ``add_callback``; a caller already gone when the call starts (it waited for a thread past its
    deadline, or cancelled meanwhile) is shed as ``queue_deadline`` without work; an answer's budget ticket is
    watched until the call ends and cancelled if unread within ``response_drain_seconds``. The data plane's error
    as its gRPC status: the data plane raises nothing else, whatever went wrong inside it is already an
    InternalError there (logged with its traceback). Each call's request id (the caller's ``x-request-id``
    metadata when it is a safe one, else a new one) in its log lines and returned in the trailing metadata; its
    span when tracing is on; a failure in the data plane's rate-limited log of failed calls (INTERNAL always), a
    success at DEBUG.

    Trailing, not initial, metadata: the trailers go out in the one batch that carries the answer and the
    status, where ``send_initial_metadata`` starts a batch of its own per call (one more completion on the
    polling thread); a small BuildChunk cost +40-60 us of server CPU and +120-150 us of wall time per call that
    way, the trailers nothing above the noise (docs/service.md, "Request ids")."""
    failed, tracer, watch = plane.failed_calls, plane.tracer, watchdog.watch_ticket
    debug = log.isEnabledFor(logging.DEBUG)  # the level is set once, at start, before the server is made
    open_call = grpcio.call_opener()

    def behavior(request: object, context: grpc.ServicerContext) -> object:
        started.value = True  # the gate's flag, set inline (docs/performance.md)
        start = time.perf_counter()
        trailers: list[tuple[str, str]] = []  # the request id, once known; sent with the status
        call = GrpcCaller(context, plane, method, trailers, open_call)
        supplied = None
        for key, value in call.metadata:  # a loop, not next() over a generator: half the cost
            if key == REQUEST_ID_HEADER:
                supplied = value
                break
        request_id = next(NEW_REQUEST_IDS) if supplied is None else request_id_from(supplied)
        trailers.append((REQUEST_ID_HEADER, request_id))
        token = REQUEST_ID.set(request_id)
        span = None if tracer is None else tracer.start("grpc", method, request_id, dict(call.metadata))
        code = None
        try:
            gone = call.gone_at_start
            if gone is not None:
                reason = never_started_reason(call.deadline, getattr(started, "queued_at", 0.0))
                plane.shed(method, reason, f"{gone.name} before the call started ({call.peer})")
                context.abort(GRPC_STATUS[gone], "the caller went away (cancelled, or past its deadline) first")
            response = serve(method, request, caller=call)
            if call.ticket is not None:  # held until the call ends (call.end); cancelled if unread meanwhile
                watch(call.ticket, call.cancel_unread)
            code = STATUS_OK  # known here: no context.code() (a Python frame) on the success path
            return response
        except ServiceError as exc:
            context.abort(GRPC_STATUS[exc.code], exc.message)
        finally:
            if code is None:  # aborted, or an exception gRPC answers with UNKNOWN
                code = context.code() or grpc.StatusCode.UNKNOWN
            details = ""
            if code is not STATUS_OK:
                details = context.details()  # the sync server keeps them encoded
                if isinstance(details, bytes):
                    details = details.decode(errors="replace")
                milliseconds = (time.perf_counter() - start) * 1e3
                failed.record("rpc", method, code.name, details, context.peer(), milliseconds)
            elif debug:
                milliseconds = (time.perf_counter() - start) * 1e3
                log.debug("rpc method=%s code=OK ms=%.3f peer=%s", method, milliseconds, context.peer())
            if span is not None:
                tracer.end(span, code.name, details)
            REQUEST_ID.reset(token)

    return behavior


class UnknownMethodHandler(grpc.GenericRpcHandler):
    """The last generic handler (after reflection's): any method nobody else serves is answered UNIMPLEMENTED (as gRPC
    would), counted as method ``unknown`` and logged, rate-limited, with the method's name. A streaming handler,
    so a call of any shape is refused before its request is read; made per call, as such calls are rare and each
    names its own method. The gate has no route for it, so it runs on the gate's refusal lane: a flood of unknown
    methods neither takes the RPC threads nor a place of the RPC lane."""

    def __init__(self, plane: DataPlane, gate: CallGate, watchdog: DrainWatchdog) -> None:
        self.plane = plane
        self.gate = gate
        self.watchdog = watchdog

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        plane, name = self.plane, handler_call_details.method

        def refuse(method: str, requests: object, caller: Caller) -> object:
            plane.unknown_method()
            raise UnknownMethod(f"unknown method {name[:200]!r}: this server has {SERVICE_NAME}'s {', '.join(RPCS)}")

        return grpc.stream_stream_rpc_method_handler(
            served(plane, UNKNOWN_METHOD, refuse, self.watchdog, self.gate.started)
        )


def connection_age_options(seconds: float) -> list[tuple[str, int]]:
    """Ask clients to reconnect after ``seconds``, so they re-resolve DNS and spread onto new replicas; calls
    in flight then get 10 s to finish (``grpc.max_connection_age_grace_ms``, fixed: not ``shutdown_grace_seconds``)."""
    if seconds <= 0:
        return []
    return [("grpc.max_connection_age_ms", int(seconds * 1000)), ("grpc.max_connection_age_grace_ms", 10_000)]


# Keepalive, enforced: a client may ping at most every 10 s while it has no call (gRPC's default is 5 min, which
# turns away clients that keep connections warm every 30-60 s); the third ping too early (gRPC's default 2
# strikes) gets GOAWAY ENHANCE_YOUR_CALM, so pings cannot be a flood of their own. The server pings a connection
# that carries calls every minute and closes it when the peer does not answer within 20 s: a peer that vanished
# (no FIN, no RST) while it held a Watch stream or a stalled call lets go of it then, not at max_connection_age.
KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]


def connection_options(config: ServiceConfig, max_connections: int) -> list[tuple[str, int]]:
    """What bounds a port's connections (docs/overload.md, "Connections"): at most ``max_connections`` open
    (gRPC core closes more at accept; TLS handshakes in progress count), each handshake (TLS, then the client's
    HTTP/2 settings) done within ``handshake_timeout_seconds``, a connection with no call closed after
    ``connection_idle_seconds``, and keepalive enforced."""
    options = [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_seconds * 1000)),
        *KEEPALIVE_OPTIONS,
    ]
    if config.connection_idle_seconds > 0:
        options.append(("grpc.max_connection_idle_ms", int(config.connection_idle_seconds * 1000)))
    return options


def server_options(config: ServiceConfig, share_port: bool = False) -> list[tuple[str, int]]:
    """The gRPC server's channel options: message limits both ways (a request is never larger than a valid one
    can be), streams per connection, pending calls, no shared port (but between the workers of one replica,
    ``share_port``: the supervisor has reserved the port for them, service/process/supervisor.py), connection age, and
    the bounds on connections."""
    return [
        ("grpc.max_receive_message_length", max_request_bytes(config)),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
        # Never share a port silently with another process (Linux allows it by default in gRPC); the workers of
        # one replica share theirs on purpose, and the supervisor guards it against anyone else.
        ("grpc.so_reuseport", int(share_port)),
        *connection_age_options(config.max_connection_age_seconds),
        *connection_options(config, config.grpc_max_connections),
    ]


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port, requiring client certificates when a client CA is configured."""
    if not config.tls_enabled:
        return None
    client_ca = Path(config.tls_client_ca_file).read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key_file).read_bytes(), Path(config.tls_cert_file).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


# How long, once gRPC has stopped (and cancelled what still ran), the RPC threads get to leave the calls they
# were in: a computation is milliseconds; a thread stuck longer is logged and left (the threads are daemons).
POOL_STOP_SECONDS = 2.0


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
        """Stop taking calls, give those in flight ``grace`` seconds (None: none), then end the gate's threads."""
        if self.watch is not None:
            self.watch.stop()
        self.gate.end_waiting()  # calls that never sent their request do not hold the grace
        stopped, end = self.server.stop(grace), time.monotonic() + (grace or 0.0)
        while not stopped.wait(0.05) and time.monotonic() < end:
            if self.gate.idle():  # no call of ours left: what remains is connections that ignore the GOAWAY
                self.server.stop(0)
        stopped.wait()
        busy = self.gate.shutdown(POOL_STOP_SECONDS)
        if busy:
            log.warning("rpc_threads_still_busy count=%d after_seconds=%.1f", busy, POOL_STOP_SECONDS)
        self.watchdog.stop()
        self.reflection.close()


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
    gate = make_gate(config, Accounting(plane.metrics, plane.shed))
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
        plane.shed,
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
