"""service/overload/budget.c held to its Python twin (service/overload/books.py): the books' grants, give-backs and
gauge on random sequences of operations, the watchdog's entry, the errors, the reference cycles a ticket can be in;
and the compiled fast path's admission (FastAdmit) held to the data plane's general one on every branch it takes
or hands on, through DataPlane.call."""

from __future__ import annotations

import ast
import gc
import inspect
import logging
import math
import random
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.service import codec, dataplane
from indexer_service.service.compute.backends import FAST_PATH_BACKEND
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.errors import ServiceError
from indexer_service.service.overload import books
from indexer_service.service.overload.admission import Caller, DrainWatchdog
from testkit.paths import REPO
from testkit.planes import make_plane

_budget = pytest.importorskip(
    "indexer_service.service.overload._budget", reason="service/overload/_budget is not built"
)

TWINS = {"compiled": (_budget.Books, _budget.watch), "python": (books.PyBooks, books.py_watch)}


@dataclass
class Observed:
    """What the books told the outside: every gauge value and every notify."""

    gauge: list[int] = field(default_factory=list)
    notified: int = 0

    def notify(self) -> None:
        self.notified += 1


def new_books(kind: str, limit: int = 1000, share: int = 250) -> tuple[object, Observed]:
    seen = Observed()
    return TWINS[kind][0](limit, share, seen.gauge.append, seen.notify), seen


def test_a_server_uses_the_compiled_books_where_they_are_built(caplog) -> None:
    assert books.load_compiled() is _budget
    with caplog.at_level(logging.WARNING):
        plane = make_plane(warmup_target="none", native_fast_path=True)
    watchdog = DrainWatchdog(3600.0)
    try:
        assert isinstance(plane.admission.budget.books, _budget.Books)
        assert isinstance(plane._admit_fast, _budget.FastAdmit)
        assert watchdog.watch_ticket.func is _budget.watch
        assert watchdog.watch_ticket.args == (watchdog._watched, 3600.0)
        assert books.NOT_COMPILED not in caplog.text
    finally:
        watchdog.stop()


def test_without_the_compiled_books_the_twin_keeps_them(monkeypatch, caplog) -> None:
    """Where service/overload/_budget was not built, a server says so once and its budget, watchdog and fast path's
    admission use the Python twin; calls are admitted, held and released as before."""
    monkeypatch.setitem(sys.modules, books.COMPILED_MODULE, None)  # importing it fails, as where it was never built
    with caplog.at_level(logging.WARNING):
        plane = make_plane(warmup_target="none", native_fast_path=True)
    plane.readiness.refresh()
    watchdog = DrainWatchdog(3600.0)
    try:
        assert [r.getMessage() for r in caplog.records].count(books.NOT_COMPILED) == 1
        assert type(plane.admission.budget.books) is books.PyBooks and watchdog.watch_ticket.func is books.py_watch
        assert plane._admit_fast == plane._admit_work
        caller = Caller("peer-1")
        answer = plane.call("BuildChunk", request_bytes(), caller=caller)
        assert type(caller.ticket) is books.PyTicket and caller.ticket.nbytes == len(answer)
        watchdog.watch_ticket(caller.ticket, print)
        caller.ticket.release()
        assert plane.admission.budget.held == 0 and watchdog._watched == {}
    finally:
        watchdog.stop()


