"""How the serving process meets signals and ends.

:class:`ShutdownSignals` takes SIGTERM, SIGINT and SIGHUP from the first moment ``indexer-service serve`` runs (before
the configuration is read, the heavy imports and the warmup), so a signal at any moment ends the process
cleanly instead of killing it (-15) or raising KeyboardInterrupt somewhere. SIGHUP (a closed terminal, or
an operator's "reload") drains the same way: the server has no configuration to reload, and SIGHUP's default
action would kill it (exit 129) with no drain and, with workers, leave the supervisor's runtime directory.

:func:`end_process` ends it with ``os._exit`` once the server has drained, after flushing the logs. Why not a
normal interpreter exit: the warmup runs on a daemon thread that spends most of its time inside Triton's C++
compiler (MLIR and LLVM through pybind11). When the interpreter finalizes while that thread is inside C++,
the thread is torn down on its next return to Python (CPython 3.11 calls ``pthread_exit``, a forced unwind),
the unwind crosses C++ frames that do not allow it, and the process aborts: exit -6, "terminate called after
throwing an instance of ''" / "FATAL: exception not rethrown" (a SIGTERM early in a cold-cache warmup;
docs/service.md, "Shutdown"). A compile cannot be interrupted, and waiting for it could outlast any shutdown
grace, so the process ends without finalizing: nothing it owns needs finalizing once the drain is done (Triton
writes its cache entries atomically; the port file and the logs are written and flushed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import select
import signal
import socket
import sys

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
log = logging.getLogger(__name__)


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children, the workers, inherit it) and log
    it; returns the soft limit now. Every connection is a file descriptor, and some container runtimes start a
    process with a soft limit of 1,024 under a far higher hard one, which would cap connections long before the
    server's own caps (docs/overload.md, "Connections")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("open files limit: cannot raise %d to %d: %s", soft, hard, exc)
    log.info("open files limit=%s", "unlimited" if soft == resource.RLIM_INFINITY else soft)
    return soft


def _record_only(signum: int, frame: object) -> None:
    """The Python-level handler: the C-level handler already wrote the signal to the wakeup socket."""


class ShutdownSignals:
    """SIGTERM, SIGINT and SIGHUP, written by the C-level handler to a socket the main thread reads: no lock a handler
    could re-enter, no polling, and nothing lost between installing and waiting. Main thread only."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno())
        self._previous = {s: signal.signal(s, _record_only) for s in SHUTDOWN_SIGNALS}
        self.received: signal.Signals | None = None

    def _take(self, timeout: float | None) -> signal.Signals | None:
        while self.received is None:
            ready, _, _ = select.select([self._read], [], [], timeout)
            if not ready:
                return None
            for byte in self._read.recv(64):
                if byte in SHUTDOWN_SIGNALS:
                    self.received = signal.Signals(byte)
                    break
        return self.received

    def fileno(self) -> int:
        """The socket a signal makes readable, for a ``select`` that also waits on other things."""
        return self._read.fileno()

    def pending(self) -> signal.Signals | None:
        """The shutdown signal received so far, if any, without waiting."""
        return self._take(0)

    def wait(self, timeout: float | None = None) -> signal.Signals | None:
        """Block until a shutdown signal (at once if one came already), or for ``timeout`` seconds (then None)."""
        return self._take(timeout)

    def close(self) -> None:
        """Back to the handlers from before (a later signal is then not recorded)."""
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._read.close()
        self._write.close()


def end_process(code: int) -> None:
    """Flush the logs and standard streams, then end the process at once with ``code`` (see the module doc)."""
    # A broken log stream must not keep the process alive.
    for flushable in (*logging.getLogger().handlers, sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            flushable.flush()
    os._exit(code)
