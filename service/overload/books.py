"""The response budget's books and tickets: service/overload/budget.c's rules in Python, its twin.

The compiled module serves when it is built (the per-call bookkeeping of every answer, a visible share of a small
call's server CPU in Python: docs/performance.md); this one where it is not (no C compiler at install), and as the
literal statement of the rules. tests/service/test_budget_books.py holds the two equal, operation for operation.
:func:`load_compiled` says which twin a server uses. :class:`ResponseBudget` (service/overload/admission.py) waits
for room around them. The compiled module's fourth part, ``FastAdmit`` (the fast path's admission of the common
call), has no twin here: it hands every other call to the data plane's general admission
(service/dataplane.py ``DataPlane._admit_work``), whose outcome the tests hold it equal to.

The rules: a grant when the bytes fit the budget's ``limit``, and the connection's ``share`` unless it holds nothing
yet; a ticket gives back down to a smaller size, never up, and nothing after its release; a release pops the drain
watchdog's entry and calls the ticket's ``forget`` (each once); ``set_held`` is given the bytes held after every
change, and ``notify`` is called after a give-back while ``waiters`` is not zero. After a give-back's change, each of
these steps runs whatever the one before raised, and the last error is the one raised (a ``try/finally``).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType

log = logging.getLogger(__name__)


class PyTicket:
    """Bytes of the response budget held for one call, by one connection (made by :meth:`PyBooks.take`)."""

    __slots__ = ("_watched", "budget", "forget", "nbytes", "peer", "released")

    def __init__(self, budget: PyBooks, peer: str, nbytes: int) -> None:
        self.budget = budget
        self.peer = peer
        self.nbytes = nbytes
        self.released = False
        self.forget: Callable[[], object] | None = None  # called once, on release (DrainWatchdog.watch sets it)
        self._watched: dict | None = None  # the watchdog's entries, holding this one's under id(ticket) (watch())

    def release(self) -> None:
        self.budget.give_back(self, None)

    def __repr__(self) -> str:
        return f"Ticket(peer={self.peer!r}, nbytes={self.nbytes}, released={self.released})"


class PyBooks:
    """The bytes of responses held, overall and per connection. Each operation under a lock of its own (the
    compiled twin's are atomic under the GIL); ``notify`` is called after the lock is released, as it takes the
    budget's Condition, which a waiter holds while it calls :meth:`take`."""

    def __init__(self, limit: int, share: int, set_held: Callable[[int], object], notify: Callable[[], object]) -> None:
        if limit < 1 or share < 1:
            raise ValueError("Books: limit and share must be at least 1")
        self.limit = limit
        self.share = share
        self.waiters = 0
        self.held = 0
        self._by_peer: dict[str, int] = {}
        self._set_held = set_held
        self._notify = notify
        self._lock = threading.Lock()
        self._publish()

    @property
    def by_peer(self) -> dict[str, int]:
        return dict(self._by_peer)

    def peer_bytes(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def take(self, peer: str, nbytes: int) -> PyTicket | None:
        if type(peer) is not str:
            raise TypeError("take(): peer must be a str")
        if nbytes < 0:
            raise ValueError(f"take(): nbytes must be >= 0, got {nbytes}")
        with self._lock:
            mine = self._by_peer.get(peer, 0)
            if self.held + nbytes > self.limit or (mine and mine + nbytes > self.share):
                return None
            if nbytes:  # a connection holding nothing has no entry
                self._by_peer[peer] = mine + nbytes
            self.held += nbytes
            self._publish()
        return PyTicket(self, peer, nbytes)

    def give_back(self, ticket: PyTicket, keep: int | None) -> None:
        if not isinstance(ticket, PyTicket) or ticket.budget is not self:
            raise ValueError("give_back(): not a ticket of these books")
        if keep is not None and keep < 0:
            raise ValueError("give_back(): keep must be None or >= 0")
        with self._lock:
            if ticket.released:
                return
            if keep is None:
                ticket.released = True
                nbytes = ticket.nbytes
            elif keep < ticket.nbytes:
                nbytes = ticket.nbytes - keep
                ticket.nbytes = keep
            else:
                return
            self.held -= nbytes
            left = self._by_peer.get(ticket.peer, 0) - nbytes
            if left > 0:
                self._by_peer[ticket.peer] = left
            else:
                self._by_peer.pop(ticket.peer, None)
            self._publish()
        try:  # each step runs whatever the one before raised; the last error is the one raised
            if self.waiters:
                self._notify()
        finally:
            if keep is None:
                _forget(ticket)

    def _publish(self) -> None:
        """The gauge set to the bytes held (under the lock: the writes are in order); a failure is logged, not
        raised, as the compiled twin reports it: the books have changed, and a call must not fail over its gauge."""
        try:
            self._set_held(self.held)
        except Exception:
            log.exception("setting the response budget's gauge failed")


def _forget(ticket: PyTicket) -> None:
    watched, forget = ticket._watched, ticket.forget
    ticket._watched = ticket.forget = None
    try:
        if watched is not None:
            watched.pop(id(ticket), None)
    finally:
        if forget is not None:
            forget()


def py_watch(watched: dict, seconds: float, ticket: PyTicket, on_unread: Callable[[], object]) -> None:
    """DrainWatchdog.watch's entry for a ticket of these books: ``(deadline, ticket, on_unread)`` under ``id(ticket)``,
    popped when the ticket is released (at once if it already is)."""
    if ticket._watched is not None:
        raise ValueError("watch(): the ticket is watched already")
    watched[id(ticket)] = (time.monotonic() + seconds, ticket, on_unread)
    ticket._watched = watched
    if ticket.released:
        _forget(ticket)


# A ticket's type as annotations name it: the compiled Ticket is typed as this one (service/overload/_budget.pyi).
Ticket = PyTicket

COMPILED_MODULE = "indexer_service.service.overload._budget"
# What a server logs once at start where the compiled books were not built (service/dataplane.py).
NOT_COMPILED = "keeping the response budget's books in Python (service/overload/_budget not built)"


def load_compiled() -> ModuleType | None:
    """The compiled books (service/overload/budget.c), or None where they were not built: the twins here then keep
    them, slower but by the same rules. Asked by each budget, watchdog and data plane as it is made (a module already
    imported: a dict lookup), so all of a server's parts use the same kind of ticket."""
    try:
        return importlib.import_module(COMPILED_MODULE)
    except ImportError:
        return None
