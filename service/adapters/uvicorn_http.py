"""Every reach into uvicorn's internals: the limited httptools protocol, and the public settings where it cannot run.

The limited protocol (feature ``limited_protocol``) is uvicorn's ``HttpToolsProtocol`` with one HTTP port's bounds:

- **Head and trailers.** A request's non-body bytes (request line, headers, chunked framing lines and trailers)
  together stay within ``max_head_bytes``. Data reaches the parser in pieces, each ending at a blank line
  (``\\r\\n\\r\\n``, where a head or a trailer section ends) or sooner: a piece of the head is never longer than what
  is left of the budget, so the parser never holds a head above the limit nor starts the app on one; a piece after
  the head is never longer than the limit, and what it held that was not body (the parser's ``on_body`` says
  what was) is counted once it has been parsed, so a trailer holds at most twice the limit before the refusal.
  Over the limit: 431 and close, where no answer is under way on the connection (else it is dropped).
- **Time.** The connection closes after ``idle_seconds`` with no request in progress (from its accept, or from the
  last answer), and a request must arrive whole within ``idle_seconds`` of its first byte. A request that has
  arrived is in progress until it is answered; the transport bounds that time.
- **Connections.** Above ``max_connections`` open on the port, or where the transport refuses its peer
  (:meth:`ConnectionEvents.opened`), a new connection gets 503 and is closed.
- **Dropping.** The ASGI scope carries :data:`ABORT_KEY`, a callable that drops the connection at once.
- **Faults.** An exception raised by this module's own code in a callback or timer on the event loop is reported
  through :meth:`ConnectionEvents.failed` and drops that connection; the loop and every other connection go on.

:func:`probe` checks, at start, every internal the limited protocol uses (:data:`RELIED_ON`): the module and its
classes, each method it overrides or calls with the positional parameters it passes, the attributes uvicorn's
``__init__`` sets that it reads, and the calls between uvicorn's own methods it relies on. :func:`protocol_settings`
returns ``uvicorn.Config``'s protocol settings: the limited protocol where nothing is missing (probed once a process,
:func:`limited_protocol_on`), else (the fallback, :data:`PUBLIC_PATH`) uvicorn's h11 protocol with the public
settings nearest to it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from indexer_service.service import adapters
from indexer_service.service.config import ServiceConfig
from indexer_service.service.reasons import HttpRefusal

log = logging.getLogger(__name__)

LIBRARY = "uvicorn"
FEATURE = "limited_protocol"
MODULE = "uvicorn.protocols.http.httptools_impl"
# ASGI scope key through which the app can drop its connection at once (the limited protocol only).
ABORT_KEY = "indexer.abort"
# Where a request's head or a trailer section ends, and a piece of data given to the parser with it.
_BLANK_LINE = b"\r\n\r\n"

# What the limited protocol takes from MODULE. Methods: name -> the positional parameters (self aside) it calls
# or overrides them with. Attributes: set by the class's __init__, read or written by the limited protocol.
# Calls: (method, name it must use): behaviour the limited protocol depends on without calling it itself.
_PROTOCOL, _CYCLE = "HttpToolsProtocol", "RequestResponseCycle"
METHODS: dict[str, tuple[str, ...]] = {
    "connection_made": ("transport",),
    "connection_lost": ("exc",),
    "data_received": ("data",),
    "on_message_begin": (),
    "on_headers_complete": (),
    "on_body": ("body",),
    "on_message_complete": (),
    "on_response_complete": (),
}
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    _PROTOCOL: ("scope", "cycle"),  # the request's scope (for ABORT_KEY); its cycle (is an answer under way?)
    _CYCLE: ("response_started", "disconnected"),  # an answer under way; nothing more from the app reaches the wire
}
CALLS: tuple[tuple[str, str], ...] = (
    ("data_received", "feed_data"),  # each piece goes to the parser, whose callbacks are the methods above
    ("on_message_begin", "scope"),  # a new scope per request, where ABORT_KEY goes
    ("on_headers_complete", "cycle"),  # the request's cycle, made once its head is complete
    ("on_headers_complete", "on_response_complete"),  # the cycle calls it back once the answer is complete
)
RELIED_ON: tuple[str, ...] = (
    MODULE,
    _PROTOCOL,
    _CYCLE,
    *(f"{_PROTOCOL}.{name}" for name in METHODS),
    *(f"{cls}.{name}" for cls, names in ATTRIBUTES.items() for name in names),
    *(f"{_PROTOCOL}.{method} -> {name}" for method, name in CALLS),
)

PUBLIC_PATH = (
    "serving HTTP with uvicorn's h11 protocol and public settings: a head, and a trailer section, each at most "
    "http_max_header_bytes (h11_max_incomplete_event_size; more is 400, not counted), requests on a port holding "
    "http_max_connections or more connections answered 503 (limit_concurrency), idle connections closed "
    "http_idle_timeout_seconds after an answer (timeout_keep_alive); no idle limit before a connection's first "
    "request or while one arrives, no cap on open connections, an unread answer's connection closed, not dropped"
)


@dataclass(frozen=True)
class HttpLimits:
    """One HTTP port's bounds on its connections."""

    max_head_bytes: int  # a request's non-body bytes: head, chunked framing lines and trailers together
    idle_seconds: float  # no request in progress; or a request arriving, from its first byte
    max_connections: int  # open at once on the port

    @classmethod
    def of(cls, config: ServiceConfig) -> HttpLimits:
        """The limits the settings give each HTTP port."""
        return cls(config.http_max_header_bytes, config.http_idle_timeout_seconds, config.http_max_connections)


