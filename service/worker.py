"""One worker process of several, started by service/supervisor.py, never by hand:
``python -m indexer_service.service.worker RUNTIME_DIR SLOT STATUS_FD HTTP_FD HTTP_RPC_FD PARENT_PID CPU``.

A worker is the single-process server (:class:`service.server.IndexerServer`) with a :class:`WorkerLink` to its
supervisor: the gRPC port is shared with the other workers (SO_REUSEPORT, reserved by the supervisor), both HTTP
ports accept on the supervisor's listening sockets (inherited as ``HTTP_FD`` and ``HTTP_RPC_FD``, -1 when
``http_rpcs`` is off), the health port is the supervisor's,
readiness goes up the status pipe (``STATUS_FD``: ``listening``, ``ready 0``/``ready 1``, one a line), ``/readyz``
also asks the supervisor whether the whole replica is ready (a file in ``RUNTIME_DIR``), and the warmup takes the
replica's compile lock, so the first worker compiles into the shared Triton cache and the others load from it.
The worker dies with its supervisor (``PR_SET_PDEATHSIG``), and drains on SIGTERM as the single process does.
``CPU`` is the CPU its every thread runs on (``pin_workers``), or -1 for the replica's whole CPU set.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

CONFIG_FILE = "config.json"  # the supervisor's validated configuration, with the concrete ports
POD_STATUS_FILE = "pod-status"  # "" when every worker is ready, else why not (written by the supervisor)
WARMUP_LOCK_FILE = "warmup.lock"
_PR_SET_PDEATHSIG = 1

log = logging.getLogger(__name__)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the supervisor dies (a container's PID 1 taking its children down, outside one)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


class WorkerLink:
    """What a worker shares with its supervisor."""

    def __init__(self, runtime_dir: Path, slot: int, status_fd: int, http_fd: int, http_rpc_fd: int) -> None:
        self.runtime_dir = runtime_dir
        self.slot = slot
        self.http_fd = http_fd
        self.http_rpc_fd = http_rpc_fd
        self._status = os.fdopen(status_fd, "w", buffering=1)
        self._lock = threading.Lock()

    def report(self, line: str) -> None:
        with self._lock:
            try:
                self._status.write(line + "\n")
                self._status.flush()
            except (OSError, ValueError):  # the supervisor is gone; PR_SET_PDEATHSIG ends this process
                pass

    def report_ready(self, ready: bool) -> None:
        self.report(f"ready {int(ready)}")

    def pod_not_ready(self) -> str:
        """Why the replica is not ready ("" when every worker is)."""
        try:
            return (self.runtime_dir / POD_STATUS_FILE).read_text().strip()
        except OSError as exc:
            return f"the supervisor's status is unreadable: {exc}"

    def http_socket(self) -> socket.socket:
        return socket.socket(fileno=self.http_fd)

    def http_rpc_socket(self) -> socket.socket | None:
        return socket.socket(fileno=self.http_rpc_fd) if self.http_rpc_fd >= 0 else None

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


def run_worker(link: WorkerLink, signals: object) -> int:
    """Serve until SIGTERM (from the supervisor), then drain; the single process's :func:`service.server.serve`
    with a link instead of a port file."""
    from indexer_service.service.allocator import configure_malloc
    from indexer_service.service.config import ServiceConfig
    from indexer_service.service.server import IndexerServer

    values = json.loads((link.runtime_dir / CONFIG_FILE).read_text())
    values["compress_ratios"] = tuple(values["compress_ratios"])
    config = ServiceConfig(**values)
    logging.basicConfig(
        level=config.log_level.upper(),
        force=True,
        format=f"%(asctime)s %(levelname)s %(name)s %(message)s worker={link.slot}",
    )
    log.info("start pid=%d", os.getpid())
    configure_malloc(config.malloc_arena_max, config.malloc_retain_bytes)
    server = IndexerServer(config, link) if signals.pending() is None else None
    if server is None or signals.pending() is not None:
        log.info("shutdown signal=%s before the server started", signals.wait().name)
        return 0
    server.start()
    link.report("listening")
    received = signals.wait()
    log.info("shutdown signal=%s", received.name)
    server.shutdown()
    return 0


def pin_to_cpu(cpu: int) -> None:
    """Every thread of this process on ``cpu``; threads started later inherit it."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has just ended
            os.sched_setaffinity(int(task), {cpu})


def main(argv: list[str]) -> None:
    runtime_dir, slot, status_fd, http_fd, http_rpc_fd, parent, cpu = argv
    die_with_parent(int(parent))
    if int(cpu) >= 0:
        pin_to_cpu(int(cpu))
    from indexer_service.service.lifecycle import ShutdownSignals, end_process

    signals = ShutdownSignals()
    link = WorkerLink(Path(runtime_dir), int(slot), int(status_fd), int(http_fd), int(http_rpc_fd))
    try:
        code = run_worker(link, signals)
    except OSError as exc:  # a fatal start-up error (bind): the supervisor stops the replica if none started
        log.error("fatal %s", exc)
        print(f"indexer-service serve: worker {slot}: {exc}", file=sys.stderr)
        code = 1
    except BaseException:
        log.exception("fatal internal error")
        code = 1
    end_process(code)


if __name__ == "__main__":
    main(sys.argv[1:])
