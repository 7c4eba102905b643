"""The gRPC transport: a thin servicer over the data plane, wrapped for access logs and error mapping; health
(overall and per service, also on a probe-only listener) and reflection.

Abuse and overload (docs/overload.md): each connection opens at most ``max_streams_per_connection`` calls; a
request message is at most what a valid request at the configured limits can be; past ``max_concurrent_rpcs`` a
call is refused before it takes an RPC thread, on a refusal pool of its own (counted here as shed "concurrency"),
as is a call to a method the server does not have; a call whose caller leaves before it starts is counted as shed
"queue_deadline" (a stream reset flood shows there); an answer is held in the response budget until the call ends,
and cancelled if its caller has not read it within ``response_drain_seconds``.

The server is the sync ``grpc.server`` with a thread pool, not ``grpc.aio``: the work is CPU-bound numpy (or a
GPU launch) and, measured on the target machines, the sync server answered a medium request in 486 us against
571 us for aio and sustained 3.3k against 1.8k calls/s (docs/spec.md, section 10).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.service.addresses import host_port
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.config import ServiceConfig
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.errors import Code, ServiceError, Shed, UnknownMethod
from indexer_service.service.logs import NEW_REQUEST_IDS, REQUEST_ID, REQUEST_ID_HEADER, request_id_from
from indexer_service.service.metrics import UNKNOWN_METHOD
from indexer_service.service.overload.admission import Caller, DrainWatchdog
from indexer_service.service.overload.limits import max_request_bytes
from indexer_service.service.reasons import ShedReason
from indexer_service.service.rpcs import RPCS
from indexer_service.service.transport.health import HealthServicer
from indexer_service.service.transport.receive import receive_ahead, without_request
from indexer_service.service.transport.reflection import Reflection

log = logging.getLogger(__name__)

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
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
    waits is known without asking gRPC each time (``is_active()`` takes the call's lock and is three Python frames; a
    build asks twice): the ``deadline`` is read once, and :meth:`end`, added to the call's callbacks here, runs when
    the call is over, answered or not (gRPC runs the callbacks once the call has ended, on its polling thread: a
    cancel, an expiry, or after the status is sent). While the behaviour runs, the call can only end by its caller
    cancelling or its deadline passing, so ``ended`` then means CANCELLED (or DEADLINE_EXCEEDED: :meth:`gone` reads
    the deadline first). :meth:`end` also releases the answer's budget ticket, so one callback per call does both; a
    ticket granted after :meth:`end` ran is released by the data plane, whose last look at the caller after the
    reservation then sees ``ended``. ``trailers``: the call's trailing metadata, set with the callback under the
    call's lock. ``gone_at_start``: what :meth:`gone` said when the caller was made. :meth:`cancel_unread` is what the
    drain watchdog calls for an answer not read in time.

    The call's own state in grpcio (``grpc._server``'s ``_Context`` and ``_RPCState``, grpcio 1.85, as
    service/transport/health.py uses them; named and checked at start in service/transport/grpcio_internals.py) is
    read and written as its public methods do (``peer()``, ``time_remaining()``, ``set_trailing_metadata()``,
    ``add_callback()``): those were ten Python frames per call, ~6 us of a lone small call (benchmarks/RESULTS.md,
    issue 20). tests/service/test_grpc_caller.py holds this to the public methods against a real server."""

    __slots__ = ("_context", "_method", "_plane", "gone_at_start")

    def __init__(self, context: grpc.ServicerContext, plane: DataPlane, method: str, trailers: Metadata) -> None:
        # Caller's fields set here rather than by its __init__, a frame fewer per call (the tests hold the two equal)
        self.held_per_answer_byte = 1.0
        self.ticket = None
        self.in_heavy_lane = False
        call = context._rpc_event
        self.peer = call.call.peer().decode("utf8", "replace")
        self.deadline = deadline = call.call_details.deadline  # time.time() seconds (no deadline: ~9.2e18)
        self._context = context
        self._plane = plane
        self._method = method
        # False before end() can run: end() only ever sets it True, and a cancel that ends the call as soon as the lock
        # is released must not be overwritten by this reading (the answer's ticket would then never be released)
        self.ended = False
        state = context._state
        state.condition.acquire()  # the call's lock, as grpcio's own methods take it
        try:
            state.trailing_metadata = trailers
            callbacks = state.callbacks  # None: the call has already ended
            if callbacks is not None:
                callbacks.append(self.end)
        finally:
            state.condition.release()
        if callbacks is None:
            self.ended = True
        # What gone() says now, from what was just read (not by calling it: a frame fewer per call): a call that
        # waited for a thread may start past its deadline or after its caller left.
        self.gone_at_start = (
            Code.DEADLINE_EXCEEDED if time.time() >= deadline else Code.CANCELLED if self.ended else None
        )

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


