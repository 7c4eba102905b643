"""Whether the server takes calls: ready once the warmup finished well, not ready again when it drains.

Listeners (the health service, a worker's report to its supervisor) hear every change; the readiness gauge
(a single process's) is set here with it.
Compiles after ready are counted here too: each one means a launch missed the warmed set.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from indexer_service.service.compute.warmup import Warmup, WarmupState
from indexer_service.service.metrics import Metrics

log = logging.getLogger(__name__)


class Readiness:
    """The server's readiness, derived from its warmup and whether it drains."""

    def __init__(self, warmup: Warmup, metrics: Metrics, backend_name: str) -> None:
        self.warmup = warmup
        self.metrics = metrics
        self.backend_name = backend_name
        self._lock = threading.Lock()
        self._draining = False
        self._ready = False
        self._compiles_after_ready = 0
        self._listeners: list[Callable[[bool], None]] = []
        # The addresses the server listens on (``grpc=... health=... http=...``), set once it does: the ready
        # log line names them, so an operator reading only that line knows where to connect.
        self.listening = ""

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._ready

    @property
    def compiles_after_ready(self) -> int:
        with self._lock:
            return self._compiles_after_ready

    def add_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(ready)`` now and on every change (health service, a worker's report to its supervisor)."""
        with self._lock:
            self._listeners.append(listener)
            ready = self._ready
        listener(ready)

    def refresh(self) -> bool:
        """Ready = warmup finished well and not draining. Call after the warmup and on shutdown."""
        with self._lock:
            ready = self.warmup.finished_ok and not self._draining
            changed, self._ready = ready != self._ready, ready
            listeners = list(self._listeners) if changed else []
        for listener in listeners:
            listener(ready)
        if changed:
            if self.metrics.ready is not None:  # a worker's: its supervisor writes the replica's
                self.metrics.ready.set(int(ready))
            if ready:
                log.info("ready backend=%s warmup=%s %s", self.backend_name, self.warmup.state.value, self.listening)
            else:
                log.info("not ready reason=%s", self.not_ready_reason())
        return ready

    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True
        self.refresh()

    def not_ready_reason(self) -> str:
        """Why the server is not ready ("" when it is), for /readyz and UNAVAILABLE messages."""
        with self._lock:
            draining = self._draining
        if draining:
            return "draining: the server is shutting down"
        state = self.warmup.state
        if state is WarmupState.RUNNING:
            compiled = len(self.warmup.compiled_keys())
            return f"warming up: {compiled}/{len(self.warmup.keys)} kernel variants compiled"
        if state is WarmupState.FAILED:
            return "warmup failed: a kernel variant did not compile (see GetWarmupStatus and the server log)"
        return ""

    def on_kernel_compile(self, kernel_name: str) -> None:
        """Triton's post-compile hook: a compile after ready means a launch missed the warmed set."""
        if not self.warmup.finished_ok:
            return
        with self._lock:
            self._compiles_after_ready += 1
            total = self._compiles_after_ready
        self.metrics.compiles_after_ready_total.inc()
        log.warning(
            "compile after ready kernel=%s total=%d: a launch needed a variant outside the warmup",
            kernel_name,
            total,
        )
