"""The service's log lines: their format (text or JSON, UTC), the request id every call's lines carry, and the
rate limit that keeps a flood of failing calls from becoming a flood of lines.

Every line is one event: ``event key=value ...`` in the message. ``log_format = "text"`` writes
``2026-12-04T15:48:36.123Z INFO logger event key=value ... request_id=... worker=N`` (``request_id`` while a call
is served, ``worker`` in a worker process); ``"json"`` writes one object a line with ``ts``, ``level``,
``logger``, ``event`` (a stable snake_case name: :func:`record_event`), ``msg`` (the whole message), each
``key=value`` of the message as a key of its own (numbers as numbers, quoted values unquoted; another library's
lines keep their text whole), ``request_id``, ``worker`` and ``exc`` (a traceback) where they apply; under it, a
configuration error at start is a JSON line too (:func:`error_line`):
``worker`` is a worker process's own slot on each of its lines, and in the supervisor's lines about a worker
(``worker exited worker=1 ...``) that worker's, from the message.
"""

from __future__ import annotations

import ast
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from contextvars import ContextVar

log = logging.getLogger(__name__)  # the failed-call lines

# The request id of the call this thread (or task) serves; "" outside a call. Set by the transports.
REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="")
REQUEST_ID_HEADER = "x-request-id"
# A caller's id is taken as it is when it is at most this long and of these characters (a UUID, a ULID, a
# W3C trace id, "svc-1/req:42"...): nothing that could break a log line or a JSON string. Anything else is
# replaced by a generated id.
MAX_REQUEST_ID_CHARS = 128
_VALID_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_REQUEST_ID_CHARS}}}").fullmatch
# Generated ids, ``next(NEW_REQUEST_IDS)``: a random prefix per process and a counter in hex, unique across the
# replicas without a random draw per call; a map over itertools.count, so a new id is made in C, without a Python
# frame, and atomically under the GIL. printf-style ``%x``, not ``str.format``: no format-spec parsing per call
# (docs/performance.md).
NEW_REQUEST_IDS = map(f"{os.urandom(6).hex()}-%x".__mod__, itertools.count(1))


def request_id_from(supplied: str | None) -> str:
    """The caller's id when it is a safe one, else a new one."""
    if supplied and _VALID_REQUEST_ID(supplied):
        return supplied
    return next(NEW_REQUEST_IDS)


def utc_timestamp(created: float) -> str:
    """ISO 8601 in UTC with milliseconds and the zone: ``2026-12-04T15:48:36.123Z``."""
    seconds = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int((created - seconds) * 1000):03d}Z"


class TextFormatter(logging.Formatter):
    """``ts level logger message [request_id=...] [worker=N]``, then the traceback's lines, if any."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.suffix = f" worker={worker}" if worker is not None else ""

    def format(self, record: logging.LogRecord) -> str:
        request_id = REQUEST_ID.get()
        line = (
            f"{utc_timestamp(record.created)} {record.levelname} {record.name} {record.getMessage()}"
            f"{f' request_id={request_id}' if request_id else ''}{self.suffix}"
        )
        traceback = _traceback(self, record)
        return f"{line}\n{traceback}" if traceback else line


# key=value in a message: a value is a quoted string (repr's or JSON's quotes) or runs to the next space.
_FIELD = re.compile(r"(?:^|(?<=\s))([A-Za-z_][\w.]*)=(\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|\S*)")
_INT = re.compile(r"-?\d+").fullmatch
_FLOAT = re.compile(r"-?\d+\.\d*(?:e[-+]?\d+)?").fullmatch
# The line's own keys: a message's field of one of these names stays in msg only. Not "worker": the supervisor's
# lines name the worker they are about, and a worker process's own slot overrides it on its lines.
_RESERVED = frozenset(("ts", "level", "logger", "event", "msg", "request_id", "exc"))


def message_fields(message: str) -> tuple[str, dict[str, object]]:
    """The event (the words before the first ``key=value``) and the fields of a message; a field whose name is
    one of the line's own keys is left in ``msg`` only."""
    fields: dict[str, object] = {}
    first = None
    for match in _FIELD.finditer(message):
        if first is None:
            first = match.start()
        name, value = match.group(1), match.group(2)
        if name not in _RESERVED:
            fields[name] = _field_value(value)
    event = message if first is None else message[:first]
    return event.strip(), fields


# An event's name: lower-case words, at most four (``shed``, ``worker exited``, ``rpc_port_taking_callers``).
_EVENT = re.compile(r"[a-z][a-z0-9_]*(?: [a-z][a-z0-9_]*){0,3}").fullmatch
OWN_LOGGERS = "indexer_service"


