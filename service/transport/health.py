"""grpc.health.v1 for this server: Check, List and Watch over a fixed set of names, with a drain that ends
every Watch stream.

Written here rather than taken from grpcio-health-checking because a drain must end the open Watch streams
(a client's health checking keeps one per connection; left open, each holds a SIGTERM for the whole grace), a
NotFound should say what is unknown, and a request that does not parse must be refused and counted here (grpcio's
own deserializer path for a unary-request, streaming-response method answers INTERNAL and then keeps the call for
good): the methods take bytes and parse them (shed ``undecodable``, INVALID_ARGUMENT). Every call reaches a thread
through the server's gate (service/transport/gate.py), only once its request is in.

Watch is non-blocking: an open stream holds no thread, and neither does a message on its way to a watcher: a
message is handed to gRPC core without waiting (service/adapters/grpcio.py's ``send_without_waiting``) and the next
one goes when core says the last is sent. A send still not done after ``send_timeout`` seconds cancels that stream
(counted, shed ``unread_response``). Open Watch streams are bounded: ``WATCH_STREAMS_PER_CONNECTION`` a connection,
``WATCH_STREAMS_PER_PEER`` a peer and ``WATCH_STREAMS`` in all (more are refused, shed ``stream_limit``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2

from indexer_service.service.adapters import grpcio
from indexer_service.service.overload.admission import DrainWatchdog, Watched
from indexer_service.service.reasons import ShedReason
from indexer_service.service.transport.gate import CallGate, Lane
from indexer_service.service.transport.streams import (
    WATCH_STREAMS_PER_CONNECTION,
    ShedFn,
    StreamSlots,
    parsed_or_refused,
)

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

SendResponse = Callable[[health_pb2.HealthCheckResponse | None], None]
SEND_TIMEOUT_SECONDS = 5.0
# Open Watch streams a peer (an address) may hold, and the process: far above a client's health checking (one or
# two names per connection, a client's few connections; a NAT's many clients), far below what would cost memory that
# matters (what a stream holds: docs/overload.md, "Long-lived streams: health Watch and reflection").
WATCH_STREAMS_PER_PEER = 256
WATCH_STREAMS = 2048


@dataclass(eq=False)
class _Watcher:
    """One Watch stream. gRPC allows one message in flight per stream, so one delivery at a time sends what is
    pending: the latest status (older ones are moot) and, last, the end of the stream (``send(None)``)."""

    send: SendResponse
    context: grpc.ServicerContext
    peer: str
    shed: ShedFn  # its port's
    # Where grpcio does not call Watch with a send callback: the stream's messages, taken by its generator.
    messages: queue.SimpleQueue | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: health_pb2.HealthCheckResponse | None = None
    end: bool = False
    delivering: bool = False


class HealthServicer:
    """Health of ``names`` ("" is the whole server); NOT_SERVING until :meth:`set_serving` says otherwise.
    :meth:`register` serves it on a gRPC server, through that server's gate, whose ``shed`` counts and logs the
    refusals of that server's calls (one servicer may serve two ports: the log has a line per reason and port)."""

    def __init__(self, names: Sequence[str], send_timeout: float = SEND_TIMEOUT_SECONDS) -> None:
        self._lock = threading.Lock()
        self._slots = StreamSlots(
            "health Watch streams", WATCH_STREAMS_PER_CONNECTION, WATCH_STREAMS, per_peer=WATCH_STREAMS_PER_PEER
        )
        self._status = dict.fromkeys(names, NOT_SERVING)
        self._watchers: dict[str, set[_Watcher]] = {name: set() for name in names}
        self._drained = False
        self._stuck_sends = DrainWatchdog(send_timeout)
        self._send_without_waiting = grpcio.features().send_without_waiting
        self.on_error: Callable[[str, BaseException], None] = lambda where, exc: log.exception("%s failed", where)
        # Deliveries to watchers: each quick where a send does not wait; where it does (the adapter's fallback),
        # a watcher that does not read holds one of these until its send is cancelled (send_timeout).
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="health")

    def register(self, server: grpc.Server, gate: CallGate, lane: Lane) -> None:
        """Check, List and Watch on ``server``, bytes in (parsed here), each routed by ``gate`` to ``lane`` and its
        refusals counted by ``gate.shed``."""
        shed = gate.shed
        check = grpc.unary_unary_rpc_method_handler(
            functools.partial(self._check, shed=shed),
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        listing = grpc.unary_unary_rpc_method_handler(
            functools.partial(self._list, shed=shed),
            response_serializer=health_pb2.HealthListResponse.SerializeToString,
        )
        watch = grpc.unary_stream_rpc_method_handler(
            grpcio.non_blocking(functools.partial(self._watch_stream, shed=shed)),
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
        for method, handler in (("Check", check), ("List", listing), ("Watch", watch)):
            behaviour = handler.unary_unary or handler.unary_stream
            gate.route(behaviour, method, lane, unary_request=True)
        server.add_registered_method_handlers(HEALTH_SERVICE_NAME, {"Check": check, "List": listing, "Watch": watch})
        self.on_error = gate.on_error

    @staticmethod
    def _parsed(message_type: type, raw: bytes, context: grpc.ServicerContext, method: str, shed: ShedFn) -> object:
        advice = f": send a grpc.health.v1 {message_type.__name__}"
        return parsed_or_refused(message_type, raw, context, method, shed, advice)

    def _unknown(self, service: str) -> str:
        known = ", ".join(repr(name) for name in self._status)
        return f"unknown service {service!r}: this server reports health for {known}"

    def _check(self, raw: bytes, context: grpc.ServicerContext, shed: ShedFn) -> health_pb2.HealthCheckResponse:
        request = self._parsed(health_pb2.HealthCheckRequest, raw, context, "Check", shed)
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.service))
        return health_pb2.HealthCheckResponse(status=status)

    def _list(self, raw: bytes, context: grpc.ServicerContext, shed: ShedFn) -> health_pb2.HealthListResponse:
        self._parsed(health_pb2.HealthListRequest, raw, context, "List", shed)
        with self._lock:
            statuses = dict(self._status)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()}
        )

    def _watch_stream(
        self, raw: bytes, context: grpc.ServicerContext, send_response: SendResponse | None = None, *, shed: ShedFn
    ) -> Iterator[health_pb2.HealthCheckResponse] | None:
        """Watch: returns at once, the stream's messages sent through ``send_response``; where grpcio gives no
        send callback (it does not read the non-blocking mark), a generator of the messages, which holds its
        thread while the stream is open."""
        request = self._parsed(health_pb2.HealthCheckRequest, raw, context, "Watch", shed)
        peer = self._slots.take_or_abort(context, shed, "Watch")
        if not context.add_callback(lambda: self._slots.give_back(peer)):  # the call has ended already
            self._slots.give_back(peer)
            return None
        messages = queue.SimpleQueue() if send_response is None else None
        send = messages.put if messages is not None else send_response
        service, watcher = request.service, _Watcher(send, context, peer, shed, messages)
        with self._lock:
            if self._drained:
                self._notify([watcher], health_pb2.HealthCheckResponse(status=NOT_SERVING), end=True)
                return None if messages is None else _drain_queue(messages)
            # The protocol's answer for a name it does not know is SERVICE_UNKNOWN, and the stream stays open.
            status = self._status.get(service, SERVICE_UNKNOWN)
            if service in self._watchers:
                self._watchers[service].add(watcher)
                context.add_callback(lambda: self._forget(service, watcher))
        self._notify([watcher], health_pb2.HealthCheckResponse(status=status))
        if messages is None:
            return None
        context.add_callback(lambda: messages.put(None))  # the stream ended: the generator stops
        return _drain_queue(messages)

    def _forget(self, service: str, watcher: _Watcher) -> None:
        with self._lock:
            self._watchers[service].discard(watcher)

    def set_serving(self, serving: bool, names: Sequence[str] | None = None) -> None:
        """``names`` (every name by default) SERVING or NOT_SERVING; watchers hear of a change. Ignored once
        drained."""
        status = SERVING if serving else NOT_SERVING
        with self._lock:
            if self._drained:
                return
            chosen = self._status if names is None else names
            changed = [name for name in chosen if self._status[name] != status]
            for name in changed:
                self._status[name] = status
            targets = [send for name in changed for send in self._watchers[name]]
        self._notify(targets, health_pb2.HealthCheckResponse(status=status))

    def drain(self) -> int:
        """NOT_SERVING for good, then end every Watch stream; returns how many were ended."""
        with self._lock:
            self._drained = True
            for name in self._status:
                self._status[name] = NOT_SERVING
            targets = [send for watchers in self._watchers.values() for send in watchers]
            for watchers in self._watchers.values():
                watchers.clear()
        self._notify(targets, health_pb2.HealthCheckResponse(status=NOT_SERVING), end=True)
        return len(targets)

    def _notify(self, targets: list[_Watcher], response: health_pb2.HealthCheckResponse, end: bool = False) -> None:
        for watcher in targets:
            with watcher.lock:
                watcher.pending = response
                watcher.end = watcher.end or end
                start = not watcher.delivering
                watcher.delivering = True
            if start:
                self._submit(watcher)

    def _deliver(self, watcher: _Watcher) -> None:
        """Send what is pending to one watcher: the latest status, handed to gRPC core without waiting (the next
        delivery starts when core has sent it), or, once nothing else is pending, the end of the stream."""
        with watcher.lock:
            response, end = watcher.pending, watcher.end
            watcher.pending = None
            if response is None:
                watcher.end = False
                if not end:
                    watcher.delivering = False
                    return
        if response is None:  # the end: a status, which grpcio sends without waiting
            try:
                watcher.send(None)
            except Exception:  # a stream that ended meanwhile
                log.debug("health watcher gone", exc_info=True)
            with watcher.lock:
                watcher.delivering = False
            return
        delivery = Watched()  # one message on its way: released once sent
        self._stuck_sends.watch(delivery, lambda: self._stuck(watcher))

        def sent() -> None:  # on gRPC's polling thread: hand the next delivery to the pool
            delivery.release()
            self._submit(watcher)

        if watcher.messages is not None or not self._send_without_waiting:  # grpcio's send: waits until sent
            try:
                watcher.send(response)
            except Exception:  # a stream that ended meanwhile
                log.debug("health watcher gone", exc_info=True)
            sent()
            return
        payload = response.SerializeToString()
        if not grpcio.send_without_waiting(watcher.context, payload, sent, self.on_error):
            sent()  # the stream has ended: the next delivery finds nothing to do, or only the end to send

    def _submit(self, watcher: _Watcher) -> None:
        with contextlib.suppress(RuntimeError):  # the pool is shut down: the server is stopping
            self.pool.submit(self._deliver, watcher)

    def _stuck(self, watcher: _Watcher) -> None:
        """A message not sent within ``send_timeout``: the watcher does not read (its window stays shut)."""
        watcher.shed(
            "Watch",
            ShedReason.UNREAD_RESPONSE,
            f"a health watcher of {watcher.peer} read nothing for {self._stuck_sends.seconds} s",
        )
        watcher.context.cancel()

    def close(self) -> None:
        self._stuck_sends.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _drain_queue(messages: queue.SimpleQueue) -> Iterator[object]:
    """The messages put on ``messages`` until None (the end of the stream, or the call ended)."""
    while (message := messages.get()) is not None:
        yield message
