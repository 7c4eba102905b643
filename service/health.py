"""grpc.health.v1 for this server: Check, List and Watch over a fixed set of names, with a drain that ends
every Watch stream.

Written here rather than taken from grpcio-health-checking because a drain must end the open Watch streams
(a client's health checking keeps one per connection; left open, each holds a SIGTERM for the whole grace)
and a NotFound should say what is unknown. Watch is non-blocking: an open stream holds no thread. Every
message to a watcher is sent from the health pool, never from the thread that changed the status, and a
send still blocked after ``send_timeout`` seconds (a watcher whose flow-control window stays shut) cancels
that stream, so a watcher that stops reading holds a pool thread for seconds, not forever.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.service.admission import DrainWatchdog

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

SendResponse = Callable[[health_pb2.HealthCheckResponse | None], None]
SEND_TIMEOUT_SECONDS = 5.0


@dataclass(eq=False)
class _Watcher:
    """One Watch stream. gRPC allows one message in flight per stream, so one delivery at a time sends what is
    pending: the latest status (older ones are moot) and, last, the end of the stream."""

    send: SendResponse
    context: grpc.ServicerContext
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: health_pb2.HealthCheckResponse | None = None
    end: bool = False
    delivering: bool = False


@dataclass(eq=False)
class _Delivery:
    """One message on its way to a watcher; ``released`` once sent (what the watchdog looks at)."""

    released: bool = False
    forget: Callable[[], None] | None = None


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Health of ``names`` ("" is the whole server); NOT_SERVING until :meth:`set_serving` says otherwise."""

    def __init__(self, names: Sequence[str], send_timeout: float = SEND_TIMEOUT_SECONDS) -> None:
        self._lock = threading.Lock()
        self._status = dict.fromkeys(names, NOT_SERVING)
        self._watchers: dict[str, set[_Watcher]] = {name: set() for name in names}
        self._drained = False
        self._stuck_sends = DrainWatchdog(send_timeout)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="health")
        # Check and List on threads of their own: a probe never waits behind RPC work, nor behind a watcher
        # whose send is stuck on the delivery pool.
        self.answer_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="health-check")
        # grpcio runs a behaviour on the pool its `experimental_thread_pool` names, and lets a streaming one
        # marked `experimental_non_blocking` return at once and send through the callback it is given. Set on
        # per-instance functions, not the class's: several servers in one process each keep their own pools.
        for name, pool, non_blocking in (("Check", self.answer_pool, False), ("List", self.answer_pool, False),
                                         ("Watch", self.pool, True)):  # fmt: skip
            setattr(self, name, _on_pool(getattr(self, name), pool, non_blocking))

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
        service, watcher = request.service, _Watcher(send_response, context)
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
                self.pool.submit(self._deliver, watcher)

    def _deliver(self, watcher: _Watcher) -> None:
        """Send what is pending to one watcher until nothing is; a send blocked too long cancels the stream."""
        while True:
            with watcher.lock:
                response, end = watcher.pending, watcher.end
                watcher.pending = None
                if response is None and not end:
                    watcher.delivering = False
                    return
                if end:
                    watcher.end = False
            delivery = _Delivery()
            self._stuck_sends.watch(delivery, watcher.context.cancel)
            try:
                if response is not None:
                    watcher.send(response)
                if end:
                    watcher.send(None)
            except Exception:  # a stream that ended meanwhile
                log.debug("health watcher gone", exc_info=True)
            finally:
                delivery.released = True
                if delivery.forget is not None:
                    delivery.forget()
            if end:
                with watcher.lock:
                    watcher.delivering = False
                return

    def close(self) -> None:
        self._stuck_sends.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.answer_pool.shutdown(wait=False, cancel_futures=True)


def _on_pool(method: Callable, pool: ThreadPoolExecutor, non_blocking: bool) -> Callable:
    def behaviour(*args: object) -> object:
        return method(*args)

    behaviour.experimental_thread_pool = pool
    behaviour.experimental_non_blocking = non_blocking
    return behaviour