class Connection(Protocol):
    """One connection, as the transport sees it."""

    @property
    def address(self) -> Any:
        """The peer's address, as the socket gives it."""

    def drop(self) -> None:
        """Close the connection at once (its end is told through :meth:`ConnectionEvents.closed`)."""


class ConnectionEvents(Protocol):
    """What the limited protocol tells the transport. Each runs on the event loop and returns at once."""

    def opened(self, connection: Connection, open_connections: int) -> HttpRefusal | None:
        """``connection`` arrived within the limit, with ``open_connections`` open on the port: None where it is
        taken (it counts until :meth:`closed`), else why it is refused. The transport may close any connection it
        took meanwhile (:meth:`Connection.drop`)."""

    def closed(self, connection: Connection) -> None:
        """A taken connection ended."""

    def refused(self, reason: HttpRefusal, address: Any) -> bytes:
        """A connection or request refused for ``reason`` (too many connections, head and trailers too large),
        from ``address`` (the peer's, as the transport gives it): counted and logged; returns the whole HTTP
        response to write before the connection closes."""

    def timed_out(self) -> None:
        """A connection closed after ``idle_seconds`` idle, or with a request that did not arrive in time."""

    def failed(self, callback: str, address: Any, error: Exception) -> None:
        """This module's code raised ``error`` in ``callback``; the connection is being dropped."""


def _takes(function: Callable[..., object], count: int) -> bool:
    """Whether a method can be called with ``count`` positional arguments (``self`` aside) and nothing else."""
    try:
        inspect.signature(function).bind(None, *([None] * count))
    except (TypeError, ValueError):
        return False
    return True


def _uses(function: object, name: str) -> bool:
    """Whether ``function``'s own code names ``name`` (an attribute it reads or sets, a method it calls)."""
    code = getattr(function, "__code__", None)
    return code is not None and name in code.co_names


def _uvicorn_method(cls: type, name: str) -> Callable[..., object] | None:
    """``cls``'s method ``name`` where uvicorn defines it (asyncio.Protocol's empty default is no such method)."""
    for owner in cls.__mro__:
        if name in vars(owner):
            method = vars(owner)[name]
            return method if callable(method) and owner.__module__.startswith("uvicorn") else None
    return None


def probe(module: ModuleType | None = None) -> tuple[str, ...]:
    """What of :data:`RELIED_ON` is missing or differs in ``module`` (by default uvicorn's, imported now); empty
    when the limited protocol can run."""
    if module is None:
        try:
            module = importlib.import_module(MODULE)
        except ImportError:
            return (MODULE,)
    missing: list[str] = []
    classes = {name: getattr(module, name, None) for name in (_PROTOCOL, _CYCLE)}
    missing += [name for name, cls in classes.items() if not isinstance(cls, type)]
    protocol = classes[_PROTOCOL]
    if isinstance(protocol, type):
        for name, parameters in METHODS.items():
            method = _uvicorn_method(protocol, name)
            if method is None:
                missing.append(f"{_PROTOCOL}.{name}")
            elif not _takes(method, len(parameters)):
                missing.append(f"{_PROTOCOL}.{name}({', '.join(parameters)})")
        for name, called in CALLS:
            method = _uvicorn_method(protocol, name)
            if method is not None and not _uses(method, called):
                missing.append(f"{_PROTOCOL}.{name} -> {called}")
    for cls_name, cls in classes.items():
        if isinstance(cls, type):
            missing += [f"{cls_name}.{name}" for name in ATTRIBUTES[cls_name] if not _uses(cls.__init__, name)]
    return tuple(missing)