class CallDone(list):
    """What :meth:`RpcThreadPool.submit` returns for a call: grpcio asks of it only ``add_done_callback`` (its
    callback counts the call out of the server's active calls), never a result or an exception, so it is not a
    ``concurrent.futures.Future`` (a ``Condition`` per call, notified on completion). The list of the callbacks not
    yet run, itself (made without a Python frame); ``done`` once the call has ended. grpcio tests what ``submit``
    returned with ``is not None``, never by its truth (an empty list is false) nor as a key (a list has no hash).

    No lock: whichever of :meth:`add_done_callback` (the polling thread) and :meth:`finish` (the pool thread) comes
    second runs the callbacks, and ``list.pop`` (one step, atomic) hands each to exactly one of them: ``done`` is
    set before the finishing thread looks at the list, and a callback is appended before the adding thread looks
    at ``done``, so none is left behind."""

    done = False

    def add_done_callback(self, fn: Callable[[CallDone], object]) -> None:
        self.append(fn)
        if self.done:
            self.finish()

    def finish(self) -> None:
        self.done = True
        while self:  # tested first: the usual end, an empty list, costs no IndexError raised and caught per call
            try:
                fn = self.pop()
            except IndexError:  # the other thread took the last one between the test and the pop
                return
            try:
                fn(self)
            except Exception:
                log.exception("a call's completion callback failed")


