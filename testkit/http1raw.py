"""The HTTP port's attacks on raw sockets: what no well-behaved HTTP client library would send.

- :func:`huge_header`: one request whose header grows to ``header_bytes`` (streamed in pieces), to see whether
  the server refuses it early or parses it all while probes wait; :func:`huge_trailer`, the same with a trailer
  field after a chunked body.
- :func:`chunked_request`: a chunked POST with trailers, whole or cut before its end (to send the rest slowly).
- :func:`seconds_until_closed`: how long the server takes to close a connection.
- :class:`IdleConnections`: sockets that connect and never send a byte.
- :class:`UnreadAnswers`: POSTs of a request with a large answer, from sockets that never read it.
"""

from __future__ import annotations

import errno
import os
import select
import selectors
import socket
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

_PIECE_BYTES = 64 * 1024
# The client's receive buffer for sockets that never read: small, so the answer stays on the server's side.
_SMALL_RCVBUF = 4096
# How many of :class:`IdleConnections`' connects wait for the server's answer at once: a flood's pace, within the
# listen backlog of the ports attacked (1,024 and more).
CONNECTS_IN_FLIGHT = 512


def _unconnected(host: str, source: str | None) -> socket.socket:
    """A TCP socket of ``host``'s family, bound to ``source`` where given (another peer address: any of
    127.0.0.0/8 reaches 127.0.0.1)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    if source is not None:
        try:
            sock.bind((source, 0))
        except OSError:
            sock.close()
            raise
    return sock


def _connect(
    host: str, port: int, rcvbuf: int | None = None, timeout: float = 5.0, source: str | None = None
) -> socket.socket:
    sock = _unconnected(host, source)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: it sizes the TCP window
    sock.settimeout(timeout)
    sock.connect((host, port))
    return sock


def _status_of(head: bytes) -> int | None:
    """The status code of an HTTP/1.1 response head, or None when ``head`` is not one."""
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else None


@dataclass
class HugeHeaderReport:
    header_bytes_sent: int  # of the growing field's value (a header's, or a trailer's)
    seconds: float
    status: int | None  # what the server answered (e.g. 431), None when it only closed or never answered
    closed_by_server: bool


def huge_header(host: str, port: int, header_bytes: int, max_seconds: float = 60.0) -> HugeHeaderReport:
    """``GET /livez`` with one header whose value grows to ``header_bytes``, sent in 64 KiB pieces; stops
    early when the server answers or closes, or after ``max_seconds``."""
    return _grow(host, port, f"GET /livez HTTP/1.1\r\nHost: {host}\r\nX-Padding: ".encode(), header_bytes, max_seconds)


def huge_trailer(
    host: str, port: int, path: str, body: bytes, trailer_bytes: int, max_seconds: float = 60.0
) -> HugeHeaderReport:
    """``POST path`` with ``body`` as one chunk, then one trailer field whose value grows to ``trailer_bytes``,
    sent as :func:`huge_header` sends its header."""
    start = chunked_request(host, path, body, {"X-Padding": ""})
    return _grow(host, port, start[: -len(b"\r\n\r\n")], trailer_bytes, max_seconds)


def chunked_request(
    host: str, path: str, body: bytes, trailers: dict[str, str], headers: dict[str, str] | None = None
) -> bytes:
    """A whole ``POST path``: ``body`` as one chunk (none when empty), the last chunk, ``trailers``, the blank
    line; ``headers`` beside Host, Content-Type (JSON) and Transfer-Encoding."""
    head = {"Host": host, "Content-Type": "application/json", "Transfer-Encoding": "chunked", **(headers or {})}
    lines = "".join(f"{name}: {value}\r\n" for name, value in head.items())
    chunk = f"{len(body):x}\r\n".encode() + body + b"\r\n" if body else b""
    tail = "".join(f"{name}: {value}\r\n" for name, value in trailers.items())
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + chunk + f"0\r\n{tail}\r\n".encode()


def _grow(host: str, port: int, start: bytes, padding_bytes: int, max_seconds: float) -> HugeHeaderReport:
    """``start``, then ``padding_bytes`` of ``a`` (a field's value) in 64 KiB pieces, then the blank line."""
    begin = time.monotonic()
    sent, status, closed = 0, None, False
    sock = _connect(host, port)
    sock.settimeout(max_seconds)  # a server that stops reading blocks a send: at most for the whole budget
    try:
        sock.sendall(start)
        piece = b"a" * _PIECE_BYTES
        while sent < padding_bytes and time.monotonic() - begin < max_seconds:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break  # the server answered (or closed) before the field ended
            try:
                sock.sendall(piece[: padding_bytes - sent])
            except TimeoutError:
                break
            except OSError:
                closed = True
                break
            sent += min(_PIECE_BYTES, padding_bytes - sent)
        else:
            try:
                sock.sendall(b"\r\n\r\n")
            except OSError:
                closed = True
        sock.settimeout(max(1.0, max_seconds - (time.monotonic() - begin)))
        try:
            head = sock.recv(4096)
            status = _status_of(head)
            closed = closed or not head
        except TimeoutError:
            pass
        except OSError:
            closed = True
    finally:
        sock.close()
    return HugeHeaderReport(sent, time.monotonic() - begin, status, closed)


def seconds_until_closed(sock: socket.socket, since: float, max_seconds: float) -> float | None:
    """Seconds from ``since`` (a ``time.monotonic()``) until the server closed or reset ``sock``, reading and
    dropping what it sends; None when it is still open ``max_seconds`` after ``since`` (looked at least once, so
    a ``since`` that long ago asks whether it is closed now)."""
    deadline = since + max_seconds
    while True:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            return None
        try:
            if sock.recv(65536):
                continue
        except OSError:
            pass  # reset
        return time.monotonic() - since


def _silent(sock: socket.socket) -> bool:
    """True while the server has neither closed the connection nor sent anything on it (a refusal such as a
    503 is data waiting to be read); reads nothing and never waits."""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # with a timeout set, Python would first wait that long for something to read
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False  # reset
    finally:
        sock.settimeout(timeout)
    return False  # closed (b"") or answered


def _connected(sock: socket.socket) -> bool:
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        while sock.recv(65536):
            pass
        return False  # closed
    except BlockingIOError:
        return True
    except OSError:
        return False  # reset
    finally:
        sock.settimeout(timeout)


class _Sockets:
    """Client sockets held from :meth:`open` to :meth:`close` (a ``with`` block)."""

    sockets: list[socket.socket]

    def open(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets = []

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class IdleConnections(_Sockets):
    """``count`` connections that send ``greeting`` (by default not a byte) and then nothing, open from
    :meth:`open` to :meth:`close` (a ``with``). Any protocol: an HTTP/2 preface makes an idle gRPC connection,
    the first bytes of a TLS ClientHello a handshake that never ends. ``source``: the address they come from
    (another peer than the default). They are opened as a flood is: :data:`CONNECTS_IN_FLIGHT` connects at once,
    each counted ``refused`` when the server refuses or resets it and ``unanswered`` when it has not completed
    ``connect_seconds`` after the first began (its SYNs were dropped: the peer is at its cap, or the listener's
    queue is full), then given up."""

    def __init__(
        self,
        host: str,
        port: int,
        count: int,
        greeting: bytes = b"",
        source: str | None = None,
        connect_seconds: float = 5.0,
    ) -> None:
        self.host, self.port, self.count, self.greeting, self.source = host, port, count, greeting, source
        self.connect_seconds = connect_seconds
        self.sockets: list[socket.socket] = []
        self.refused = 0  # connections the server refused outright
        self.unanswered = 0  # connects still waiting for the server's answer when given up

    def open(self) -> IdleConnections:
        deadline = time.monotonic() + self.connect_seconds
        waiting = selectors.DefaultSelector()
        started = 0
        with waiting:
            while started < self.count or waiting.get_map():
                while started < self.count and len(waiting.get_map()) < CONNECTS_IN_FLIGHT:
                    started += 1
                    try:
                        sock = _unconnected(self.host, self.source)
                    except OSError:  # no local port left for this source
                        self.refused += 1
                        continue
                    sock.setblocking(False)
                    error = sock.connect_ex((self.host, self.port))
                    if error in (0, errno.EINPROGRESS):
                        waiting.register(sock, selectors.EVENT_WRITE)
                    else:
                        sock.close()
                        self.refused += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _ in waiting.select(min(left, 0.05)):
                    sock = key.fileobj
                    waiting.unregister(sock)
                    self._connected(sock)
            for key in list(waiting.get_map().values()):
                key.fileobj.close()
                self.unanswered += 1
        return self

    def _connected(self, sock: socket.socket) -> None:
        """A connect that completed or failed: kept with its greeting sent, or counted refused."""
        sock.settimeout(5.0)
        try:
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                raise OSError(error, os.strerror(error))
            if self.greeting:
                sock.sendall(self.greeting)
        except OSError:
            sock.close()
            self.refused += 1
            return
        self.sockets.append(sock)

    def still_connected(self) -> int:
        """How many of the connections the server has not closed (or reset), whatever it sent on them; reads and
        drops what it sent, never waits."""
        return sum(_connected(sock) for sock in self.sockets)

    def still_open(self) -> int:
        """How many of the connections the server has neither closed nor answered (with a refusal)."""
        return sum(_silent(sock) for sock in self.sockets)


def open_together(floods: Iterable[IdleConnections], threads: int = 32) -> None:
    """Open every flood at once, as many peers would (each on a thread of its own, ``threads`` at most): one
    whose connects the server drops waits out its ``connect_seconds`` without holding the others back."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(IdleConnections.open, floods))


@dataclass
class UnreadAnswer:
    """One never-read POST, as found when the attacker finally reads: the answer's size, how much of it came,
    and whether the server closed (or reset) the connection first."""

    status: int | None
    content_length: int | None
    body_bytes_received: int
    closed_by_server: bool

    @property
    def complete(self) -> bool:
        return self.content_length is not None and self.body_bytes_received >= self.content_length

    @property
    def cut(self) -> bool:
        """The server gave up on the reader: closed before the whole answer was there."""
        return self.closed_by_server and not self.complete


class UnreadAnswers(_Sockets):
    """``count`` connections, each POSTing ``body`` to ``path`` and then not reading the answer until
    :meth:`collect` (or :meth:`close`, which never reads). The client's receive buffer is kept small, so the
    answer waits in the server's memory, not in the client's kernel."""

    def __init__(self, host: str, port: int, path: str, body: bytes, count: int) -> None:
        self.host, self.port, self.path, self.body, self.count = host, port, path, body, count
        self.sockets: list[socket.socket] = []
        self.failed = 0  # connections refused or closed before the request was sent

    def open(self) -> UnreadAnswers:
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(self.body)}\r\n\r\n"
        ).encode()
        for _ in range(self.count):
            try:
                sock = _connect(self.host, self.port, rcvbuf=_SMALL_RCVBUF)
                sock.sendall(head + self.body)
                self.sockets.append(sock)
            except OSError:
                self.failed += 1
        return self

    def collect(self, timeout: float = 10.0) -> list[UnreadAnswer]:
        """Read every connection now, each until its answer is complete or the server closed it, all within
        ``timeout`` together (a reader whose answer is still arriving then is neither complete nor cut)."""
        deadline = time.monotonic() + timeout
        return [self._read_answer(sock, deadline) for sock in self.sockets]

    @staticmethod
    def _read_answer(sock: socket.socket, deadline: float) -> UnreadAnswer:
        data = b""
        status = length = None
        body = 0
        closed = False
        try:
            while time.monotonic() < deadline:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                piece = sock.recv(1 << 20)
                if not piece:
                    closed = True
                    break
                if length is None:
                    data += piece
                    head, sep, rest = data.partition(b"\r\n\r\n")
                    if not sep:
                        continue
                    status = _status_of(head)
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value.strip())
                    body, data = len(rest), b""
                else:
                    body += len(piece)
                if body >= length:
                    break
        except TimeoutError:
            pass  # still arriving at the deadline
        except OSError:
            closed = True  # reset
        return UnreadAnswer(status, length, body, closed)
