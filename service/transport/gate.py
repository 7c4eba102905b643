"""The one gate every gRPC call passes, on every gRPC port: a server's only thread pool.

grpcio submits each call to its server's pool with the behaviour it will run among the arguments
(service/adapters/grpcio.py reads them). The gate finds the call's :class:`Route` by that behaviour (the method,
its lane, whether it has one request message) and then, whatever the port, servicer or method type:

1. A call with one request message is not given anything until its request is in: its receive starts on gRPC's
   polling thread and the call waits there, holding no thread and no place. It may wait ``request_seconds`` at
   most (then it is ended DEADLINE_EXCEEDED, shed ``request_timeout``); one peer may have at most its lane's
   ``peer_share`` calls waiting (more are refused at once, shed ``peer_share``).
2. Once its request is in (a streaming call: at once), the call takes a place in its lane: at most ``places`` in
   all and ``peer_share`` from one peer (an IPv4 address, an IPv6 /64) are queued or running. Past either it is
   refused at once, on the refusal threads, by its route's refusing behaviour (shed ``concurrency`` or
   ``peer_share``, RESOURCE_EXHAUSTED); other peers' calls are served.
3. The lane's threads run it. A call that ends before its behaviour starts (its caller cancelled, reset the stream
   or passed its deadline while it waited) is reported with its method (``on_never_started``).

A behaviour the gate has no route for (a method nobody serves: UnknownMethodHandler's per-call refusals) runs on
the refusal lane. Every refusal is counted with its reason and logged rate-limited by the ``shed`` function the
server gives (the data plane's). Code of ours that runs on gRPC's polling thread is guarded: an exception there
is counted and logged (``on_error``), never the end of that thread.

Where grpcio's internals differ (service/adapters/grpcio.py's ``receive_ahead`` off), every call takes its place
and thread as grpcio submits it, the route found by searching the arguments, and per-peer shares are not applied
(the peer is not known before the call starts); the fallback is announced.

Not a ``ThreadPoolExecutor``: grpcio only submits to its server's pool and adds one callback to what it gets back;
the executor's machinery per call (a ``Future`` with its ``Condition``, a work item, the idle semaphore) costs
CPU a call (docs/performance.md). No lock per call on the RPC path: a dict's item assignment, deletion and ``len``
are each one step under the GIL, and the per-peer counts are a ``collections.Counter`` changed under one lock only
where a share is set.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import SimpleQueue

from indexer_service.service.adapters import grpcio
from indexer_service.service.observability.logs import LibraryCallbackErrors
from indexer_service.service.observability.metrics import UNKNOWN_METHOD
from indexer_service.service.overload.admission import SHED_LOG_INTERVAL_SECONDS
from indexer_service.service.overload.peers import peer_of_host
from indexer_service.service.reasons import ShedReason

log = logging.getLogger(__name__)

ShedFn = Callable[[str, ShedReason, str], None]  # (method, reason, detail): DataPlane.shed
ErrorFn = Callable[[str, BaseException], None]  # (where, exception)
# How often waiting calls are checked against request_seconds.
_SWEEP_SECONDS = 0.5


@functools.lru_cache(maxsize=8192)
def peer_key(peer: str) -> str:
    """The peer a share is kept for, from gRPC's ``ipv4:ADDR:PORT`` / ``ipv6:[ADDR]:PORT``: the address (an IPv6
    /64, as the per-peer connection cap counts), the port dropped; anything else (``unix:``) as it is."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    key = peer_of_host(rest.rpartition(":")[0].strip("[]"))
    return peer if key is None else key


# A deadline this close after its request was in is its caller's doing: gRPC core keeps deadlines to the millisecond
# (a 1 us budget arrives as up to a millisecond), and no server answers within a few.
ON_ARRIVAL_SECONDS = 0.005


def never_started_reason(deadline: float | None, queued_at: float, now: float | None = None) -> ShedReason:
    """Why a call ended before its behaviour started, and whose doing it was: its deadline passed while it waited in
    the server (``queue_deadline``, overload), its deadline had passed before its request was in or came within
    ``ON_ARRIVAL_SECONDS`` of it (``deadline_on_arrival``, its caller's), or its caller cancelled or reset it
    (``caller_cancelled``). Without the deadline (grpcio's internals differ): ``queue_deadline``."""
    if deadline is None:
        return ShedReason.QUEUE_DEADLINE
    if deadline > (time.time() if now is None else now):
        return ShedReason.CALLER_CANCELLED
    on_arrival = deadline <= queued_at + ON_ARRIVAL_SECONDS
    return ShedReason.DEADLINE_ON_ARRIVAL if on_arrival else ShedReason.QUEUE_DEADLINE