def record_event(record: logging.LogRecord, message: str) -> tuple[str, dict[str, object]]:
    """A record's ``event`` and its fields: for this service's own lines, the words before the first
    ``key=value`` as one snake_case name (``worker exited`` -> ``worker_exited``) and the fields, or ``message``
    where the line starts with free text; for another library's (uvicorn's, gRPC's, OpenTelemetry's), the name
    ``<library>_log`` and no fields: its text stays whole in ``msg``, never split into keys."""
    if not record.name.startswith(OWN_LOGGERS):
        return f"{record.name.split('.', 1)[0]}_log", {}
    event, fields = message_fields(message)
    return (event.replace(" ", "_") if _EVENT(event) else "message"), fields


def _field_value(text: str) -> object:
    if text[:1] in ("'", '"') and len(text) >= 2:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    if _INT(text):
        return int(text)
    if _FLOAT(text):
        return float(text)
    return text


class JsonFormatter(logging.Formatter):
    """One JSON object a line (see the module's docstring)."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        event, fields = record_event(record, message)
        line: dict[str, object] = {
            "ts": utc_timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "event": event,
            "msg": message,
            **fields,
        }
        if request_id := REQUEST_ID.get():
            line["request_id"] = request_id
        if self.worker is not None:
            line["worker"] = self.worker
        if traceback := _traceback(self, record):
            line["exc"] = traceback
        return json.dumps(line, default=str)


def _traceback(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    parts = [formatter.formatException(record.exc_info) if record.exc_info else ""]
    parts.append(formatter.formatStack(record.stack_info) if record.stack_info else "")
    return "\n".join(part for part in parts if part)


def configure_logging(level: str, log_format: str = "text", worker: int | None = None) -> None:
    """The process's log lines on stderr, at ``level``, in ``log_format`` (``text`` or ``json``, the setting's
    choices); ``worker``: this process's slot, on every line. Other libraries' lines of one logger and text (an
    exporter failing every few seconds, say) are written at most once every ``LIBRARY_LOG_INTERVAL_SECONDS``, with
    how many came meanwhile."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter((JsonFormatter if log_format == "json" else TextFormatter)(worker))
    handler.addFilter(LibraryLogLimit(LIBRARY_LOG_INTERVAL_SECONDS))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


LIBRARY_LOG_INTERVAL_SECONDS = 10.0


class LibraryLogLimit(logging.Filter):
    """Lets another library's record through at most once per (logger, message template) every ``interval``
    seconds; the one let through after a pause says how many were dropped (``[N more like it]``). The service's
    own records pass: its rate-limited lines are :class:`RateLimitedLog`'s."""

    def __init__(self, interval: float) -> None:
        super().__init__()
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._dropped: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(OWN_LOGGERS):
            return True
        key, now = (record.name, str(record.msg)), time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self.interval) < self.interval:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False
            self._last[key] = now
            dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} [{dropped} more like it]"
        return True


def error_line(log_format: str, logger: str, event: str, message: str, **fields: object) -> str:
    """A line for stderr before logging is configured (a configuration error at start): JSON under
    ``log_format = "json"``, with the fields of a log line; else ``message`` as it is."""
    if log_format != "json":
        return message
    line = {"ts": utc_timestamp(time.time()), "level": "ERROR", "logger": logger, "event": event, "msg": message}
    return json.dumps(line | {k: v for k, v in fields.items() if v is not None}, default=str)


class RateLimitedLog:
    """At most one line per key every ``interval`` seconds on ``logger``, with how many times the key came up since
    the last line (this one included), and none left unwritten: an event that comes while its key's line is not due
    is held (the latest one's line, in its call's request-id context) and written by a timer when it falls due:
    ``interval`` after the key's last line, which came before the event, so within ``interval`` of the event (give
    or take the timer's wake-up). :meth:`note` writes the refusal lines of shed calls and HTTP refusals,
    ``<event> reason=<reason> count=<n> <fields> port=<port> last=<detail>`` (a warning per event, reason and port);
    :meth:`write` takes a line of any shape."""

    def __init__(self, logger: logging.Logger, interval: float) -> None:
        self.logger = logger
        self.interval = interval
        self._lock = threading.Lock()
        self._pending: dict[Hashable, int] = {}
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, tuple[Callable[[int], None], str]] = {}
        _FLUSHER.watch(self)

    def write(self, key: Hashable, line: Callable[[int], None]) -> None:
        """One more event of ``key``; ``line(count)`` writes its line, now when one is due, else once it is (unless
        a later event's line replaces it: the line names the last event, the count all of them)."""
        now = time.monotonic()
        with self._lock:
            count = self._pending.get(key, 0) + 1
            due = now >= self._due_at(key)
            if due:
                self._pending[key] = 0
                self._last[key] = now
                self._held.pop(key, None)
            else:
                self._pending[key] = count
                newly_held = key not in self._held
                self._held[key] = (line, REQUEST_ID.get())
        if due:
            line(count)
        elif newly_held:  # a new due time: the timer learns of it (a later event of the key keeps the same one)
            _FLUSHER.wake()

    def _due_at(self, key: Hashable) -> float:
        """When (``time.monotonic()``) ``key``'s next line may be written: ``interval`` after its last one."""
        return self._last.get(key, -self.interval) + self.interval

    def next_due(self) -> float | None:
        """When the first held line falls due; None when none is held."""
        with self._lock:
            return min((self._due_at(key) for key in self._held), default=None)

    def flush(self, now: float | None = None) -> int:
        """Write every held line that is due; returns how many."""
        now = time.monotonic() if now is None else now
        due = []
        with self._lock:
            for key, held in list(self._held.items()):
                if now >= self._due_at(key):
                    due.append((held, self._pending.get(key, 0)))
                    self._pending[key] = 0
                    self._last[key] = now
                    del self._held[key]
        for (line, request_id), count in due:
            token = REQUEST_ID.set(request_id)
            try:
                line(count)
            finally:
                REQUEST_ID.reset(token)
        return len(due)

    def note(self, event: str, reason: str, detail: str, fields: str = "", port: str = "") -> None:
        """One more ``reason`` for ``event`` on ``port`` (a port's name, or "" where the event has none): a line per
        reason and port, so a flood on one port does not hide the same refusals on another (the probes' port)."""
        more = f" {fields}" if fields else ""
        more += f" port={port}" if port else ""
        self.write(
            (event, reason, port),
            lambda count: self.logger.warning("%s reason=%s count=%d%s last=%r", event, reason, count, more, detail),
        )


