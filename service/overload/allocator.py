"""glibc malloc settings for a server whose responses are megabytes.

Freed memory that glibc returns to the OS (a large block is its own mmap; a heap top is trimmed) comes back
as fresh pages, one page fault and a zero-fill per 4 KiB on the next call: most of a large BuildChunk's time, where
the memory kept for reuse costs none (docs/performance.md). Keeping it means RSS stays at the peak of the busiest
moment instead of shrinking back; fewer arenas bound that peak and keep idle RSS flat across long runs
(benchmarks/soak.py).

An operator's own ``MALLOC_*`` environment variables (read by glibc at start) always win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# glibc refuses a larger mmap threshold on 64-bit (HEAP_MAX_SIZE / 2); larger blocks stay mmaps.
MAX_MMAP_THRESHOLD = 32 * 2**20

_ARENA_MAX_ENV = "MALLOC_ARENA_MAX"  # read by glibc at start, and by idle_trim_caveat
# Each setting with the environment variables that, when the operator sets them, leave it to glibc.
_ENV_OVERRIDES = {
    "arena_max": (_ARENA_MAX_ENV,),
    "retain_bytes": ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"),
}


def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc's; musl has mallopt with other parameters
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    # Looked up once: find_library runs ldconfig in a subprocess, which a server mid-burst should not pay.
    try:
        malloc_trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return malloc_trim


def trim_heap() -> bool | None:
    """Return free heap pages to the OS now (glibc's malloc_trim(0); ctypes releases the GIL meanwhile); None
    where malloc is not glibc's."""
    malloc_trim = _malloc_trim()
    return None if malloc_trim is None else bool(malloc_trim(0))


def idle_trim_caveat(arena_max: int) -> str | None:
    """What the idle trim cannot hand back under this arena setting (an operator's MALLOC_ARENA_MAX wins), or
    None. glibc's malloc_trim returns the free top of the main arena only: memory freed at the top of any other
    arena stays resident, so with more than one arena a burst can keep RSS high for good."""
    arenas = arena_max
    if _ARENA_MAX_ENV in os.environ:
        try:
            arenas = int(os.environ[_ARENA_MAX_ENV])
        except ValueError:  # glibc ignores what is not a number
            arenas = 0
    if arenas == 1 or _malloc_trim() is None:
        return None
    shown = "glibc's default" if arenas <= 0 else str(arenas)
    return (
        f"malloc arenas: {shown}; the idle trim returns free memory of the main arena only, so a burst's memory "
        "freed on the others stays resident (malloc_arena_max = 1 avoids it)"
    )


def configure_malloc(arena_max: int, retain_bytes: int) -> dict[str, str]:
    """At most ``arena_max`` arenas (0: glibc's default); keep up to ``retain_bytes`` of freed memory per arena
    for reuse, and serve blocks up to that size (at most 32 MiB) from the heap (0: glibc's defaults). Call once,
    early, before the server's threads exist. Returns what each setting became, for the start-up log."""
    mallopt = _mallopt()
    outcome: dict[str, str] = {}
    for setting, value in (("arena_max", arena_max), ("retain_bytes", retain_bytes)):
        overridden = [name for name in _ENV_OVERRIDES[setting] if name in os.environ]
        if overridden:
            outcome[setting] = f"environment ({overridden[0]}={os.environ[overridden[0]]})"
        elif value == 0:
            outcome[setting] = "glibc default"
        elif mallopt is None:
            outcome[setting] = "not glibc: unchanged"
        elif setting == "arena_max":
            outcome[setting] = str(value) if mallopt(M_ARENA_MAX, value) else "refused by glibc"
        else:
            applied = mallopt(M_TRIM_THRESHOLD, value) and mallopt(M_MMAP_THRESHOLD, min(value, MAX_MMAP_THRESHOLD))
            outcome[setting] = str(value) if applied else "refused by glibc"
    log.info("malloc %s", " ".join(f"{k}={v}" for k, v in outcome.items()))
    return outcome


def open_fds() -> int:
    """File descriptors this process holds (each connection is one); 0 where /proc is missing. Linux 6.2 and later
    give the count as the directory's size, without listing it (which costs a name per descriptor)."""
    try:
        return os.stat("/proc/self/fd").st_size or len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


# Connections that must have closed since the last trim for a trim while calls go on: a flood's worth, not the
# churn of clients reconnecting every max_connection_age (a trim under traffic hands back memory that the next
# large answers then fault in again).
FLOOD_CONNECTIONS = 256


class IdleTrim:
    """Reads the process's open file descriptors every second, or every ``idle_seconds / 2`` when that is shorter
    (``on_fds(count)``: the ``indexer_open_fds`` gauge; each connection is one) and, with ``idle_seconds`` above 0,
    hands free heap back to the OS (:func:`trim_heap`) once per quiet spell of that long, on a daemon thread
    (:meth:`start`, :meth:`stop`). Quiet: no call ended
    (``last_call_end``, a ``time.monotonic()`` reading) and no connection closed (its descriptors did not fall); or,
    while calls go on, at least ``FLOOD_CONNECTIONS`` descriptors fewer than at their peak since the last trim and
    none closed for ``idle_seconds``. Without that second rule, the memory thousands of connections held (gRPC
    core's buffers; what one costs: docs/overload.md, "Connections") would stay resident after they closed, under
    steady traffic for good."""

    def __init__(
        self,
        idle_seconds: float,
        last_call_end: Callable[[], float] = lambda: 0.0,
        on_fds: Callable[[int], None] = lambda count: None,
    ) -> None:
        self.idle_seconds = idle_seconds
        self.last_call_end = last_call_end
        self.on_fds = on_fds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-trim", daemon=True)
        self._fds = self._peak_fds = 0
        self._connections_closed = 0.0
        self._trimmed_at: tuple[float, float] = (0.0, 0.0)

    def start(self) -> None:
        self._fds = self._peak_fds = open_fds()
        self.on_fds(self._fds)
        self._connections_closed = time.monotonic()
        self._trimmed_at = (self.last_call_end(), self._connections_closed)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def due(self, now: float, fds: int) -> bool:
        """One reading (``now`` a ``time.monotonic()`` value, ``fds`` the open descriptors): whether to trim now."""
        if fds < self._fds:
            self._connections_closed = now
        self._fds, self._peak_fds = fds, max(self._peak_fds, fds)
        last = (self.last_call_end(), self._connections_closed)
        if self.idle_seconds <= 0 or last == self._trimmed_at:
            return False
        quiet = now - max(last) >= self.idle_seconds
        flood_left = self._peak_fds - fds >= FLOOD_CONNECTIONS and now - self._connections_closed >= self.idle_seconds
        if not (quiet or flood_left):
            return False
        self._trimmed_at, self._peak_fds = last, fds
        return True

    def _run(self) -> None:
        interval = min(1.0, self.idle_seconds / 2) if self.idle_seconds > 0 else 1.0
        while not self._stop.wait(interval):
            fds = open_fds()
            self.on_fds(fds)
            if self.due(time.monotonic(), fds):
                log.debug("idle trim released=%s open_fds=%d", trim_heap(), fds)