class RpcThreadPool:
    """The gRPC server's pool for the RPCs: ``workers`` threads taking calls from one queue, a unary call only once
    its request message is in (:func:`receive_ahead`). It counts the calls it holds (receiving their request, queued
    or running) and refuses past ``max_calls`` (``max_concurrent_rpcs``): such a call runs on a small pool of its
    own (``refusals``) with its behaviour swapped for the method's refusing one, so it is counted (shed
    ``concurrency``), answered RESOURCE_EXHAUSTED, and never waits behind RPC work or for its request. It also
    notices calls that end without their behaviour ever starting: the caller cancelled, reset the stream or passed
    its deadline while the call waited for its request or a thread, or half-closed without a request. gRPC submits
    each call with its handler's behaviour among the arguments; :meth:`watch` names the behaviours (and their
    refusing twins), and each behaviour sets ``started.value`` (this thread's) when it starts. grpcio's own
    ``maximum_concurrent_rpcs`` is not used: it counts every call (health too) and refuses without a trace.

    Not a ``ThreadPoolExecutor``: grpcio only submits to its server's pool and adds one callback to what it gets
    back, and the executor's machinery per call (a ``Future`` with its ``Condition``, a work item, the idle
    semaphore, the check for more threads) was a fifth of the service's server CPU per small call beyond a
    plain gRPC echo's (benchmarks/RESULTS.md, issue 20). The threads start at once and are daemons; :meth:`shutdown`
    ends them once the server has stopped. No lock per call: a call is an entry in ``live`` from submit to its end,
    and a dict's item assignment, deletion and ``len`` are each one step under the GIL. The arguments are searched
    for the behaviour only for a call that is refused or never started. An exception that escapes a call (grpcio's
    own wrappers catch the behaviour's) is logged, never silently dropped, and the thread goes on."""

    def __init__(self, workers: int, max_calls: int) -> None:
        self.max_calls = max_calls
        self._queue: SimpleQueue[tuple[int, Callable, tuple, CallDone] | None] = SimpleQueue()
        self._ids = itertools.count()
        # The calls it holds, receiving, queued or running (their number read with ``len``: no method per call).
        self.live: dict[int, None] = {}
        # Each watched behaviour's method and refusing twin.
        self._watched: dict[Callable, tuple[str, Callable]] = {}
        self.refusals = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-refuse")
        # Per thread: whether the call the thread runs has started its behaviour (each behaviour sets ``value``).
        self.started = threading.local()
        self.on_never_started: Callable[[str], None] = lambda method: None
        self._threads = [threading.Thread(target=self._work, name=f"grpc_{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def watch(self, behavior: Callable, method: str, refusing: Callable) -> None:
        """Calls of ``behavior`` (``method``'s) are counted; past ``max_calls`` they get ``refusing`` instead."""
        self._watched[behavior] = (method, refusing)

    def submit(self, fn: Callable, /, *args: object) -> CallDone | Future:
        if len(self.live) >= self.max_calls:
            i = self._behavior_at(args)
            if i is not None:
                refusing = self._watched[args[i]][1]
                return self.refusals.submit(fn, *without_request((*args[:i], refusing, *args[i + 1 :])))
        call = next(self._ids)
        self.live[call] = None
        done = CallDone()
        put = self._queue.put
        if not receive_ahead(args, lambda received: put((call, fn, received, done))):
            put((call, fn, args, done))
        return done

    def shutdown(self, timeout: float) -> int:
        """Stop each thread once the calls queued before this are done (the server has stopped, so gRPC has
        already ended them: each is counted as never started, or sees its caller gone at once); wait up to
        ``timeout`` seconds in all. Returns how many threads were still busy when the wait ended."""
        self.refusals.shutdown(wait=False)
        for _ in self._threads:
            self._queue.put(None)
        end = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        return sum(thread.is_alive() for thread in self._threads)

    def _behavior_at(self, args: tuple) -> int | None:
        """Where among grpcio's arguments for a call its watched behaviour is (None: it has none, health say)."""
        return next((i for i, arg in enumerate(args) if callable(arg) and arg in self._watched), None)

    def _work(self) -> None:
        take, live, started = self._queue.get, self.live, self.started
        while (item := take()) is not None:
            call, fn, args, done = item
            started.value = False
            try:
                fn(*args)
            except BaseException:
                log.exception("a gRPC call's handler raised past gRPC's own handling")
            finally:
                del live[call]
                if not started.value:
                    i = self._behavior_at(args)
                    if i is not None:
                        self.on_never_started(self._watched[args[i]][0])
                done.finish()


def rpc_handlers(plane: DataPlane, pool: RpcThreadPool, watchdog: DrainWatchdog) -> dict[str, grpc.RpcMethodHandler]:
    """PrefillMetadata's methods by name, registered with gRPC as such (``add_registered_method_handlers``: gRPC
    core matches a call's path, where a generic handler is asked in Python on every call), bytes in and bytes out:
    the data plane parses requests (grpcio's own deserializer would answer undecodable bytes with INTERNAL and a
    traceback, where the caller deserves INVALID_ARGUMENT, as over HTTP) and answers with wire bytes written from
    the result arrays (one copy, see service/codec.py). Each method's behaviour is the data plane's ``call`` in
    :func:`served`; its refusing twin, which the pool runs past ``max_concurrent_rpcs``, is counted as shed
    ``concurrency``. A call that ends before it starts is counted as shed ``queue_deadline``."""
    limit = pool.max_calls

    def refuse(method: str, request: object, caller: Caller) -> bytes:
        message = f"busy: {len(pool.live)} calls in the server (max_concurrent_rpcs {limit}); retry with backoff"
        plane.shed(method, ShedReason.CONCURRENCY, message)  # the data plane never sees this call
        raise Shed(ShedReason.CONCURRENCY, message)

    never_started = "the caller cancelled, reset the stream or passed its deadline before the call started"
    pool.on_never_started = lambda method: plane.shed(method, ShedReason.QUEUE_DEADLINE, never_started)
    handlers = {}
    for method in RPCS:
        behavior = served(plane, method, plane.call, watchdog, pool.started)
        pool.watch(behavior, method, served(plane, method, refuse, watchdog, pool.started))
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

    def behavior(request: object, context: grpc.ServicerContext) -> object:
        started.value = True  # RpcThreadPool's flag, set here rather than by a method: a frame fewer
        start = time.perf_counter()
        metadata = context._rpc_event.invocation_metadata  # invocation_metadata() without its frame (GrpcCaller)
        supplied = None
        for key, value in metadata:  # a loop, not next() over a generator: half the cost
            if key == REQUEST_ID_HEADER:
                supplied = value
                break
        request_id = next(NEW_REQUEST_IDS) if supplied is None else request_id_from(supplied)
        token = REQUEST_ID.set(request_id)
        span = None if tracer is None else tracer.start("grpc", method, request_id, dict(metadata))
        code = None
        try:
            call = GrpcCaller(context, plane, method, ((REQUEST_ID_HEADER, request_id),))
            gone = call.gone_at_start
            if gone is not None:
                plane.shed(method, ShedReason.QUEUE_DEADLINE, f"{gone.name} before the call started")
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
    names its own method. The refusal runs on ``pool`` (the RPC pool's ``refusals``), never on the RPC pool: a
    flood of unknown methods then neither takes the RPC threads nor counts against ``max_concurrent_rpcs``, so it
    cannot get other callers' calls shed as ``concurrency``."""

    def __init__(self, plane: DataPlane, pool: ThreadPoolExecutor, watchdog: DrainWatchdog) -> None:
        self.plane = plane
        self.pool = pool
        self.watchdog = watchdog
        self.started = threading.local()  # not the RPC pool's: these calls never run there

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        plane, name = self.plane, handler_call_details.method

        def refuse(method: str, requests: object, caller: Caller) -> object:
            plane.unknown_method()
            raise UnknownMethod(f"unknown method {name[:200]!r}: this server has {SERVICE_NAME}'s {', '.join(RPCS)}")

        refusing = served(plane, UNKNOWN_METHOD, refuse, self.watchdog, self.started)
        refusing.experimental_thread_pool = self.pool  # grpcio runs a behaviour on the pool it names
        return grpc.stream_stream_rpc_method_handler(refusing)


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


@dataclass
class GrpcServer:
    """The RPC server and its parts that outlive start-up (the RPC pool, the drain watchdog and reflection stop
    with it)."""

    server: grpc.Server
    port: int
    pool: RpcThreadPool
    watchdog: DrainWatchdog
    reflection: Reflection

    def stop(self, grace: float) -> None:
        self.server.stop(grace).wait()
        busy = self.pool.shutdown(POOL_STOP_SECONDS)
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
) -> GrpcServer:
    """The RPC server, bound (and, as gRPC binds, listening: it takes connections into its backlog from here on)
    but not started. ``share_port``: SO_REUSEPORT, for a worker of several; ``probe_socket``: a unix socket the
    server also listens on, plaintext, for the supervisor's health probes (service/process/supervisor.py)."""
    pool = RpcThreadPool(config.grpc_workers, config.max_concurrent_rpcs)
    server = grpc.server(
        pool,  # not a ThreadPoolExecutor, though grpcio names one: it only submits to it (see RpcThreadPool)
        # No maximum_concurrent_rpcs: the pool refuses past max_concurrent_rpcs itself, counted, and health is
        # never refused.
        options=server_options(config, share_port),
    )
    watchdog = DrainWatchdog(config.response_drain_seconds)
    server.add_registered_method_handlers(SERVICE_NAME, rpc_handlers(plane, pool, watchdog))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection = Reflection(
        (SERVICE_NAME, HEALTH_SERVICE_NAME), config.reflection_max_streams, config.reflection_idle_seconds, plane.shed
    )
    server.add_generic_rpc_handlers(reflection.handlers)
    unknown = UnknownMethodHandler(plane, pool.refusals, watchdog)
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
    return GrpcServer(server, port, pool, watchdog, reflection)


def create_health_server(config: ServiceConfig, health_servicer: HealthServicer) -> tuple[grpc.Server, int]:
    """The probe listener: grpc.health.v1 only, plaintext (kubelet's gRPC probes speak no TLS), its own small
    pool and no concurrency limit, so a probe never waits behind RPC work, its limit or its connections; its own
    cap on connections (``health_max_connections``) and the same idle and handshake bounds as the RPC port."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=2, thread_name_prefix="health-rpc"),
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 4096),
            *connection_options(config, config.health_max_connections),
        ],
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = host_port(config.grpc_host, config.health_port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind the gRPC health port to {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind the gRPC health port to {address}")
    return server, port
