"""The protocol between the supervisor (service/process/supervisor.py) and its workers (service/process/worker.py),
both sides in one place: how a worker is started, what it inherits, what it says, and the files they share.

- **Start**: ``python -m indexer_service.service.process.worker HANDOFF``, HANDOFF one JSON object (:class:`Handoff`):
  the runtime directory, the worker's slot, its status pipe, the inherited listening sockets by name, the
  supervisor's pid (the worker dies with it) and its CPU. The configuration is the runtime directory's
  ``config.json``, the supervisor's validated :class:`ServiceConfig` with the ports it bound, written and read by
  :func:`config_to_json` / :func:`config_from_json` (any field, tuples included, no per-field fix-up).
- **Inherited sockets**: :data:`SHARED_LISTENERS` names every listening socket the supervisor binds once and every
  worker accepts on, with the settings of its address; a new one is one line there.
- **Status**: the worker writes :class:`Status` words, one a line, on the status pipe.
- **The worker's side**: :class:`WorkerLink`, what a worker (and the server it runs, service/process/server.py) uses
  of all this.
- **Files** of the runtime directory: the configuration, the replica's readiness (``pod-status``, written by the
  supervisor, read by each worker's ``/readyz``), the warmup lock, the metrics directory, each worker's probe
  socket and the supervisor's own lock (held while it lives, so a later supervisor can tell a dead one's
  directory, :func:`service.process.supervisor.remove_leftovers`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import typing
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

from indexer_service.service.config import ServiceConfig

RUNTIME_PREFIX = "indexer-workers-"  # tempfile.mkdtemp's prefix of a supervisor's runtime directory
CONFIG_FILE = "config.json"
POD_STATUS_FILE = "pod-status"  # "" while the replica is ready, else why not
WARMUP_LOCK_FILE = "warmup.lock"
OWNER_LOCK_FILE = "supervisor.lock"  # flock-ed by the supervisor for its whole life
METRICS_DIR = "metrics"  # PROMETHEUS_MULTIPROC_DIR
# A unix socket's path must fit sun_path: 108 bytes with its NUL.
MAX_SOCKET_PATH_CHARS = 107
MAX_PID = 2**22  # Linux's largest pid_max: the longest probe socket name
WORKER_MODULE = "indexer_service.service.process.worker"


class SharedListener(NamedTuple):
    """A listening socket the supervisor binds and every worker inherits and accepts on: the ServiceConfig settings
    of its address (the supervisor writes the port it bound back into ``port_setting``), what the bind error names,
    and the bool setting that turns it on (None: always)."""

    host_setting: str
    port_setting: str
    what: str
    enabled_by: str | None = None


SHARED_LISTENERS: dict[str, SharedListener] = {
    "http": SharedListener("http_host", "http_port", "HTTP"),
    "http_rpc": SharedListener("http_host", "http_rpc_port", "HTTP RPCs", enabled_by="http_rpcs"),
}


class Status(StrEnum):
    """What a worker tells its supervisor, one line each."""

    LISTENING = "listening"  # its http_port server accepts on the inherited socket (http_rpc_port's once joined)
    READY = "ready 1"  # warmed up, and its gRPC server serves the shared port and its probe socket
    NOT_READY = "ready 0"  # not ready: said once at start (Readiness.add_listener), then when it drains


@dataclass(frozen=True)
class Handoff:
    """Everything a worker is started with (its argv), besides the configuration file."""

    runtime_dir: str
    slot: int
    status_fd: int
    sockets: dict[str, int]  # SHARED_LISTENERS name -> inherited file descriptor
    parent_pid: int
    cpu: int  # the CPU every thread runs on (pin_workers), -1 for the replica's whole CPU set

    def command(self) -> list[str]:
        return [sys.executable, "-m", WORKER_MODULE, json.dumps(asdict(self))]

    def inherited_fds(self) -> tuple[int, ...]:
        return (self.status_fd, *self.sockets.values())

    @classmethod
    def from_argv(cls, argv: list[str]) -> Handoff:
        (text,) = argv
        return from_json_values(cls, json.loads(text))


def worker_slot(pid: int) -> int | None:
    """The slot of worker process ``pid``, read from its command line (:meth:`Handoff.command`) in /proc; None when
    ``pid`` is not a worker or is gone (a zombie's command line is empty)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if len(argv) < 4 or argv[1:3] != [b"-m", WORKER_MODULE.encode()]:
        return None
    return Handoff.from_argv([argv[3].decode()]).slot


def probe_socket(runtime_dir: Path, pid: int) -> Path:
    """The unix socket worker ``pid``'s gRPC server also listens on, for the supervisor's health probes (private:
    the runtime directory is the supervisor's user's alone)."""
    return runtime_dir / f"p{pid}"


def config_to_json(config: ServiceConfig) -> str:
    return json.dumps(asdict(config))


def config_from_json(text: str) -> ServiceConfig:
    return from_json_values(ServiceConfig, json.loads(text))


def from_json_values(cls: type, values: dict[str, object]) -> typing.Any:
    """A dataclass from the values of its ``asdict`` after a JSON round trip: JSON has no tuples, so a field typed
    as a tuple gets its list back as a tuple; every other JSON value is already the field's type."""
    hints = typing.get_type_hints(cls)
    return cls(
        **{
            f.name: tuple(values[f.name]) if typing.get_origin(hints[f.name]) is tuple else values[f.name]
            for f in fields(cls)
        }
    )


class WorkerLink:
    """What a worker shares with its supervisor."""

    def __init__(self, handoff: Handoff) -> None:
        self.runtime_dir = Path(handoff.runtime_dir)
        self.slot = handoff.slot
        self.sockets = handoff.sockets
        self._status = os.fdopen(handoff.status_fd, "w", buffering=1)
        self._lock = threading.Lock()

    def report(self, status: Status) -> None:
        with self._lock:
            try:
                self._status.write(status.value + "\n")
                self._status.flush()
            except (OSError, ValueError):  # the supervisor is gone; PR_SET_PDEATHSIG ends this process
                pass

    def report_ready(self, ready: bool) -> None:
        self.report(Status.READY if ready else Status.NOT_READY)

    def pod_not_ready(self) -> str:
        """Why the replica is not ready ("" when it is)."""
        try:
            return (self.runtime_dir / POD_STATUS_FILE).read_text().strip()
        except OSError as exc:
            return f"the supervisor's status is unreadable: {exc}"

    def inherited_socket(self, name: str) -> socket.socket:
        """The supervisor's listening socket ``name`` (workerproto.SHARED_LISTENERS)."""
        return socket.socket(fileno=self.sockets[name])

    def probe_socket(self) -> Path:
        return probe_socket(self.runtime_dir, os.getpid())

    @contextlib.contextmanager
    def warmup_lock(self) -> Iterator[None]:
        """One worker warms up at a time: the first compiles into the shared Triton cache, the next ones find
        every kernel there and load it (milliseconds a key) instead of compiling it again."""
        with open(self.runtime_dir / WARMUP_LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
