"""What each call to the gRPC server runs: its caller (:class:`GrpcCaller`, over grpcio's call state), the one
behaviour of a call (:func:`served`: the data plane or a refusal, the request id, the span, the status, the answer
watched until it is read), PrefillMetadata's handlers and the answer to a method nobody serves.

Abuse and overload (docs/overload.md): every call on both gRPC ports passes :class:`~.gate.CallGate` (its request
in before it holds anything, a place in its lane, a share per peer); a call whose caller leaves before it starts is
counted as shed "queue_deadline"; an answer is held in the response budget until the call ends, and cancelled if its
caller has not read it within ``response_drain_seconds``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from indexer_service.service.adapters import grpcio
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.errors import Code, ServiceError, Shed, UnknownMethod
from indexer_service.service.observability.logs import NEW_REQUEST_IDS, REQUEST_ID, REQUEST_ID_HEADER, request_id_from
from indexer_service.service.observability.metrics import UNKNOWN_METHOD
from indexer_service.service.overload.admission import Caller, DrainWatchdog
from indexer_service.service.reasons import Port, ShedReason
from indexer_service.service.rpcs import RPCS
from indexer_service.service.transport.gate import CallGate, Lane, never_started_reason

log = logging.getLogger(__name__)

Behavior = Callable[[object, grpc.ServicerContext], object]
Metadata = tuple[tuple[str, str | bytes], ...]

# The data plane's outcomes as gRPC statuses: the one place this transport maps them (same names).
GRPC_STATUS: dict[Code, grpc.StatusCode] = {code: grpc.StatusCode[code.name] for code in Code}
# Read once: each read of an enum member through its class is a metaclass lookup, twice per call (docs/performance.md).
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
    caller's. ``open_calls``: the gate's set of calls gRPC has not ended, which holds this one from its making to
    :meth:`end`. :meth:`cancel_unread` is what the drain watchdog calls for an answer not read in time. ``open_call``
    reads and sets all that (service/adapters/grpcio.py: on grpcio's call state, or through the public methods)."""

    __slots__ = ("_context", "_method", "_open_calls", "_plane", "gone_at_start", "metadata")
    port = Port.GRPC

    def __init__(
        self,
        context: grpc.ServicerContext,
        plane: DataPlane,
        method: str,
        trailers: Metadata,
        open_calls: set[object],
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
        # In before end() is added: end() may run on gRPC's polling thread as soon as open_call has added it
        self._open_calls = open_calls
        open_calls.add(self)
        self.peer, self.deadline, self.metadata, ended = open_call(context, trailers, self.end)
        if ended:
            self.ended = True
            open_calls.discard(self)
        # A call that waited for a thread may start past its deadline or after its caller left.
        self.gone_at_start = self.gone()

    def end(self) -> None:
        self.ended = True
        self._open_calls.discard(self)
        ticket = self.ticket
        if ticket is not None:
            ticket.budget.give_back(ticket, None)  # Ticket.release, written out (docs/performance.md)

    def cancel_unread(self) -> None:
        ticket = self.ticket
        nbytes = 0 if ticket is None else ticket.nbytes
        self._plane.shed(self._method, ShedReason.UNREAD_RESPONSE, f"{nbytes} bytes unread by {self.peer}", self.port)
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
    starts is counted as shed by whose doing (:func:`~indexer_service.service.transport.gate.never_started_reason`:
    ``queue_deadline``, ``deadline_on_arrival`` or ``caller_cancelled``), its peer in the detail."""

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
            gate.shed(method, reason, message)  # the data plane never sees this call
            raise Shed(reason, message)

        return refuse

    never_started = {
        ShedReason.QUEUE_DEADLINE: "its deadline passed while it waited in the server",
        ShedReason.DEADLINE_ON_ARRIVAL: "its deadline had passed before its request was in",
        ShedReason.CALLER_CANCELLED: "its caller cancelled or reset it before it started",
    }
    gate.on_never_started = lambda method, reason, peer: gate.shed(method, reason, f"{never_started[reason]} ({peer})")
    wait_seconds, call_seconds = plane.metrics.call_wait_seconds, plane.metrics.call_seconds
    child = plane.metrics.child

    def timed(method: str, wait: float, total: float) -> None:
        child(wait_seconds, method).observe(wait)
        child(call_seconds, method).observe(total)

    gate.timed = timed
    refusals = {reason: refusal(reason) for reason in (ShedReason.CONCURRENCY, ShedReason.PEER_SHARE)}
    handlers = {}
    for method in RPCS:
        behavior = served(plane, method, plane.call, watchdog, gate)
        refusing = {reason: served(plane, method, refuse, watchdog, gate) for reason, refuse in refusals.items()}
        gate.route(behavior, method, lane, unary_request=True, refusing=refusing, count_never_started=True)
        handlers[method] = grpc.unary_unary_rpc_method_handler(behavior)  # no (de)serializers: bytes both ways
    return handlers


def served(
    plane: DataPlane,
    method: str,
    serve: Callable[..., bytes],
    watchdog: DrainWatchdog,
    gate: CallGate,
) -> Behavior:
    """The one behaviour of a call to this server (KServe's interceptors in one function: each wrapper is a Python
    frame per call; grpcio's own interceptor pipeline rebuilds its wrappers on every call): ``serve(method, request,
    caller=...)`` (the data plane's ``call``, or a refusal) with its caller, a :class:`GrpcCaller`, whose end is
    known from ``add_callback``; a caller already gone when the call starts (it waited for a thread past its
    deadline, or cancelled meanwhile) is shed without work, by whose doing (``queue_deadline``,
    ``deadline_on_arrival`` or ``caller_cancelled``); an answer's budget ticket is
    watched until the call ends and cancelled if unread within ``response_drain_seconds``. The data plane's error
    as its gRPC status: the data plane raises nothing else, whatever went wrong inside it is already an
    InternalError there (logged with its traceback). Each call's request id (the caller's ``x-request-id``
    metadata when it is a safe one, else a new one) in its log lines and returned in the trailing metadata; its
    span when tracing is on; a failure in the data plane's rate-limited log of failed calls (INTERNAL always), a
    success at DEBUG.

    Trailing, not initial, metadata: the trailers go out in the one batch that carries the answer and the
    status, where ``send_initial_metadata`` starts a batch of its own per call (one more completion on the
    polling thread), which costs server CPU and wall time on every call where the trailers cost nothing measurable
    (docs/performance.md; docs/service.md, "Request ids"). ``gate``: the server's pool, whose ``started`` flag the
    behaviour sets and whose ``open_calls`` holds each call until gRPC has ended it."""
    failed, tracer, watch = plane.failed_calls, plane.tracer, watchdog.watch_ticket
    started, open_calls = gate.started, gate.open_calls
    debug = log.isEnabledFor(logging.DEBUG)  # the level is set once, at start, before the server is made
    open_call = grpcio.call_opener()

    def behavior(request: object, context: grpc.ServicerContext) -> object:
        started.value = True  # the gate's flag, set inline (docs/performance.md)
        start = time.perf_counter()
        trailers: list[tuple[str, str]] = []  # the request id, once known; sent with the status
        call = GrpcCaller(context, plane, method, trailers, open_calls, open_call)
        supplied = None
        for key, value in call.metadata:  # a loop, not next() over a generator (docs/performance.md)
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
                plane.shed(method, reason, f"{gone.name} before the call started ({call.peer})", call.port)
                context.abort(GRPC_STATUS[gone], "the caller went away (cancelled, or past its deadline) first")
            response = serve(method, request, caller=call)
            if call.ticket is not None:  # held until the call ends (call.end); cancelled if unread meanwhile
                watch(call.ticket, call.cancel_unread)
            code = STATUS_OK  # known here: context.code() is not asked on the success path (docs/performance.md)
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

        return grpc.stream_stream_rpc_method_handler(served(plane, UNKNOWN_METHOD, refuse, self.watchdog, self.gate))
