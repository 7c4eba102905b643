"""grpc.health.v1 for this server: Check, List and Watch over a fixed set of names, with a drain that ends
every Watch stream.

Written here rather than taken from grpcio-health-checking because a drain must end the open Watch streams
(a client's health checking keeps one per connection; left open, each holds a SIGTERM for the whole grace)
and a NotFound should say what is unknown. Watch is non-blocking: an open stream holds no thread, and neither
does a message on its way to a watcher. grpcio's sync server waits for each message's send to complete (the
peer's flow-control window open), so a watcher whose window stays shut would hold the sending thread; here a
message is handed to gRPC core without waiting (:func:`send_without_waiting`) and the next one goes when core
says the last is sent. A send still not done after ``send_timeout`` seconds cancels that stream (counted, shed
``unread_response``). One connection holds at most ``WATCH_STREAMS_PER_CONNECTION`` Watch streams (more are
refused, shed ``stream_limit``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc import _server as grpc_server_internals
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.service.overload.admission import DrainWatchdog, Watched
from indexer_service.service.reasons import ShedReason
from indexer_service.service.transport.receive import ReceiveAheadExecutor
from indexer_service.service.transport.streams import WATCH_STREAMS_PER_CONNECTION, ShedFn, StreamSlots, on_pool

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

SendResponse = Callable[[health_pb2.HealthCheckResponse | None], None]
SEND_TIMEOUT_SECONDS = 5.0


def send_without_waiting(context: grpc.ServicerContext, payload: bytes, on_sent: Callable[[], None]) -> bool:
    """Hand one serialized message of a server-streaming call to gRPC core and return at once; ``on_sent()`` runs
    (on gRPC's polling thread: it must not block) once core has sent it or the call ended. False when the call has
    already ended. At most one message may be on its way per call.

    grpcio's sync server offers only a send that waits for completion (``_send_response``); this is the same
    batch without the wait, on grpcio's own call state (``grpc._server``, grpcio 1.85: the same fields and
    helpers ``_send_response`` uses; named and checked at start in service/transport/grpcio_internals.py).
    tests/system/test_floods_streams_connections.py holds it to its promise against a real server."""
    internals = grpc_server_internals
    state, call = context._state, context._rpc_event.call
    with state.condition:
        if not internals._is_rpc_state_active(state):
            return False
        message = cygrpc.SendMessageOperation(payload, internals._get_send_message_op_flags_from_state(state))
        if state.initial_metadata_allowed:
            operations = (internals._get_initial_metadata_operation(state, None), message)
            state.initial_metadata_allowed = False
            token = internals._SEND_INITIAL_METADATA_AND_SEND_MESSAGE_TOKEN
        else:
            operations, token = (message,), internals._SEND_MESSAGE_TOKEN
        finish = internals._send_message(state, token)

        def sent(event: object) -> object:
            done = finish(event)  # the call's state, as grpcio's own send does
            on_sent()
            return done

        call.start_server_batch(operations, sent)
        state.due.add(token)
        state.disable_next_compression = False
    return True


@dataclass(eq=False)
class _Watcher:
    """One Watch stream. gRPC allows one message in flight per stream, so one delivery at a time sends what is
    pending: the latest status (older ones are moot) and, last, the end of the stream (``send(None)``)."""

    send: SendResponse
    context: grpc.ServicerContext
    peer: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: health_pb2.HealthCheckResponse | None = None
    end: bool = False
    delivering: bool = False


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Health of ``names`` ("" is the whole server); NOT_SERVING until :meth:`set_serving` says otherwise."""

    def __init__(self, names: Sequence[str], shed: ShedFn, send_timeout: float = SEND_TIMEOUT_SECONDS) -> None:
        self._lock = threading.Lock()
        self._shed = shed
        self._slots = StreamSlots("health Watch streams", WATCH_STREAMS_PER_CONNECTION)
        self._status = dict.fromkeys(names, NOT_SERVING)
        self._watchers: dict[str, set[_Watcher]] = {name: set() for name in names}
        self._drained = False
        self._stuck_sends = DrainWatchdog(send_timeout)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="health")
        # Check and List on threads of their own: a probe never waits behind RPC work, nor behind Watch streams
        # opening or their deliveries (each quick: nothing here waits for a send).
        # A call reaches them only once its request is in: two Checks that never send theirs held both threads, and
        # the kubelet's probes with them, until their caller left.
        self.answer_pool = ReceiveAheadExecutor(max_workers=2, thread_name_prefix="health-check")
        # grpcio runs a behaviour on the pool its `experimental_thread_pool` names, and lets a streaming one
        # marked `experimental_non_blocking` return at once and send through the callback it is given. Set on
        # per-instance functions, not the class's: several servers in one process each keep their own pools.
        for name, pool, non_blocking in (("Check", self.answer_pool, False), ("List", self.answer_pool, False),
                                         ("Watch", self.pool, True)):  # fmt: skip
            setattr(self, name, on_pool(getattr(self, name), pool, non_blocking))

    def _unknown(self, service: str) -> str:
        known = ", ".join(repr(name) for name in self._status)
        return f"unknown service {service!r}: this server reports health for {known}"

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext):
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.service))
        return health_pb2.HealthCheckResponse(status=status)

    def List(self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext):
        with self._lock:
            statuses = dict(self._status)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()}
        )

    def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext, send_response: SendResponse
    ) -> None:
        peer = self._slots.take_or_abort(context, self._shed, "Watch")
        if not context.add_callback(lambda: self._slots.give_back(peer)):  # the call has ended already
            self._slots.give_back(peer)
            return
        service, watcher = request.service, _Watcher(send_response, context, peer)
        with self._lock:
            if self._drained:
                self._notify([watcher], health_pb2.HealthCheckResponse(status=NOT_SERVING), end=True)
                return
            # The protocol's answer for a name it does not know is SERVICE_UNKNOWN, and the stream stays open.
            status = self._status.get(service, SERVICE_UNKNOWN)
            if service in self._watchers:
                self._watchers[service].add(watcher)
                context.add_callback(lambda: self._forget(service, watcher))
        self._notify([watcher], health_pb2.HealthCheckResponse(status=status))

    def _forget(self, service: str, watcher: _Watcher) -> None:
        with self._lock:
            self._watchers[service].discard(watcher)

    def set_serving(self, serving: bool) -> None:
        """Every name SERVING or NOT_SERVING; watchers hear of a change. Ignored once drained."""
        status = SERVING if serving else NOT_SERVING
        with self._lock:
            if self._drained:
                return
            changed = [name for name, old in self._status.items() if old != status]
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

        if not send_without_waiting(watcher.context, response.SerializeToString(), sent):
            sent()  # the stream has ended: the next delivery finds nothing to do, or only the end to send

    def _submit(self, watcher: _Watcher) -> None:
        with contextlib.suppress(RuntimeError):  # the pool is shut down: the server is stopping
            self.pool.submit(self._deliver, watcher)

    def _stuck(self, watcher: _Watcher) -> None:
        """A message not sent within ``send_timeout``: the watcher does not read (its window stays shut)."""
        self._shed(
            "Watch",
            ShedReason.UNREAD_RESPONSE,
            f"a health watcher of {watcher.peer} read nothing for {self._stuck_sends.seconds} s",
        )
        watcher.context.cancel()

    def close(self) -> None:
        self._stuck_sends.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.answer_pool.shutdown(wait=False, cancel_futures=True)
