"""The HTTP transport, plain ASGI on uvicorn, on two ports that serve different callers.

``http_port`` (:class:`ProbeApp`, always plaintext, for Prometheus and the probes):

- ``GET /livez``: 200 while the process runs, 503 with the reason while its RPC port is broken (no call finishing,
  or no answer, for 30 s: service/transport/port_watch.py), as the server-wide health name says.
- ``GET /readyz``: 200 once warmup has finished, 503 with the reason before that and while draining. With
  several workers, the replica's readiness, whichever worker answers (the supervisor's verdict, ``pod_not_ready``:
  enough workers ready, service/process/supervisor.py), so a worker warming up after a restart does not flip it.
- ``GET /metrics``: Prometheus exposition of the service's registry (with several workers: every worker's).
- Nothing else: an RPC posted here is 404 naming ``http_rpc_port`` (counted, ``rpc_on_metrics_port``).

``http_rpc_port`` (:class:`RpcApp`, with the gRPC port's TLS: HTTPS, and client certificates required under mutual
TLS, so a caller the gRPC port would refuse is refused here too; not bound with ``http_rpcs = false``):

- ``POST /indexer.v1.PrefillMetadata/<Method>``: the gRPC method's request message as the body, binary
  protobuf (``application/x-protobuf``, also the default without a content type) or the proto3 JSON mapping
  (``application/json``, read by service/transport/json_mapping.py); the response comes back in the same format. Any
  other content type is 415 naming the accepted ones. Same data plane, limits, metrics as gRPC; a request id
  (``x-request-id``) and, when tracing is on, a span per call, as on gRPC.
- A POST to any other path (not a probe's) is a call to a method the service does not have: 501
  ``UNIMPLEMENTED``, counted as method ``unknown`` and logged rate-limited, as gRPC answers it.

Every error on either port is JSON ``{"code", "message"}``: ``code`` is a google.rpc.Code name, the data plane's
own for a call that reached it (with the HTTP status google/api/http.proto's mapping gives it), else the one
:data:`TRANSPORT_ERROR_CODES` gives the HTTP status.

Limits (docs/overload.md), each port on its own, enforced by uvicorn's protocol as service/adapters/uvicorn_http.py
sets it up, which tells :class:`HttpConnectionEvents`: a request's head and trailers together
(``http_max_header_bytes``: 431 and close), the time a connection may sit without a request in progress or
take to send one (``http_idle_timeout_seconds``), and open connections (``http_max_connections``: 503 and
close). An answer is written in pieces; a caller that has not read it within ``response_drain_seconds`` loses
its connection, and the answer's memory comes back.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from google.protobuf import json_format
from prometheus_client import make_asgi_app

from indexer_service.service.adapters.uvicorn_http import ABORT_KEY, FEATURE, Connection
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.config import ServiceConfig
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.errors import (
    CallerGone,
    Code,
    InvalidArgument,
    LimitExceeded,
    ServiceError,
    Shed,
    UnknownMethod,
)
from indexer_service.service.observability.logs import (
    REQUEST_ID,
    REQUEST_ID_HEADER,
    LibraryCallbackErrors,
    RateLimitedLog,
    request_id_from,
)
from indexer_service.service.observability.metrics import UNKNOWN_METHOD, Metrics, exposition_registry
from indexer_service.service.overload.admission import SHED_LOG_INTERVAL_SECONDS, Caller
from indexer_service.service.overload.limits import max_request_bytes
from indexer_service.service.overload.peers import PortShares, peer_of_host
from indexer_service.service.reasons import HttpRefusal, Port, ShedReason
from indexer_service.service.rpcs import REQUEST_TYPES, RESPONSE_TYPES
from indexer_service.service.transport.json_mapping import message_from_json

log = logging.getLogger(__name__)

REQUEST_ID_HEADER_BYTES = REQUEST_ID_HEADER.encode()  # as ASGI carries header names

PROTOBUF = b"application/x-protobuf"
JSON = b"application/json"
ACCEPTED_TYPES = (PROTOBUF, JSON)
RPC_PATH_PREFIX = f"/{SERVICE_NAME}/"
PROBE_PATHS = ("/metrics", "/livez", "/readyz")
# ASGI's send: each message of the answer, awaited.
AsgiSend = Callable[[dict], Awaitable[None]]
# The data plane's outcomes as HTTP statuses, as in google/api/http.proto's mapping: the one place this transport
# maps them. The error body's "code" is the outcome's name, the same the gRPC caller sees.
HTTP_STATUS: dict[Code, int] = {
    Code.CANCELLED: 499,
    Code.INVALID_ARGUMENT: 400,
    Code.DEADLINE_EXCEEDED: 504,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.FAILED_PRECONDITION: 400,
    Code.UNIMPLEMENTED: 501,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
}
# The errors of the HTTP layer itself, before any call (no such path, wrong verb or content type, a head too large,
# too many connections): the google.rpc.Code name of each status, as grpc-gateway answers them.
TRANSPORT_ERROR_CODES: dict[int, str] = {
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    415: "INVALID_ARGUMENT",
    431: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
}
# Answers are written this much at a time: a reader that stops holds at most one piece in the socket buffer.
SEND_PIECE_BYTES = 2**20
# A JSON answer holds, at the peak of its encoding, the protobuf answer and several times its size more (the
# parsed message, the base64 strings, the text and its bytes; docs/performance.md): its budget ticket is taken
# for 5 bytes per answer byte, and shrinks to the text once encoded.
JSON_HELD_PER_ANSWER_BYTE = 5.0


def error_body(code: str, message: str) -> bytes:
    """The one JSON shape of every HTTP error, on both ports."""
    return json.dumps({"code": code, "message": message}).encode()


class HttpRefusals:
    """What the HTTP ports refuse, by reason (:class:`HttpRefusal`): counted in ``indexer_http_refused_total`` and
    logged rate-limited per reason and port (``http refused reason=... count=N port=... last=...``)."""

    def __init__(self, metrics: Metrics) -> None:
        self._counters = {reason: metrics.http_refused_total.labels(reason=reason) for reason in HttpRefusal}
        self._log = RateLimitedLog(log, SHED_LOG_INTERVAL_SECONDS)

    def count(self, reason: HttpRefusal) -> None:
        """Counted only: an idle connection closed after ``http_idle_timeout_seconds`` is how every keep-alive
        connection (Prometheus', say) ends, not worth a log line."""
        self._counters[reason].inc()

    def record(self, reason: HttpRefusal, detail: str, port: Port) -> None:
        self._counters[reason].inc()
        self._log.note("http refused", reason, detail, port=port)


class HttpConnectionEvents:
    """What one port's connections tell the transport (service/adapters/uvicorn_http.py's ``ConnectionEvents``):
    ``indexer_http_connections``; a refusal counted and logged by :class:`HttpRefusals`, with the JSON answer the
    protocol writes for it; an exception in the protocol's own code on the event loop, counted and logged as
    :class:`LibraryCallbackErrors` (``where="limited_protocol"``)."""

    def __init__(self, config: ServiceConfig, metrics: Metrics, refusals: HttpRefusals, port: Port) -> None:
        self.connections = metrics.http_connections  # both ports': each counts only its own against the limit
        self.refusals = refusals
        self.port = port
        self.shares: PortShares[Connection] = PortShares(config.max_connections_per_peer, config.http_max_connections)
        self.displaced = metrics.peer_cap.peer_connections_closed_total.labels(port=port)
        self._log = RateLimitedLog(log, SHED_LOG_INTERVAL_SECONDS)
        self.errors = LibraryCallbackErrors(log, metrics, SHED_LOG_INTERVAL_SECONDS)
        max_head, max_connections = config.http_max_header_bytes, config.http_max_connections
        self._answers = {
            HttpRefusal.HEADER_TOO_LARGE: (
                431,
                "Request Header Fields Too Large",
                f"request head and trailers above {max_head} bytes together (http_max_header_bytes)",
            ),
            HttpRefusal.TOO_MANY_CONNECTIONS: (
                503,
                "Service Unavailable",
                f"too many connections: {max_connections} open on this port (http_max_connections)",
            ),
            HttpRefusal.PEER_SHARE: (
                503,
                "Service Unavailable",
                f"too many connections from one peer: at most {config.max_connections_per_peer} on this port "
                "(max_connections_per_peer), fewer while many peers fill it",
            ),
        }

    def opened(self, connection: Connection, open_connections: int) -> HttpRefusal | None:
        peer = _peer_key(connection.address)
        taken, displaced = self.shares.admit(peer, connection, open_connections)
        if not taken:
            return HttpRefusal.PEER_SHARE
        self.connections.inc()
        if displaced is not None:  # the port is crowded: the latest of the peer most past its share makes room
            displaced.drop()
            self.displaced.inc()
            most = _peer_key(displaced.address) or "?"
            held = len(self.shares.held.get(most, ()))
            self._log.write(
                "displaced",
                lambda count, most=most, held=held: log.warning(
                    "port crowded: the latest connection of the peer most past its share closed to make room "
                    "port=%s peer=%s held=%d count=%d",
                    self.port,
                    most,
                    held,
                    count,
                ),
            )
        return None

    def closed(self, connection: Connection) -> None:
        self.shares.release(connection)
        self.connections.dec()

    def refused(self, reason: HttpRefusal, address: tuple | None) -> bytes:
        status, phrase, message = self._answers[reason]
        self.refusals.record(reason, f"{_peer_name(address)}: {message}", self.port)
        return _status_only(status, phrase, message)

    def timed_out(self) -> None:
        self.refusals.count(HttpRefusal.IDLE_TIMEOUT)

    def failed(self, callback: str, address: tuple | None, error: Exception) -> None:
        self.errors.record(FEATURE, error, f"step={callback} peer={_peer_name(address)} (connection dropped)")


class ProbeApp:
    """``http_port``: ``/metrics``, ``/livez``, ``/readyz``, nothing else. ``rpc_port``: where the RPCs over HTTP are
    (None: not served), for the 404 an RPC posted here gets."""

    def __init__(
        self,
        plane: DataPlane,
        rpc_port: int | None,
        refusals: HttpRefusals,
        pod_not_ready: Callable[[], str] | None = None,
    ) -> None:
        self.plane = plane
        self.refusals = refusals
        # Worker mode: why the replica is not ready ("" when it is), read from the supervisor.
        self.pod_not_ready = pod_not_ready
        self.metrics_app = make_asgi_app(registry=exposition_registry(plane.metrics.registry))
        if rpc_port is None:
            self.wrong_port = (
                "the RPCs over HTTP are off on this server (http_rpcs = false): call them over gRPC (grpc_port); "
                "this port (http_port) serves only GET /metrics, /livez and /readyz"
            )
        else:
            self.wrong_port = (
                f"the RPCs over HTTP are served on http_rpc_port ({rpc_port}), not here: this port (http_port) "
                "serves only GET /metrics, /livez and /readyz"
            )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, verb = scope["path"], scope["method"]
        if path in PROBE_PATHS and verb not in ("GET", "HEAD"):
            await reply_error(send, 405, f"{path} answers GET and HEAD only", [(b"allow", b"GET, HEAD")])
        elif path == "/metrics":
            await self.metrics_app(scope, receive, send)
        elif path == "/livez":  # the process runs and its RPC port is not broken (callers cannot turn it)
            readiness = self.plane.readiness
            broken = readiness.rpc_port_broken
            await _reply(send, 503 if broken else 200, f"{readiness.not_ready_reason() if broken else 'ok'}\n".encode())
        elif path == "/readyz":
            pod = self.pod_not_ready  # worker mode: the replica's readiness is the supervisor's verdict
            reason = pod() if pod is not None else self.plane.readiness.not_ready_reason()
            await _reply(send, 503 if reason else 200, f"{reason or 'ready'}\n".encode())
        elif path.startswith(RPC_PATH_PREFIX):
            self.refusals.record(HttpRefusal.RPC_ON_METRICS_PORT, f"{verb} {path} from {_peer(scope)}", Port.HTTP)
            await reply_error(send, 404, self.wrong_port)
        else:
            await reply_error(
                send, 404, f"no {path} here: this port (http_port) serves only GET /metrics, /livez and /readyz"
            )


class HttpCaller(Caller):
    """A call over HTTP as the data plane sees it: a :class:`Caller` of ``http_rpc_port``."""

    __slots__ = ()
    port = Port.HTTP_RPC


class RpcApp:
    """``http_rpc_port``: the RPCs as protobuf or JSON over HTTP, over one data plane. ``probe_port``: where
    ``/metrics`` and the probes are, for the 404 they get here."""

    def __init__(self, plane: DataPlane, probe_port: int, refusals: HttpRefusals) -> None:
        self.plane = plane
        self.refusals = refusals
        config = plane.config
        self.probe_port = probe_port
        self.max_body = max_request_bytes(config)
        # How much of a refused body is read and thrown away so its sender gets the answer (no memory kept).
        self.max_discard = config.max_message_bytes
        self.drain_seconds = config.response_drain_seconds
        self.max_in_flight = config.max_concurrent_rpcs
        self.in_flight = 0
        # The data plane is CPU-bound: it runs here, never on an event loop.
        self.executor = ThreadPoolExecutor(max_workers=config.grpc_workers, thread_name_prefix="http-rpc")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, verb = scope["path"], scope["method"]
        method = path[len(RPC_PATH_PREFIX) :] if path.startswith(RPC_PATH_PREFIX) else None
        if method in REQUEST_TYPES:
            if verb != "POST":
                await reply_error(send, 405, f"{path} takes POST of a request message", [(b"allow", b"POST")])
            else:
                await self._rpc(method, scope, receive, send)
        elif path in PROBE_PATHS:
            await reply_error(
                send, 404, f"{path} is served on http_port ({self.probe_port}), plaintext; this port serves the RPCs"
            )
        elif verb == "POST":  # a method the service does not have
            await self._rpc(UNKNOWN_METHOD, scope, receive, send)
        elif method is not None:
            await reply_error(send, 404, _no_such_method(path))
        else:
            await reply_error(send, 404, f"no {path} here: this port serves POST {RPC_PATH_PREFIX}<Method> only")

    async def _rpc(self, method: str, scope, receive, send) -> None:
        """One call: its request id (the caller's ``x-request-id`` when it is a safe one, else a new one) in its
        log lines and its answer's headers, its span when tracing is on, a failure in the rate-limited log."""
        start = time.perf_counter()
        content_type, supplied_id = PROTOBUF, None
        for name, value in scope["headers"]:  # the two a call reads; every header only for a span's context
            if name == b"content-type":
                content_type = value.split(b";", 1)[0].strip().lower()
            elif name == REQUEST_ID_HEADER_BYTES:
                supplied_id = value.decode("latin-1")
        request_id = request_id_from(supplied_id)
        REQUEST_ID.set(request_id)  # this request's task has a context of its own
        tracer = self.plane.tracer
        span = None
        if tracer is not None:
            headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
            span = tracer.start("http", method, request_id, headers)
        reply_headers = [(REQUEST_ID_HEADER_BYTES, request_id.encode())]
        code, details = "UNKNOWN", "the connection ended before the answer was sent"
        try:
            error = await self._serve_rpc(method, scope, receive, send, content_type, reply_headers)
            code, details = ("OK", "") if error is None else (error.code.name, error.message)
            if error is not None:
                milliseconds = (time.perf_counter() - start) * 1e3
                self.plane.failed_calls.record("http", method, code, details, _peer(scope), milliseconds)
        finally:
            if span is not None:
                tracer.end(span, code, details)

    async def _serve_rpc(
        self, method: str, scope, receive, send, content_type: bytes, reply_headers: list[tuple[bytes, bytes]]
    ) -> ServiceError | None:
        """The call's answer or error sent; the error returned (None: answered)."""
        if method == UNKNOWN_METHOD:
            self.plane.unknown_method()
            error = UnknownMethod(_no_such_method(scope["path"]))
            await _reply(send, HTTP_STATUS[error.code], error_body(error.code.name, error.message), reply_headers, JSON)
            return error
        if content_type not in ACCEPTED_TYPES:
            accepted = b", ".join(ACCEPTED_TYPES)
            text = f"content type {content_type.decode(errors='replace')!r} is not accepted; send {accepted.decode()}"
            await reply_error(send, 415, text, [(b"accept", accepted), *reply_headers])
            return InvalidArgument(text)  # for the log and the span: the call failed, as a 415
        caller = HttpCaller(_peer(scope), JSON_HELD_PER_ANSWER_BYTE if content_type == JSON else 1.0)
        close: list[tuple[bytes, bytes]] = []
        try:
            body, reusable = await _read_body(receive, self.max_body, self.max_discard)
            if not reusable:
                close.append((b"connection", b"close"))
            if body is None:
                message = f"body: above {self.max_body} bytes, more than a request at this server's limits can be"
                self.refusals.record(HttpRefusal.BODY_TOO_LARGE, f"{method} from {caller.peer}: {message}", caller.port)
                raise LimitExceeded(message)
            request = body
            if content_type == JSON:
                request = message_from_json(REQUEST_TYPES[method], body).SerializeToString()
            if self.in_flight >= self.max_in_flight:
                message = f"busy: {self.in_flight} HTTP calls in the server (max_concurrent_rpcs)"
                self.plane.shed(method, ShedReason.CONCURRENCY, message, caller.port)  # the data plane never saw it
                raise Shed(ShedReason.CONCURRENCY, message)
            self.in_flight += 1
            try:
                loop = asyncio.get_running_loop()
                # The executor's thread runs it in this task's context: the request id in its log lines.
                response = await loop.run_in_executor(
                    self.executor,
                    contextvars.copy_context().run,
                    self._answer,
                    method,
                    request,
                    caller,
                    content_type == JSON,
                )
            finally:
                self.in_flight -= 1
        except ServiceError as exc:
            body = error_body(exc.code.name, exc.message)
            await _reply(send, HTTP_STATUS[exc.code], body, [*close, *reply_headers], JSON)
            return exc
        try:
            await self._send_answer(method, scope, send, response, content_type, caller, reply_headers)
        finally:
            if caller.ticket is not None:
                caller.ticket.release()
        return None

    def _answer(self, method: str, request: bytes, caller: Caller, as_json: bool) -> bytes:
        """The data plane's answer, as JSON where asked: on the executor, since encoding a large answer as JSON
        (base64 of every array) is CPU work the event loop must not do."""
        response = self.plane.call(method, request, "body", caller)
        if not as_json:
            return response
        try:
            text = _to_json(method, response)
        except BaseException:  # out of memory at the encoding's peak, say: nothing will be sent
            if caller.ticket is not None:
                caller.ticket.release()
            raise
        ticket = caller.ticket
        if ticket is not None:
            ticket.budget.give_back(ticket, len(text))  # from the peak of the encoding down to the text that is sent
        return text

    async def _send_answer(
        self,
        method: str,
        scope,
        send,
        response: bytes,
        content_type: bytes,
        caller: Caller,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        """The answer in pieces, each waiting for the reader; past ``response_drain_seconds`` the connection is
        dropped and the call counted as shed ``unread_response``."""
        give_up = time.monotonic() + self.drain_seconds
        try:
            start = _start(send, 200, len(response), content_type, headers)
            await asyncio.wait_for(start, give_up - time.monotonic())
            view = memoryview(response)
            for offset in range(0, max(len(view), 1), SEND_PIECE_BYTES):  # an empty answer is one empty piece
                piece = bytes(view[offset : offset + SEND_PIECE_BYTES])
                more = offset + SEND_PIECE_BYTES < len(view)
                message = {"type": "http.response.body", "body": piece, "more_body": more}
                await asyncio.wait_for(send(message), max(give_up - time.monotonic(), 0))
        except TimeoutError:
            self.plane.shed(
                method, ShedReason.UNREAD_RESPONSE, f"{len(response)} bytes unread by {caller.peer}", caller.port
            )
            abort: Callable[[], None] | None = scope.get(ABORT_KEY)
            if abort is not None:
                abort()
                await asyncio.sleep(0)  # let the connection close before the app returns


def _no_such_method(path: str) -> str:
    name = path.removeprefix(RPC_PATH_PREFIX)[:200]
    return f"{SERVICE_NAME} has no method {name!r}; its methods are {', '.join(REQUEST_TYPES)}"


def _peer_key(address: tuple | None) -> str | None:
    """Whom a connection from ``address`` (a socket's peer name) counts against: :func:`peer_of_host`."""
    return peer_of_host(address[0]) if address else None


def _peer_name(address: tuple | None) -> str:
    """A caller's name in logs and for the response budget: ``http:host:port`` (one per connection)."""
    return f"http:{address[0]}:{address[1]}" if address else "http:unknown"


def _peer(scope) -> str:
    return _peer_name(scope.get("client"))


def _to_json(method: str, response: bytes) -> bytes:
    message = RESPONSE_TYPES[method].FromString(response)
    return json_format.MessageToJson(message, preserving_proto_field_name=False, indent=None).encode()


async def _read_body(receive, limit: int, discard_limit: int) -> tuple[bytes | None, bool]:
    """The whole request body, or None once it passes ``limit`` bytes; and whether the connection can carry
    another request. A body past the limit is read on and thrown away, up to ``discard_limit`` bytes (a
    client mid-way through sending it would otherwise see a broken pipe instead of the answer), and past that
    the connection must close. A connection that ends (or is refused) before the body does, within the limit, is
    :class:`CallerGone`: what came is no request."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if size <= limit:
                raise CallerGone(Code.CANCELLED, "the connection ended before the whole request arrived")
            return None, False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif chunks:
            chunks.clear()  # over the limit: keep nothing
        more = message.get("more_body", False)
        if size > limit + discard_limit:
            return None, not more
        if not more:
            return (b"".join(chunks) if size <= limit else None), True


async def _start(send, status: int, length: int, content_type: bytes, extra=None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(length).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def _reply(
    send,
    status: int,
    body: bytes,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    content_type: bytes = b"text/plain; charset=utf-8",
) -> None:
    await _start(send, status, len(body), content_type, extra_headers)
    await send({"type": "http.response.body", "body": body})


async def reply_error(
    send: AsgiSend, status: int, message: str, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An error of the HTTP layer itself (:data:`TRANSPORT_ERROR_CODES`), as JSON."""
    await _reply(send, status, error_body(TRANSPORT_ERROR_CODES[status], message), extra_headers, JSON)


def _status_only(status: int, reason: str, message: str) -> bytes:
    """A whole response written by the connection's protocol itself (a refusal), not by the app: the same JSON
    error."""
    body = error_body(TRANSPORT_ERROR_CODES[status], message)
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body
