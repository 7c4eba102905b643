"""Admission: what the server lets in when callers are many, heavy or hostile (docs/overload.md).

Two resources are bounded before any work starts, each with a short, deadline-bounded wait:

- **memory**: the bytes of responses the server holds (being built, queued, or sent but not yet read) stay
  under ``response_budget_bytes``. A connection already holding something may hold at most a quarter of it, so
  one reader that stops reading cannot take the budget from everyone else; a response is held until its
  transport has handed it over (gRPC: the call ended; HTTP: the last byte was written), and a watchdog
  cancels the ones not read within ``response_drain_seconds``.
- **CPU**: requests whose estimated cost is above ``heavy_request_bytes`` are computed ``heavy_lane_slots`` at
  a time, so heavy callers cannot take every thread from light ones.

Every refusal goes through :class:`ShedLog`: one counter series per reason and a rate-limited log line, so a
dashboard and the log both show shedding as it happens.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from indexer_service.service.errors import Code
from indexer_service.service.observability.logs import RateLimitedLog
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.overload import books
from indexer_service.service.overload.books import Ticket
from indexer_service.service.reasons import Port, ShedReason

log = logging.getLogger(__name__)

# A connection holding anything may hold at most this share of the budget.
CONNECTION_SHARE = 4
# Without a container memory limit (or above 2 GiB of it) the budget is this; else limit / 8.
DEFAULT_BUDGET_BYTES = 256 * 2**20
_LIMIT_FRACTION = 8
# Waiters re-check the caller (cancelled, deadline) this often.
_WAIT_SLICE_SECONDS = 0.05
# One log line per reason and port at most this often; the count covers everything shed in between.
SHED_LOG_INTERVAL_SECONDS = 10.0


def default_response_budget(memory_limit: int | None) -> int:
    """``response_budget_bytes = 0``: an eighth of the memory limit (the container's: service/process/cgroups.py), at
    most 256 MiB."""
    if memory_limit is None:
        return DEFAULT_BUDGET_BYTES
    return max(1, min(DEFAULT_BUDGET_BYTES, memory_limit // _LIMIT_FRACTION))


class Refused(Exception):
    """A call the server will not take now. ``reason`` says why (:class:`ShedReason`); ``gone`` is True when the
    caller left (cancelled or past its deadline) while it waited."""

    def __init__(self, reason: ShedReason, message: str, gone: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.gone = gone


class ShedLog:
    """Counts every shed call in ``indexer_requests_shed_total`` and logs it, rate-limited per reason and port
    (:class:`~indexer_service.service.observability.logs.RateLimitedLog`): ``shed reason=R count=N method=M port=P
    last=DETAIL``. ``port``: the name of the port the call came on (:class:`~indexer_service.service.reasons.Port`)."""

    def __init__(self, metrics: Metrics, interval: float = SHED_LOG_INTERVAL_SECONDS) -> None:
        self.metrics = metrics
        self.log = RateLimitedLog(log, interval)

    def record(self, method: str, reason: ShedReason, detail: str, port: str = "") -> None:
        self.metrics.child(self.metrics.requests_shed_total, method, reason).inc()
        self.log.note("shed", reason, detail, f"method={method}", port)

    def on(self, port: Port) -> Callable[[str, ShedReason, str], None]:
        """:meth:`record` for the calls of ``port``: what a port's gate and servicers are given."""
        return functools.partial(self.record, port=port)


@dataclass
class _Waiting:
    """How many threads wait in admission; the waiting room is bounded so waiters never take every thread."""

    limit: int
    count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def enter(self, reason: ShedReason) -> None:
        """One more waiter, or Refused (``reason``'s) when the room is full; :meth:`leave` when the wait is over."""
        with self.lock:
            if self.count >= self.limit:
                raise Refused(reason, f"busy: {self.count} calls already wait for admission; retry with backoff")
            self.count += 1

    def leave(self) -> None:
        with self.lock:
            self.count -= 1


class ResponseBudget:
    """The bytes of responses held at once, overall and per connection (see the module docstring): the books
    (service/overload/books.py: the rules and the tickets, compiled where built) and the wait for room around them."""

    def __init__(self, limit: int, metrics: Metrics, waiting: _Waiting, wait_seconds: float) -> None:
        self.limit = limit
        self.share = max(1, limit // CONNECTION_SHARE)
        self.metrics = metrics
        self.wait_seconds = wait_seconds
        self._waiting = waiting
        self._cond = threading.Condition(threading.Lock())  # the waits for room, notified by the books' give-backs
        compiled = books.load_compiled()
        make_books = books.PyBooks if compiled is None else compiled.Books
        # A ticket's give-backs are its books' (``ticket.budget.give_back``, as the transports call them).
        self.books = make_books(limit, self.share, metrics.response_bytes_held.set, self._notify)
        metrics.response_budget_bytes.set(limit)

    @property
    def held(self) -> int:
        return self.books.held

    def reserve(self, peer: str, nbytes: int, caller: Caller) -> Ticket:
        """``nbytes`` for ``peer`` when they fit (the server's budget, and the connection's share unless it holds
        nothing yet), waiting up to ``wait_seconds`` (never past the caller's deadline) for room. The call that need
        not wait (nearly all) is granted without the Condition: one compiled call."""
        if nbytes > self.limit:
            raise Refused(
                ShedReason.WORK_LIMIT,
                f"response: about {nbytes} bytes, above response_budget_bytes {self.limit}; send a smaller batch",
            )
        ticket = self.books.take(peer, nbytes)
        if ticket is not None:
            return ticket
        with self._cond:
            self._waiting.enter(ShedReason.MEMORY)
            # Counted before the next look, under the Condition: a give-back after that look notifies this wait.
            self.books.waiters += 1
            try:
                give_up = time.monotonic() + self.wait_seconds
                while (ticket := self.books.take(peer, nbytes)) is None:
                    try:
                        _wait(self._cond, give_up, caller, ShedReason.MEMORY, "")
                    except Refused as refused:
                        raise self._whose_refusal(peer, nbytes, refused) from None
                return ticket
            finally:
                self.books.waiters -= 1
                self._waiting.leave()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _whose_refusal(self, peer: str, nbytes: int, refused: Refused) -> Refused:
        """The refusal of a wait for room that ended (``refused``), by whose doing: the connection's own unread
        answers filling its share are its caller's (``connection_share``), however the wait ended; a full budget
        is the server's (``memory``); a caller that cancelled keeps its reason."""
        if refused.reason is ShedReason.CALLER_CANCELLED:
            return refused
        mine = self.books.peer_bytes(peer)
        if mine and mine + nbytes > self.share:
            return Refused(
                ShedReason.CONNECTION_SHARE,
                f"response: this connection already holds {mine} bytes of unsent responses; {nbytes} more would "
                f"pass its share {self.share} of response_budget_bytes; read the answers you have",
                gone=refused.gone,
            )
        if refused.gone:
            return refused
        return Refused(
            ShedReason.MEMORY,
            f"response: the server holds {self.books.held} bytes of responses and {nbytes} more would pass "
            f"response_budget_bytes {self.limit}; retry with backoff",
        )


class HeavyLane:
    """At most ``slots`` heavy requests computed at once: :meth:`acquire` a slot (or be refused), :meth:`release` it
    when the work is done (or hold it for a block: :meth:`slot`). The data plane takes a slot in the middle of a
    call and gives it back when the call returns, without a context manager: an ExitStack per call to hold it would
    cost Python frames on every call, heavy or not (docs/performance.md)."""

    def __init__(self, slots: int, waiting: _Waiting, wait_seconds: float) -> None:
        self.slots = slots
        self.wait_seconds = wait_seconds
        self._waiting = waiting
        self._cond = threading.Condition()
        self._busy = 0

    def acquire(self, caller: Caller) -> None:
        with self._cond:
            if self._busy >= self.slots:
                message = (
                    f"busy: {self.slots} heavy requests (estimated cost above heavy_request_bytes) are being "
                    "computed; retry with backoff or send smaller batches"
                )
                self._waiting.enter(ShedReason.HEAVY_LANE)
                try:
                    give_up = time.monotonic() + self.wait_seconds
                    while self._busy >= self.slots:
                        _wait(self._cond, give_up, caller, ShedReason.HEAVY_LANE, message)
                finally:
                    self._waiting.leave()
            self._busy += 1

    def release(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify()

    @contextmanager
    def slot(self, caller: Caller) -> Iterator[None]:
        """A slot held for the ``with`` block."""
        self.acquire(caller)
        try:
            yield
        finally:
            self.release()


class Caller:
    """Who a call is for, as its transport sees it: which connection (``peer``), whether the caller still waits
    (:meth:`gone` returns the :class:`~service.errors.Code` the call ends with once it has passed its ``deadline``,
    ``time.time()`` seconds, or ``ended``, set by a transport that learns the caller cancelled: DEADLINE_EXCEEDED or
    CANCELLED; a transport that cannot tell, as HTTP, leaves no deadline and never ends it), how many bytes the
    transport holds per byte of the protobuf answer until it is sent (``held_per_answer_byte``: 1 for protobuf;
    more for JSON, which holds the answer, the message parsed from it and its text at once), and, once the data plane
    has answered, the budget ``ticket`` of the answer: the transport releases it when the answer has been handed over.
    ``in_heavy_lane`` is the data plane's: whether the call holds a heavy-lane slot, given back when it returns.
    Slotted, one per call."""

    __slots__ = ("deadline", "ended", "held_per_answer_byte", "in_heavy_lane", "peer", "ticket")
    # The port's name, for the shed log's line per reason and port: each transport's own subclass sets its port,
    # a class attribute rather than a slot, so a call pays nothing for it.
    port: str = ""

    def __init__(self, peer: str = "local", held_per_answer_byte: float = 1.0) -> None:
        self.peer = peer
        self.held_per_answer_byte = held_per_answer_byte
        self.ticket: Ticket | None = None
        self.in_heavy_lane = False
        self.deadline = math.inf
        self.ended = False

    def gone(self) -> Code | None:
        """The deadline is read first: a transport may learn of an expiry late, as gRPC does under load."""
        if time.time() >= self.deadline:
            return Code.DEADLINE_EXCEEDED
        return Code.CANCELLED if self.ended else None

    def held_bytes(self, answer_bytes: int) -> int:
        """What an answer of ``answer_bytes`` protobuf bytes holds in the budget for this caller."""
        return math.ceil(answer_bytes * self.held_per_answer_byte)


def _wait(cond: threading.Condition, give_up: float, caller: Caller, reason: ShedReason, message: str) -> None:
    """One slice of a wait on ``cond``; raises :class:`Refused` once the wait is over or the caller has gone."""
    left = give_up - time.monotonic()
    if left <= 0:
        raise Refused(reason, message)
    why_gone = caller.gone()
    if why_gone is not None:  # its deadline passed while it waited here (overload), or its caller cancelled
        reason = ShedReason.CALLER_CANCELLED if why_gone is Code.CANCELLED else ShedReason.QUEUE_DEADLINE
        raise Refused(
            reason, f"the caller went away ({getattr(why_gone, 'name', why_gone)}) while the call waited", gone=True
        )
    cond.wait(min(left, _WAIT_SLICE_SECONDS))


class Admission:
    """The response budget and the heavy lane of one server, sharing one bounded waiting room."""

    def __init__(
        self,
        budget_bytes: int,
        heavy_request_bytes: int,
        heavy_lane_slots: int,
        wait_seconds: float,
        max_waiting: int,
        metrics: Metrics,
    ) -> None:
        waiting = _Waiting(max(1, max_waiting))
        self.heavy_request_bytes = heavy_request_bytes
        self.budget = ResponseBudget(budget_bytes, metrics, waiting, wait_seconds)
        self.lane = HeavyLane(heavy_lane_slots, waiting, wait_seconds)
        self.shed = ShedLog(metrics)


class Held(Protocol):
    """Something held until its caller has read it: a :class:`Ticket`, or a :class:`Watched` (a health message on
    its way, a reflection stream's wait for its next request). Its ``forget`` is set by :meth:`DrainWatchdog.watch`
    and must be called when it is released (a response budget's ticket watched by :meth:`DrainWatchdog.watch_ticket`
    is forgotten by its books instead)."""

    released: bool
    forget: Callable[[], None] | None


@dataclass(eq=False)
class Watched:
    """A :class:`Held` with nothing else to give back: :meth:`release` once it is over."""

    released: bool = False
    forget: Callable[[], None] | None = None

    def release(self) -> None:
        self.released = True
        if self.forget is not None:
            self.forget()


class DrainWatchdog:
    """Acts on responses their callers have not read within ``seconds`` (cancels them, in practice). One thread
    scans what is held now (a released one has dropped its entry at once, through ``forget`` or, for a budget
    ticket, its books; the scan drops any left): a watched call costs a dict entry, not a timer, and no lock: the
    entry's assignment and removal (a ticket's, by the books; another's, ``dict.pop`` called through a
    ``functools.partial``: no Python frame either way) are each one step under the GIL, and the scan reads a
    ``copy()`` of the dict, also one step, so it never iterates a dict another thread changes (a lock taken twice
    per call is a visible share of a small call's server CPU: docs/performance.md)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.scan_seconds = min(1.0, max(seconds / 4, 0.05))
        self._watched: dict[int, tuple[float, Held, Callable[[], None]]] = {}
        # watch_ticket(ticket, on_unread): :meth:`watch` for a response budget's ticket, whose release pops the entry
        # itself (service/overload/books.py): one compiled call per answer, no ``functools.partial`` made for it.
        compiled = books.load_compiled()
        watch = books.py_watch if compiled is None else compiled.watch
        self.watch_ticket: Callable[[Ticket, Callable[[], None]], None] = functools.partial(
            watch, self._watched, seconds
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-watchdog", daemon=True)
        self._thread.start()

    def watch(self, ticket: Held, on_unread: Callable[[], None]) -> None:
        """Call ``on_unread()`` if ``ticket`` is still held ``seconds`` from now. Its entry (and what
        ``on_unread`` refers to: a gRPC call, whose HTTP/2 stream counts against the connection's limit while
        referenced) goes as soon as the ticket is released. The entry holds the ticket, so its ``id`` names no
        other ticket while the entry exists."""
        key = id(ticket)
        self._watched[key] = (time.monotonic() + self.seconds, ticket, on_unread)
        ticket.forget = functools.partial(self._watched.pop, key, None)
        if ticket.released:  # released before ``forget`` was set: nobody else will call it
            ticket.forget()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.scan_seconds):
            self._scan(time.monotonic())

    def _scan(self, now: float) -> None:
        """Drop released entries, act on expired ones. A function of its own so that nothing it handled outlives
        it: a loop variable left in ``_run``'s frame would keep the last cancelled call, and gRPC core that call's
        unsent answer (up to 64 MiB resident until the next cancel)."""
        expired = [e for e in self._watched.copy().values() if e[1].released or e[0] <= now]
        for _, ticket, _ in expired:
            self._watched.pop(id(ticket), None)
        for _, ticket, on_unread in expired:
            if ticket.released:
                continue
            try:
                on_unread()
            except Exception:
                log.exception("cancelling an unread response failed")