def test_the_stub_names_what_the_compiled_module_exports() -> None:
    stub = ast.parse((REPO / "service" / "overload" / "_budget.pyi").read_text())
    named = {t.id for node in stub.body if isinstance(node, ast.Assign) for t in node.targets}
    named |= {node.name for node in stub.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    assert named == {name for name in vars(_budget) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("compiled", "python"),
    [
        (_budget.Books.take, books.PyBooks.take),
        (_budget.Books.give_back, books.PyBooks.give_back),
        (_budget.Books.peer_bytes, books.PyBooks.peer_bytes),
        (_budget.Ticket.release, books.PyTicket.release),
        (_budget.watch, books.py_watch),
    ],
    ids=lambda f: f.__qualname__,
)
def test_the_twins_take_the_same_arguments(compiled: object, python: object) -> None:
    def names(f: object) -> list[str]:
        return [p.name for p in inspect.signature(f).parameters.values() if p.name not in ("self", "$self")]

    assert names(compiled) == names(python)


def test_the_twins_have_the_same_attributes() -> None:
    (compiled, _), (python, _) = new_books("compiled"), new_books("python")
    for c_object, py_object in ((compiled, python), (compiled.take("a", 1), python.take("a", 1))):
        assert {n for n in dir(c_object) if not n.startswith("_")} == {
            n for n in dir(py_object) if not n.startswith("_")
        }


@pytest.mark.parametrize("seed", range(30))
def test_random_operations_leave_both_twins_in_the_same_state(seed: int) -> None:
    """The same operations on both: the same grants and refusals, tickets, books, gauge values and notifies."""
    rng = random.Random(seed)
    limit = rng.choice([1, 7, 100, 1000])
    share = rng.randint(1, limit)
    twins = {kind: new_books(kind, limit, share) for kind in TWINS}
    tickets: dict[str, list] = {kind: [] for kind in TWINS}
    for _ in range(200):
        op = rng.random()
        peer = rng.choice(["a", "b", "c", "ipv6:[::1]:5"])
        nbytes = rng.choice([0, 1, rng.randint(0, limit), rng.randint(0, 2 * limit)])
        keep = rng.choice([None, 0, rng.randint(0, limit)])
        index = rng.randrange(len(tickets["python"])) if tickets["python"] else None
        waiters = rng.choice([0, 0, 1, 3])
        for kind, (book, _) in twins.items():
            book.waiters = waiters
            if op < 0.5 or index is None:
                ticket = book.take(peer, nbytes)
                if ticket is not None:
                    tickets[kind].append(ticket)
            elif op < 0.8:
                book.give_back(tickets[kind][index], keep)
            else:
                tickets[kind][index].release()
        compiled, python = twins["compiled"], twins["python"]
        assert (compiled[0].held, compiled[0].by_peer) == (python[0].held, python[0].by_peer)
        assert compiled[1] == python[1]
        assert [(t.peer, t.nbytes, t.released) for t in tickets["compiled"]] == [
            (t.peer, t.nbytes, t.released) for t in tickets["python"]
        ]
    for kind, (book, _) in twins.items():  # every ticket released: nothing held, no connection left in the books
        for ticket in tickets[kind]:
            ticket.release()
        assert (book.held, book.by_peer) == (0, {})


@pytest.mark.parametrize("kind", TWINS)
def test_threads_taking_and_giving_back_at_once_leave_the_books_and_gauge_right(kind: str) -> None:
    """Eight threads take and give back at once, with a gauge written in Python that yields the GIL midway (as
    prometheus_client's does with workers): nothing is lost, and the gauge's last value is what the books hold."""
    gauge = [0]

    def slow_set(value: int) -> None:
        time.sleep(0)  # another thread may run here, mid-publish
        gauge[0] = value

    book = TWINS[kind][0](10_000, 2_500, slow_set, lambda: None)
    errors = []

    def churn(seed: int) -> None:
        rng, held = random.Random(seed), []
        try:
            for _ in range(2_000):
                if held and rng.random() < 0.5:
                    ticket = held.pop(rng.randrange(len(held)))
                    if rng.random() < 0.5:
                        book.give_back(ticket, rng.randint(0, ticket.nbytes))
                    ticket.release()
                else:
                    ticket = book.take(f"peer{seed % 3}", rng.randint(0, 300))
                    if ticket is not None:
                        held.append(ticket)
            for ticket in held:
                ticket.release()
        except Exception as exc:  # reported below: an assertion in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(thread.is_alive() for thread in threads)
    assert (book.held, book.by_peer, gauge[0]) == (0, {}, 0)


@pytest.mark.parametrize("kind", TWINS)
def test_the_rules_at_their_boundaries(kind: str) -> None:
    book, seen = new_books(kind, limit=100, share=25)
    whole = book.take("a", 100)  # a connection holding nothing may take the whole budget
    assert whole is not None and book.take("b", 1) is None
    whole.release()
    first = book.take("a", 20)
    assert book.take("a", 6) is None  # 26 would pass the share of a connection that holds something
    second = book.take("a", 5)  # 25: at the share
    assert second is not None and book.peer_bytes("a") == 25 and book.peer_bytes("z") == 0
    book.give_back(first, 30)  # never back up
    book.give_back(first, 10)
    assert (first.nbytes, book.held) == (10, 15)
    first.release()
    book.give_back(first, 0)  # nothing after its release
    first.release()
    assert (book.held, book.by_peer, first.released) == (5, {"a": 5}, True)
    assert seen.gauge == [0, 100, 0, 20, 25, 15, 5] and seen.notified == 0
    book.waiters = 1
    second.release()
    assert seen.notified == 1 and (book.limit, book.share, book.waiters) == (100, 25, 1)
    assert repr(second) == "Ticket(peer='a', nbytes=5, released=True)" and second.budget is book


@pytest.mark.parametrize("kind", TWINS)
def test_what_the_books_refuse_both_refuse(kind: str) -> None:
    book, _ = new_books(kind)
    other, _ = new_books(kind)
    ticket = other.take("a", 1)
    with pytest.raises(ValueError, match="not a ticket of these books"):
        book.give_back(ticket, None)
    with pytest.raises(ValueError, match="keep must be None or >= 0"):
        other.give_back(ticket, -1)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        book.take("a", -1)
    with pytest.raises(TypeError, match="peer must be a str"):
        book.take(b"a", 1)
    with pytest.raises(ValueError, match="at least 1"):
        TWINS[kind][0](0, 1, print, print)
    with pytest.raises(ValueError, match="watched already"):
        watched: dict = {}
        TWINS[kind][1](watched, 1.0, ticket, print)
        TWINS[kind][1](watched, 1.0, ticket, print)


@pytest.mark.parametrize("kind", TWINS)
@pytest.mark.parametrize("failing", ["notify", "forget", "both"])
def test_a_release_runs_every_step_whatever_one_raises(kind: str, failing: str) -> None:
    """After the books change, notify and the forgetting each run whatever the one before raised (a try/finally):
    the books are right, the watchdog's entry is gone, and the last error is the one raised."""

    class NotifyFailed(Exception):
        pass

    class ForgetFailed(Exception):
        pass

    def notify() -> None:
        if failing in ("notify", "both"):
            raise NotifyFailed

    forgotten = []

    def forget() -> None:
        forgotten.append(1)
        if failing in ("forget", "both"):
            raise ForgetFailed

    book = TWINS[kind][0](100, 100, lambda value: None, notify)
    ticket, watched = book.take("a", 10), {}
    TWINS[kind][1](watched, 30.0, ticket, print)
    ticket.forget = forget
    book.waiters = 1
    with pytest.raises(NotifyFailed if failing == "notify" else ForgetFailed):
        ticket.release()
    assert (book.held, book.by_peer, watched, forgotten, ticket.released) == (0, {}, {}, [1], True)


@pytest.mark.parametrize("kind", TWINS)
def test_sizes_near_the_largest_int64_neither_overflow_nor_slip_through(kind: str) -> None:
    largest = 2**63 - 1
    book, _ = new_books(kind, limit=largest, share=largest)
    assert book.take("a", 1) is not None
    assert book.take("b", largest) is None and book.take("a", largest) is None  # one byte too many, not a wrap
    assert book.take("b", largest - 1) is not None and book.held == largest


def test_compiled_objects_made_without_init_refuse_and_never_crash() -> None:
    bare = _budget.Books.__new__(_budget.Books)
    assert bare.take("a", 1) is None and bare.held == 0 and bare.peer_bytes("a") == 0  # no room, no crash
    book, _ = new_books("compiled")
    ticket = book.take("a", 5)
    with pytest.raises(TypeError, match="already initialised"):
        book.__init__(10, 10, print, print)
    ticket.release()
    assert book.held == 0
    with pytest.raises(TypeError, match="not initialised"):
        _budget.FastAdmit.__new__(_budget.FastAdmit)(1, 1)


@pytest.mark.parametrize("kind", TWINS)
def test_a_gauge_that_fails_fails_no_call(kind: str, caplog, monkeypatch) -> None:
    """The books have changed by the time the gauge is set: a failure there is reported (the compiled books through
    sys.unraisablehook, the twin in the log), the call goes on and the books stay right."""
    reported = []
    monkeypatch.setattr("sys.unraisablehook", reported.append)

    def broken(value: int) -> None:
        raise RuntimeError("gauge down")

    book = TWINS[kind][0](100, 100, broken, lambda: None)
    ticket = book.take("a", 10)
    ticket.release()
    assert book.held == 0 and ticket.released
    if kind == "compiled":
        assert [type(r.exc_value) for r in reported] == [RuntimeError] * 3
    else:
        assert caplog.text.count("setting the response budget's gauge failed") == 3


@pytest.mark.parametrize("kind", TWINS)
@pytest.mark.parametrize("released", ["after", "before"])
def test_the_watchdog_entry_goes_with_the_release(kind: str, released: str) -> None:
    """watch() adds (deadline, ticket, on_unread) under id(ticket), and the release pops it (at once when the ticket
    was released first), then calls the ticket's own forget, each once."""
    book, _ = new_books(kind)
    watch = TWINS[kind][1]
    ticket, watched, forgotten = book.take("a", 10), {}, []
    ticket.forget = lambda: forgotten.append(1)
    if released == "before":
        ticket.release()
    start = time.monotonic()
    watch(watched, 30.0, ticket, print)
    if released == "after":
        ((key, (deadline, held, on_unread)),) = watched.items()
        assert key == id(ticket) and held is ticket and on_unread is print
        assert start + 30.0 <= deadline <= time.monotonic() + 30.0
        watched.clear()  # the scan may drop it first: the release then pops nothing
        watched[id(ticket)] = (deadline, held, on_unread)
        ticket.release()
        ticket.release()
    assert watched == {} and forgotten == [1] and ticket.forget is None


def test_the_compiled_calls_keep_no_reference() -> None:
    """Every path of the compiled module, thousands of times: the objects it is given are referenced no more at the
    end than at the start (a reference kept per call is memory kept per call; the sanitized build cannot see it)."""
    book, _ = new_books("compiled", limit=1000, share=1000)
    plane = plane_pair(response_budget_bytes=1 << 20)["fast"]
    peer, watched, data = "peer-" + str(id(book)), {}, request_bytes()  # a str of this test's own

    def on_unread() -> None:
        pass

    def paths() -> None:
        ticket = book.take(peer, 10)
        _budget.watch(watched, 30.0, ticket, on_unread)
        book.give_back(ticket, 5)
        ticket.release()
        book.take(peer, 10_000)  # refused
        caller = Caller(peer)
        plane.call("BuildChunk", data, caller=caller)  # FastAdmit decides
        caller.ticket.release()
        json = Caller(peer, held_per_answer_byte=2.5)
        plane.call("BuildChunk", data, caller=json)  # FastAdmit hands on
        json.ticket.release()

    def counts() -> tuple[int, ...]:
        objects = (peer, book, watched, on_unread, plane.admission.budget.books, plane._admit_fast)
        return tuple(sys.getrefcount(o) for o in objects)

    paths()
    before = counts()
    for _ in range(5_000):
        paths()
    assert counts() == before and watched == {} and book.held == 0 and plane.admission.budget.held == 0


@pytest.mark.parametrize("kind", TWINS)
def test_a_ticket_in_a_reference_cycle_is_collected(kind: str) -> None:
    """The watchdog's entry holds the ticket and the ticket its entry's dict (and whatever its forget refers to):
    unreleased and dropped, the cycle is the garbage collector's."""

    class Owner:  # what holds the ticket; its method, in the ticket's forget and the entry, refers back to it
        def touch(self) -> None:
            pass

    book, _ = new_books(kind)
    owner = Owner()
    owner.ticket = book.take("a", 10)
    owner.ticket.forget = owner.touch
    owner.watched = {}
    TWINS[kind][1](owner.watched, 30.0, owner.ticket, owner.touch)
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None


# ---- FastAdmit against the general admission, through DataPlane.call --------------------------------------------


def request_bytes(tokens: int = 40) -> bytes:
    # one request of `tokens` query tokens over 400 of context at ratio 4: the compiled fast path serves it
    inputs = ChunkInputs(np.array([0, tokens]), np.array([400]), 4, 0, 1)
    return codec.chunk_inputs_to_proto(inputs).SerializeToString()


def plane_pair(**settings: object) -> dict[str, DataPlane]:
    """Two ready planes with the same settings, the compiled fast path serving: one admitting with FastAdmit, one
    with the general admission alone (what FastAdmit hands on to)."""
    planes = {}
    for admit in ("fast", "general"):
        plane = make_plane(warmup_target="none", native_fast_path=True, **settings)
        plane.readiness.refresh()
        if admit == "general":
            plane._admit_fast = plane._admit_work
        else:
            assert isinstance(plane._admit_fast, _budget.FastAdmit)
        planes[admit] = plane
    return planes


def outcome(plane: DataPlane, caller: Caller, data: bytes) -> tuple:
    """The call's answer or error, the ticket it left its caller, the books while the answer is held and after,
    whether it holds a heavy-lane slot still, and whether the compiled fast path served it."""
    served = {"method": "BuildChunk", "backend": FAST_PATH_BACKEND}
    count = plane.metrics.registry.get_sample_value
    before = count("indexer_backend_duration_seconds_count", served) or 0
    try:
        answer = plane.call("BuildChunk", data, caller=caller)
        result = ("ok", len(answer))
    except ServiceError as error:
        result = (error.code.name, str(error.shed_reason), error.message)
    ticket = caller.ticket
    held = (ticket.nbytes, ticket.released) if ticket is not None else None
    during = plane.admission.budget.books.held
    if ticket is not None:
        ticket.release()
    native = (count("indexer_backend_duration_seconds_count", served) or 0) - before
    return result, held, during, plane.admission.budget.books.held, caller.in_heavy_lane, native


CALLERS = {
    "protobuf": lambda: Caller("peer-1"),
    "json": lambda: Caller("peer-1", held_per_answer_byte=2.5),
    "cancelled": lambda: ended(Caller("peer-1")),
    "past its deadline": lambda: past_deadline(Caller("peer-1")),
}


def ended(caller: Caller) -> Caller:
    caller.ended = True
    return caller


def past_deadline(caller: Caller) -> Caller:
    caller.deadline = time.time() - 1.0
    return caller


SETTINGS = {
    "room": {},
    "heavy": {"heavy_request_bytes": 1},
    "above the budget": {"response_budget_bytes": 100},
    "no room now": {"response_budget_bytes": 4096, "admission_wait_seconds": 0.05},
    "past the connection's share": {"response_budget_bytes": 4096, "admission_wait_seconds": 0.05},
}


@pytest.mark.parametrize("who", CALLERS)
@pytest.mark.parametrize("setting", SETTINGS)
def test_fast_admit_admits_as_the_general_admission(setting: str, who: str) -> None:
    planes = plane_pair(**SETTINGS[setting])
    fast, handed_on = planes["fast"], []

    def general(*sizes: int) -> object:
        handed_on.append(1)
        return fast._admit_work(*sizes)

    fast._admit_fast = _budget.FastAdmit(
        dataplane._CALL,
        fast.admission.heavy_request_bytes,
        dataplane.CHUNK_COST_BYTES,
        fast.admission.budget.books,
        general,
        fast._stop_if_abandoned,
    )
    seen = {}
    for admit, plane in planes.items():
        blocker = None
        if setting == "no room now":  # another connection holds all but 100 bytes
            blocker = plane.admission.budget.reserve("peer-2", 4096 - 100, Caller("peer-2"))
        elif setting == "past the connection's share":  # the caller's own connection holds all but 10 of its share
            blocker = plane.admission.budget.reserve("peer-1", 1024 - 10, Caller("peer-1"))
        seen[admit] = outcome(plane, CALLERS[who](), request_bytes())
        if blocker is not None:
            blocker.release()
        assert plane.admission.budget.books.held == 0
    assert seen["fast"] == seen["general"]
    assert seen["fast"][-1] == int(seen["fast"][0][0] == "ok")  # what was answered, the compiled fast path answered
    # FastAdmit decided alone where the answer fits now and its caller holds a byte per byte (then saw the caller gone
    # or not); every other call it handed on
    assert handed_on == ([] if setting == "room" and who != "json" else [1])
    if setting == "room" and who == "protobuf":
        assert seen["fast"][0][0] == "ok" and seen["fast"][1] == (seen["fast"][0][1], False)


def test_fast_admit_without_a_call_hands_on() -> None:
    """Outside DataPlane.call (a test calling a handler) there is no caller: nothing is held, as in the general path."""
    planes = plane_pair()
    assert planes["fast"]._admit_fast(10, 10) is None and planes["general"]._admit_fast(10, 10) is None
    assert planes["fast"].admission.budget.books.held == 0


def test_fast_admit_of_the_common_call_holds_the_exact_answer() -> None:
    plane = plane_pair()["fast"]
    caller = Caller("peer-1")
    answer = plane.call("BuildChunk", request_bytes(), caller=caller)
    assert caller.ticket.nbytes == len(answer) == plane.admission.budget.books.peer_bytes("peer-1")
    assert not math.isnan(caller.deadline)
    caller.ticket.release()
    assert plane.admission.budget.books.by_peer == {}