class Accounting:
    """What a gate counts and logs beyond its sheds, on a metrics object of the process (the serving process's, or
    the supervisor's for its health port): exceptions of our code on a library's thread (counted by where, logged
    with the traceback at most once per where and interval) and calls to methods nobody serves."""

    def __init__(self, metrics: object, shed: ShedFn) -> None:
        self.metrics = metrics
        self.shed = shed
        self.thread_error = LibraryCallbackErrors(log, metrics, SHED_LOG_INTERVAL_SECONDS).record

    def unknown_method(self) -> None:
        self.metrics.child(self.metrics.request_errors_total, UNKNOWN_METHOD, "UNIMPLEMENTED").inc()


class CallDone(list):
    """What :meth:`CallGate.submit` returns for a call: grpcio asks of it only ``add_done_callback`` (its callback
    counts the call out of the server's active calls), never a result or an exception, so it is not a
    ``concurrent.futures.Future``. The list of the callbacks not yet run, itself; ``done`` once the call has
    ended. grpcio tests what ``submit`` returned with ``is not None``, never by its truth (an empty list is false).

    No lock: whichever of :meth:`add_done_callback` (the polling thread) and :meth:`finish` (a gate thread) comes
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
        while self:  # tested first: the usual end, an empty list, costs no IndexError raised and caught
            try:
                fn = self.pop()
            except IndexError:  # the other thread took the last one between the test and the pop
                return
            try:
                fn(self)
            except Exception:
                log.exception("a call's completion callback failed")


@dataclass
class Lane:
    """Threads for one kind of work and the places of its calls: at most ``places`` calls queued or running, at
    most ``peer_share`` of them (and as many waiting for their request) from one peer (None: no share)."""

    name: str
    threads: int
    places: int
    peer_share: int | None = None
    queue: SimpleQueue = field(default_factory=SimpleQueue)
    # The calls holding a place, and the calls waiting for their request, each by id, with their peer.
    live: dict[int, str | None] = field(default_factory=dict)
    waiting: dict[int, tuple[float, str | None, tuple, Route]] = field(default_factory=dict)
    # Calls its threads have finished (not exact under races between threads: read only for progress).
    finished: int = 0
    by_peer: Counter = field(default_factory=Counter)
    waiting_by_peer: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Route:
    """Where a behaviour's calls go: ``method`` names them in metrics and logs; ``unary_request``: the method has
    exactly one request message; ``refusing``: the behaviour that answers a refused call, by reason (it counts the
    refusal and ends the call RESOURCE_EXHAUSTED); ``count_never_started``: a call that ends before its behaviour
    starts is reported."""

    method: str
    lane: Lane
    unary_request: bool
    refusing: dict[ShedReason, Callable]
    count_never_started: bool = False


def refusing_behaviour(method: str, reason: ShedReason, message: str, shed: ShedFn) -> Callable:
    """A behaviour that refuses its call: counted (``shed``), RESOURCE_EXHAUSTED with ``message``."""
    import grpc

    def refuse(request: object, context: grpc.ServicerContext, *send: object) -> None:
        shed(method, reason, f"{message} ({context.peer()})")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    return refuse


class CallGate:
    """A gRPC server's pool (the ``thread_pool`` given to ``grpc.server``): the lanes' threads, a refusal lane,
    and the routes of the behaviours registered with :meth:`route`. :meth:`shutdown` ends the threads once the
    server has stopped."""

    def __init__(self, accounting: Accounting, request_seconds: float, refusal_places: int = 64) -> None:
        self.accounting = accounting
        self.shed = accounting.shed
        self.on_error = accounting.thread_error
        self.request_seconds = request_seconds
        self.refusals = Lane("refusals", 2, refusal_places, refusal_places // 4)
        self.lanes: list[Lane] = [self.refusals]
        self.routes: dict[Callable, Route] = {}
        self.started = threading.local()  # whether the call a thread runs has started its behaviour
        # (method, why, the caller's address) of a call that ended before its behaviour started
        self.on_never_started: Callable[[str, ShedReason, str], None] = lambda method, reason, peer: None
        # (method, seconds from its request in to a thread taking it, seconds from its request in to its end)
        self.timed: Callable[[str, float, float], None] = lambda method, wait, total: None
        # The calls a transport's behaviour opened that gRPC has not ended yet (its end callback removes each): a
        # behaviour that has returned may still have its answer on the way, which the server's stop must not cancel.
        self.open_calls: set[object] = set()
        self._ids = itertools.count()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="gate-sweep", daemon=True)
        self._unknown = Route("unknown", self.refusals, False, {})
        self._receive_ahead = grpcio.features().receive_ahead
        self._start_threads(self.refusals)
        self._sweeper.start()

    def lane(self, name: str, threads: int, places: int, peer_share: int | None = None) -> Lane:
        """A new lane with its threads started."""
        lane = Lane(name, threads, places, peer_share if peer_share else None)
        self.lanes.append(lane)
        self._start_threads(lane)
        return lane

    def route(
        self,
        behaviour: Callable,
        method: str,
        lane: Lane,
        unary_request: bool,
        refusing: dict[ShedReason, Callable] | None = None,
        count_never_started: bool = False,
    ) -> None:
        """Calls of ``behaviour`` go to ``lane`` as ``method``. Without ``refusing``, a refused call is answered by
        a plain refusing behaviour of the method."""
        if refusing is None:
            refusing = {
                reason: refusing_behaviour(method, reason, self._refusal_message(lane, reason), self.shed)
                for reason in (ShedReason.CONCURRENCY, ShedReason.PEER_SHARE)
            }
        self.routes[behaviour] = Route(method, lane, unary_request, refusing, count_never_started)

    @staticmethod
    def _refusal_message(lane: Lane, reason: ShedReason) -> str:
        if reason is ShedReason.PEER_SHARE:
            return f"busy: this peer holds {lane.peer_share} of the {lane.name} calls it may; retry with backoff"
        return f"busy: {lane.places} {lane.name} calls in the server; retry with backoff"

    # -- submit ---------------------------------------------------------------------------------------------------

    def submit(self, fn: Callable, /, *args: object) -> CallDone:
        seen = grpcio.submitted(args, self._is_unary_request) if self._receive_ahead else None
        if seen is None:  # not grpcio's arguments as the adapter reads them: route by search, no peer, no wait
            behaviour = grpcio.behavior_among(args, self.routes)
            return self._admit(fn, args, self.routes.get(behaviour, self._unknown), None, behaviour)
        route = self.routes.get(seen.behavior, self._unknown)
        lane = route.lane
        peer = peer_key(seen.peer) if lane.peer_share is not None else None  # the share's key, where there is one
        if not seen.unary_request:
            return self._admit(fn, args, route, peer, seen.behavior)
        if peer is not None and not self._hold(lane.waiting_by_peer, lane, peer):
            return self._refuse(fn, grpcio.without_request(args), route, ShedReason.PEER_SHARE, seen.behavior)
        call = next(self._ids)
        done = CallDone()
        lane.waiting[call] = (time.monotonic() + self.request_seconds, peer, args, route)

        def received(now_args: tuple) -> None:  # on gRPC's polling thread, once the request is in
            if lane.waiting.pop(call, None) is None:  # ended by the sweep meanwhile
                done.finish()
                return
            if peer is not None:
                self._let_go(lane.waiting_by_peer, lane, peer)
            self._admit(fn, now_args, route, peer, seen.behavior, done, call)

        if not grpcio.receive_ahead(args, received, self.on_error):
            lane.waiting.pop(call, None)
            if peer is not None:
                self._let_go(lane.waiting_by_peer, lane, peer)
            return self._admit(fn, args, route, peer, seen.behavior, done, call)
        return done

    def _is_unary_request(self, behaviour: object) -> bool:
        route = self.routes.get(behaviour)
        return route is not None and route.unary_request

    def _admit(
        self,
        fn: Callable,
        args: tuple,
        route: Route,
        peer: str | None,
        behaviour: object,
        done: CallDone | None = None,
        call: int | None = None,
    ) -> CallDone:
        """Take a place in the route's lane and queue the call, or refuse it. ``peer``: the key of the lane's per-peer
        share (None where the lane has none, or the peer is not known)."""
        lane = route.lane
        if len(lane.live) >= lane.places:
            return self._refuse(fn, args, route, ShedReason.CONCURRENCY, behaviour, done)
        if peer is not None and not self._hold(lane.by_peer, lane, peer):
            return self._refuse(fn, args, route, ShedReason.PEER_SHARE, behaviour, done)
        call = next(self._ids) if call is None else call
        done = CallDone() if done is None else done
        lane.live[call] = peer
        try:
            lane.queue.put((call, fn, args, done, route, time.time()))
        except BaseException:  # nothing will run it: its place and grpcio's count of it go back, then the error
            lane.live.pop(call, None)
            if peer is not None:
                self._let_go(lane.by_peer, lane, peer)
            done.finish()
            raise
        return done

    def _refuse(
        self,
        fn: Callable,
        args: tuple,
        route: Route,
        reason: ShedReason,
        behaviour: object,
        done: CallDone | None = None,
    ) -> CallDone:
        """Run the route's refusing behaviour in the call's place, on the refusal lane (which takes no share:
        a refusal is quick, and refusing refusals would leave the caller without an answer)."""
        refusing = route.refusing.get(reason)
        done = CallDone() if done is None else done
        full = len(self.refusals.live) >= self.refusals.places
        if refusing is None or behaviour is None or (full and self._receive_ahead):
            # A refusal with nothing to run it: ended here, without a thread (a flood of refusals, or of calls
            # to methods nobody serves, cannot queue without bound).
            message = "busy: too many refusals at once; retry with backoff"
            self.shed(route.method, reason, message)
            grpcio.end_call(args, "resource_exhausted", message)
            done.finish()
            return done
        swapped = tuple(refusing if arg is behaviour else arg for arg in args)
        call = next(self._ids)
        self.refusals.live[call] = None
        self.refusals.queue.put((call, fn, swapped, done, route, time.time()))  # never started: counts as its call
        return done

    def _hold(self, counts: Counter, lane: Lane, peer: str) -> bool:
        with lane.lock:
            if counts[peer] >= lane.peer_share:
                return False
            counts[peer] += 1
        return True

    @staticmethod
    def _let_go(counts: Counter, lane: Lane, peer: str) -> None:
        with lane.lock:
            counts[peer] -= 1
            if counts[peer] <= 0:
                del counts[peer]

    # -- threads --------------------------------------------------------------------------------------------------

    def _start_threads(self, lane: Lane) -> None:
        for i in range(lane.threads):
            thread = threading.Thread(target=self._work, args=(lane,), name=f"{lane.name}_{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _work(self, lane: Lane) -> None:
        take, live, started = lane.queue.get, lane.live, self.started
        while (item := take()) is not None:
            call, fn, args, done, route, queued_at = item
            started.value = False
            started.queued_at = queued_at
            taken_at = time.time()
            try:
                fn(*args)
            except BaseException:
                log.exception("a gRPC call's handler raised past gRPC's own handling")
            finally:
                try:  # the thread must outlive anything its bookkeeping meets
                    peer = live.pop(call, None)
                    if peer is not None:
                        self._let_go(lane.by_peer, lane, peer)
                    if route.count_never_started:  # the RPCs: timed, and counted when they never started
                        self.timed(route.method, taken_at - queued_at, time.time() - queued_at)
                        if not started.value:  # the peer: gRPC's (gone once the call expired), else its share's
                            reason = never_started_reason(grpcio.deadline_of(args), queued_at)
                            self.on_never_started(route.method, reason, grpcio.peer_of(args) or peer or "a peer")
                except Exception:
                    log.exception("a gRPC call's bookkeeping failed")
                lane.finished += 1
                done.finish()

    def _sweep(self) -> None:
        """End the calls whose request has not come within ``request_seconds``."""
        message = f"no request message within {self.request_seconds:g} s"
        while not self._stop.wait(_SWEEP_SECONDS):
            now = time.monotonic()
            for lane in self.lanes:
                for call, (due, *_) in list(lane.waiting.items()):
                    if due <= now:
                        self._end_waiting(lane, call, ShedReason.REQUEST_TIMEOUT, "deadline_exceeded", message)

    def end_waiting(self) -> int:
        """End every call still waiting for its request (the server is stopping: none will start); returns how
        many."""
        ended = 0
        for lane in self.lanes:
            for call in list(lane.waiting):
                ended += self._end_waiting(lane, call, ShedReason.SHUTDOWN, "unavailable", "the server is stopping")
        return ended

    def _end_waiting(self, lane: Lane, call: int, reason: ShedReason, code: str, message: str) -> bool:
        entry = lane.waiting.pop(call, None)
        if entry is None:  # its request came meanwhile
            return False
        _, peer, args, route = entry
        if peer is not None:
            self._let_go(lane.waiting_by_peer, lane, peer)
        self.shed(route.method, reason, f"{message} ({peer or 'a peer'})")
        grpcio.end_call(args, code, message)
        return True

    def idle(self) -> bool:
        """No call in any lane (none waiting for its request, queued or running) and none whose answer gRPC is still
        sending (:attr:`open_calls`)."""
        return not self.open_calls and not any(lane.live or lane.waiting for lane in self.lanes)

    def held(self, lane: Lane) -> int:
        """Calls holding a place in ``lane`` now."""
        return len(lane.live)

    def shutdown(self, timeout: float) -> int:
        """Stop each thread once the calls queued before this are done (the server has stopped, so gRPC has
        already ended them); wait up to ``timeout`` seconds in all. Returns how many threads were still busy when
        the wait ended."""
        self._stop.set()
        self.end_waiting()
        for lane in self.lanes:
            for _ in range(lane.threads):
                lane.queue.put(None)
        end = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        return sum(thread.is_alive() for thread in self._threads)