# The longest the timer sleeps with nothing due: a safety net only, as each newly held line wakes it.
FLUSH_SECONDS = 1.0


class _Flusher:
    """One daemon thread for the process that writes every live :class:`RateLimitedLog`'s held lines when they fall
    due: it sleeps until the soonest held line's due time (at most :data:`FLUSH_SECONDS`), and a line newly held
    wakes it to look again."""

    def __init__(self) -> None:
        self._logs: weakref.WeakSet[RateLimitedLog] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def watch(self, rate_limited: RateLimitedLog) -> None:
        with self._lock:
            self._logs.add(rate_limited)
            if self._thread is None or not self._thread.is_alive():  # started lazily; again after a fork
                self._wake = threading.Event()  # not one a thread of the parent may have held at the fork
                self._thread = threading.Thread(target=self._run, name="log-flush", daemon=True)
                self._thread.start()

    def wake(self) -> None:
        """A line was newly held: look at the due times again."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before looking: a line held from here on sets it again
            with self._lock:
                logs = list(self._logs)
            soonest = time.monotonic() + FLUSH_SECONDS
            for rate_limited in logs:
                try:
                    rate_limited.flush()
                    due = rate_limited.next_due()
                except Exception:  # a line that cannot be written must not stop the others'
                    log.exception("a held log line could not be written")
                    continue
                if due is not None:
                    soonest = min(soonest, due)
            self._wake.wait(max(0.0, soonest - time.monotonic()))


_FLUSHER = _Flusher()


class LibraryCallbackErrors:
    """Exceptions of the service's own code caught on a library's thread (gRPC's polling thread, uvicorn's event
    loop): each counted in ``metrics``' ``indexer_library_callback_errors_total`` by where it came from, and logged
    on ``logger`` with its traceback at most once per where every ``interval`` seconds
    (``library_callback_error where=... count=N error=... [detail]``)."""

    def __init__(self, logger: logging.Logger, metrics: object, interval: float) -> None:
        self.logger = logger
        self.metrics = metrics
        self._log = RateLimitedLog(logger, interval)

    def record(self, where: str, exc: BaseException, detail: str = "") -> None:
        self.metrics.child(self.metrics.library_callback_errors_total, where).inc()
        more = f" {detail}" if detail else ""
        self._log.write(
            where,
            lambda count: self.logger.error(
                "library_callback_error where=%s count=%d error=%r%s", where, count, exc, more, exc_info=exc
            ),
        )


# One line per (transport, method, code) at most this often; the line counts every failure in between.
FAILED_CALL_LOG_INTERVAL_SECONDS = 10.0


class FailedCallLog:
    """The log of calls that did not succeed: one line per (transport, method, code) every
    :data:`FAILED_CALL_LOG_INTERVAL_SECONDS` with the count since the previous line and the last call's details,
    peer and request id (the line is written in that call's context); INTERNAL always, at ERROR (the data plane
    logs its traceback)."""

    def __init__(self, interval: float = FAILED_CALL_LOG_INTERVAL_SECONDS) -> None:
        self.log = RateLimitedLog(log, interval)

    def record(self, transport: str, method: str, code: str, details: str, peer: str, milliseconds: float) -> None:
        internal = code == "INTERNAL"

        def line(count: int) -> None:
            self.log.logger.log(
                logging.ERROR if internal else logging.INFO,
                "%s method=%s code=%s count=%d ms=%.3f peer=%s details=%s",
                transport,
                method,
                code,
                count,
                milliseconds,
                peer,
                json.dumps(details),
            )

        if internal:
            line(1)
        else:
            self.log.write((transport, method, code), line)
