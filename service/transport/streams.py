"""Long-lived streams (health Watch, server reflection) as a bounded resource: how many one connection may hold,
one peer (its address, whatever the port) and the process at once, with the refusal's message for the caller.

A connection is its peer address (``context.peer()``: address and port, one per connection). The per-connection
caps are far above what a real client needs (a client's health checking watches one or two names per
connection; grpcurl and grpcio's reflection client open one reflection stream per question) and far below
``max_streams_per_connection``, so one connection cannot make the server hold many, nor one peer's connections.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from indexer_service.service.reasons import ShedReason
from indexer_service.service.transport.gate import peer_key

ShedFn = Callable[[str, ShedReason, str], None]  # (method, reason, detail): DataPlane.shed

# Health Watch streams one connection may hold at once: one per name a client watches ("" and the service).
WATCH_STREAMS_PER_CONNECTION = 4
# Server reflection streams one connection may hold at once: 2, not 1, and a stream over it waits up to
# REFLECTION_LAG_SECONDS for one of its connection's streams to end, because a client that asks one question per
# stream (grpcio's ProtoReflectionDescriptorDatabase, as grpcurl's commands) opens its next stream as soon as it has
# the last answer, before the server's handler has returned and released the last stream's slot: with 1 and no
# wait, the standard Python client's second question is refused now and then; with 2 and no wait, on a loaded
# machine (a fresh clone's CI run), now and then its third.
REFLECTION_STREAMS_PER_CONNECTION = 2
REFLECTION_LAG_SECONDS = 0.5


class StreamSlots:
    """Open streams of one kind, per connection (at most ``per_connection``), per peer address (at most
    ``per_peer``, None: no cap beyond the connections') and in all (at most ``total``, None: no total beyond what
    the other caps allow). ``lag_seconds`` above 0: a stream over its connection's cap waits up to that long for one
    of the connection's streams to end before it is refused (a client that opens its next stream as the last one's
    answer arrives is ahead of the server's release); one such wait at a time in all, so waits hold at most one
    thread, and any other stream over a cap is refused at once."""

    def __init__(
        self,
        kind: str,
        per_connection: int,
        total: int | None = None,
        lag_seconds: float = 0.0,
        per_peer: int | None = None,
    ) -> None:
        self.kind, self.per_connection, self.total, self.per_peer = kind, per_connection, total, per_peer
        self.lag_seconds = lag_seconds
        self._lock = threading.Condition()  # notified by give_back while a stream waits
        self._by_peer: Counter[str] = Counter()
        self._by_address: Counter[str] = Counter()
        self.open = 0
        self._waiting = False

    def take(self, peer: str) -> str | None:
        """Take a slot for a stream of ``peer``: None when taken, else why not (the caller's error message)."""
        with self._lock:
            if self._by_peer[peer] >= self.per_connection and self.lag_seconds > 0 and not self._waiting:
                self._waiting = True
                try:
                    self._lock.wait_for(lambda: self._by_peer[peer] < self.per_connection, self.lag_seconds)
                finally:
                    self._waiting = False
            if self._by_peer[peer] >= self.per_connection:
                return f"{self.kind}: this connection already has {self.per_connection} open; close one first"
            address = peer_key(peer)
            if self.per_peer is not None and self._by_address[address] >= self.per_peer:
                return f"{self.kind}: this peer already has {self.per_peer} open; close some first"
            if self.total is not None and self.open >= self.total:
                return f"{self.kind}: {self.total} streams open on this server; retry later"
            self._by_peer[peer] += 1
            self._by_address[address] += 1
            self.open += 1
        return None

    def take_or_abort(self, context: grpc.ServicerContext, shed: ShedFn, method: str) -> str:
        """Take a slot for this call's connection and return its peer; over a cap, count the refusal (shed
        ``stream_limit``) and end the call RESOURCE_EXHAUSTED with why."""
        peer = context.peer()
        refused = self.take(peer)
        if refused is not None:
            shed(method, ShedReason.STREAM_LIMIT, f"{refused} ({peer})")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        return peer

    def give_back(self, peer: str) -> None:
        with self._lock:
            self.open -= 1
            for counts, key in ((self._by_peer, peer), (self._by_address, peer_key(peer))):
                counts[key] -= 1
                if counts[key] <= 0:
                    del counts[key]
            if self._waiting:
                self._lock.notify_all()


def parsed_or_refused(
    message_type: type, raw: bytes, context: grpc.ServicerContext, method: str, shed: ShedFn, advice: str = ""
) -> object:
    """``raw`` parsed as ``message_type``; a request that does not parse is counted (shed ``undecodable``, with the
    peer) and its call ended INVALID_ARGUMENT saying so, ``advice`` after it: grpcio's own deserializer would answer
    INTERNAL and, for a unary-stream method, keep the call."""
    try:
        return message_type.FromString(raw)
    except DecodeError:
        detail = f"a {message_type.DESCRIPTOR.name} that does not parse ({len(raw)} bytes)"
        shed(method, ShedReason.UNDECODABLE, f"{detail} from {context.peer()}")
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail + advice)