def public_settings(limits: HttpLimits) -> dict[str, object]:
    """``uvicorn.Config``'s public settings nearest to the limited protocol (see :data:`PUBLIC_PATH`)."""
    return {
        "http": "h11",
        "ws": "none",  # see protocol_settings
        "h11_max_incomplete_event_size": limits.max_head_bytes,
        "limit_concurrency": limits.max_connections,
        "timeout_keep_alive": limits.idle_seconds,
    }


@functools.cache
def limited_protocol_on() -> bool:
    """Whether this process serves HTTP on the limited protocol: probed once; where :func:`probe` finds something
    missing, the fallback is taken (:func:`adapters.take`)."""
    missing = probe()
    if missing:
        adapters.take(adapters.Fallback(LIBRARY, FEATURE, missing, PUBLIC_PATH))
    return not missing


def protocol_settings(limits: HttpLimits, events: ConnectionEvents) -> dict[str, object]:
    """``uvicorn.Config``'s protocol settings for one HTTP port: the limited protocol where it is on, else
    :func:`public_settings`."""
    if not limited_protocol_on():
        return public_settings(limits)
    module = importlib.import_module(MODULE)
    return {
        "http": limited_protocol(module.HttpToolsProtocol, limits, events),
        # No websockets on these ports: uvicorn would hand an upgraded connection to another protocol, past every
        # bound here (and the connection count would never see it end).
        "ws": "none",
        # uvicorn's own keep-alive close, which the limited protocol's idle timer always precedes: a backstop.
        "timeout_keep_alive": 2 * limits.idle_seconds,
    }


def _guarded(step: Callable[..., Any]) -> Callable[..., Any]:
    """One of this module's steps in a protocol callback: an exception from it drops the connection and is
    reported (the step then returns False: go no further), instead of reaching uvicorn or the event loop."""

    @functools.wraps(step)
    def run(self: _Limiter, *args: object) -> Any:
        try:
            return step(self, *args)
        except Exception as error:
            self.fail(step.__name__, error)
            return False

    return run


class _Port:
    """One port's open connections: the only ones counted against its ``max_connections``."""

    def __init__(self, limits: HttpLimits, events: ConnectionEvents) -> None:
        self.limits = limits
        self.events = events
        self.open = 0


class _Limiter:
    """One connection's bounds: its state, and the steps the protocol's callbacks take around uvicorn's."""

    def __init__(self, port: _Port, transport: asyncio.Transport) -> None:
        self.port = port
        self.events = port.events
        self.max_head = port.limits.max_head_bytes
        self.link = transport
        self.admitted = False  # counted against max_connections; uvicorn has the connection too
        self.stopped = False  # refused or failed: nothing more is parsed or answered
        self.used = 0  # non-body bytes of the request now arriving (or of the next one)
        self.in_message = False  # a request's first byte came, its last has not
        self.head_done = False  # the arriving request's head is complete
        self.cycle_made = False  # uvicorn made the last begun request's cycle (its head completed)
        self.begun = self.answered = 0  # requests begun, and answered, on this connection
        self.body_in_piece = 0
        self.began_in_piece = False
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def fail(self, step: str, error: Exception) -> None:
        self.stopped = True
        try:
            self.events.failed(step, self.address, error)
        except Exception:
            log.exception("reporting an HTTP protocol error failed; the error: %r", error)
        self.link.abort()

    @property
    def address(self) -> Any:
        return self.link.get_extra_info("peername")

    def drop(self) -> None:
        self.stopped = True
        self.link.abort()

    @_guarded
    def admit(self) -> bool:
        port = self.port
        if port.open >= port.limits.max_connections:
            return self._refuse_at_accept(HttpRefusal.TOO_MANY_CONNECTIONS)
        self.loop = asyncio.get_running_loop()
        self.arm()
        refusal = self.events.opened(self, port.open)  # last: from here the transport counts it
        if refusal is not None:
            self.disarm()
            return self._refuse_at_accept(refusal)
        port.open += 1
        self.admitted = True
        return True

    def _refuse_at_accept(self, reason: HttpRefusal) -> bool:
        self.stopped = True
        self.link.write(self.events.refused(reason, self.address))
        self.link.close()
        return False

    @_guarded
    def end(self) -> bool:
        self.stopped = True
        self.disarm()
        if self.admitted:
            self.admitted = False
            self.port.open -= 1
            self.events.closed(self)
        return True

    @_guarded
    def next_piece(self, data: bytes, start: int, protocol: Any) -> int:
        """Where the piece of ``data`` from ``start`` ends: at the next blank line, within the head's budget or
        a piece's cap; 0 when the connection is refused or done."""
        if self.stopped or self.link.is_closing():
            return 0
        self.body_in_piece = 0
        self.began_in_piece = False
        blank = data.find(_BLANK_LINE, start)
        end = len(data) if blank < 0 else blank + len(_BLANK_LINE)
        if self.head_done:
            return min(end, start + self.max_head)
        left = self.max_head - (self.used if self.in_message else 0)
        if left <= 0:  # a head that does not end within the limit: the parser never sees its excess
            self.refuse(protocol)
            return 0
        return min(end, start + left)

    @_guarded
    def account(self, length: int, protocol: Any) -> bool:
        """Count a parsed piece's non-body bytes; False when the connection is refused or done."""
        if self.stopped:
            return False
        counted = length - self.body_in_piece
        self.used = counted if self.began_in_piece else self.used + counted
        if self.used > self.max_head:
            self.refuse(protocol)
            return False
        if not self.in_message:
            self.used = 0
        return not self.link.is_closing()

    def refuse(self, protocol: Any) -> None:
        """Head and trailers above the limit: 431 and close where no answer is under way on the connection,
        else dropped (a 431 would land inside or after another answer)."""
        self.stopped = True
        link = self.link
        response = self.events.refused(HttpRefusal.HEADER_TOO_LARGE, link.get_extra_info("peername"))
        # The refused request is the last begun, whole or not: it alone may be unanswered, its answer not started.
        cycle = protocol.cycle if self.cycle_made else None
        if self.begun - self.answered != 1 or (cycle is not None and cycle.response_started):
            link.abort()
            return
        if cycle is not None:
            cycle.disconnected = True  # what the app still sends is dropped, not written after the 431
        link.write(response)
        link.close()

    @_guarded
    def began(self, scope: dict) -> bool:
        self.begun += 1
        self.in_message = True
        self.head_done = self.cycle_made = False
        self.began_in_piece = True
        scope[ABORT_KEY] = self.link.abort
        self.arm()  # the whole request must arrive within idle_seconds of its first byte
        return True

    @_guarded
    def headers_complete(self) -> bool:
        if self.stopped:
            return False
        self.head_done = self.cycle_made = True
        return True

    @_guarded
    def body(self, length: int) -> bool:
        if self.stopped:
            return False
        self.body_in_piece += length
        return True

    @_guarded
    def completed(self) -> bool:
        if self.stopped:
            return False
        self.in_message = False
        self.head_done = False
        if self.answered == self.begun:  # answered before it arrived whole: idle from now
            self.arm()
        else:
            self.disarm()  # in progress now, until answered
        return True

    @_guarded
    def answered_one(self) -> bool:
        if self.stopped:
            return False
        self.answered += 1
        # Idle again only once every request begun here is answered; one still arriving keeps its own timer.
        if not self.in_message and self.answered == self.begun and not self.link.is_closing():
            self.arm()
        return True

    def arm(self) -> None:
        self.disarm()
        self.timer = self.loop.call_later(self.port.limits.idle_seconds, self.expire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    @_guarded
    def expire(self) -> bool:
        self.timer = None
        if not self.link.is_closing():
            self.events.timed_out()
            self.link.abort()
        return True


def limited_protocol(base: type, limits: HttpLimits, events: ConnectionEvents) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's ``HttpToolsProtocol``, checked by :func:`probe`) with one port's ``limits``, telling
    ``events``."""
    port = _Port(limits, events)

    class LimitedHttpToolsProtocol(base):
        """uvicorn's httptools protocol with one port's bounds on non-body bytes, time and connections. Each
        override runs this module's steps (guarded) around uvicorn's own method, which is not guarded: its
        errors, as the parser's, are uvicorn's to handle."""

        _limiter: _Limiter

        def connection_made(self, transport: asyncio.Transport) -> None:
            self._limiter = _Limiter(port, transport)
            if self._limiter.admit():
                super().connection_made(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            seen = self._limiter.admitted  # refused at accept: uvicorn never saw it
            self._limiter.end()
            if seen:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            limiter = self._limiter
            start = 0
            while start < len(data):
                end = limiter.next_piece(data, start, self)
                if not end:
                    return
                super().data_received(data if end - start == len(data) else data[start:end])
                if not limiter.account(end - start, self):
                    return
                start = end

        def on_message_begin(self) -> None:
            if not self._limiter.stopped:
                super().on_message_begin()
                self._limiter.began(self.scope)

        def on_headers_complete(self) -> None:
            if self._limiter.headers_complete():
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self._limiter.body(len(body)):
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._limiter.completed():
                super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._limiter.answered_one()

    return LimitedHttpToolsProtocol
