"""Whether the server takes calls: ready once the warmup finished well, not ready while its RPC port cannot take a
new caller, not ready again when it drains; and whether it is alive (what liveness asks).

Two states, because a client must never get a replica restarted: *ready* (the service's health name, readiness,
``/readyz``) is warmed up, not draining and its RPC port taking new callers; *alive* (the server-wide health
name "", liveness) is warmed up, not draining and its RPC port not broken. Every place of the RPC port held by
callers makes the replica not ready (the Service routes elsewhere) and leaves it alive; RPC threads that stopped
finishing calls, or a port that stopped answering, are the server's own fault and make it not alive too
(service/transport/port_watch.py tells which). Listeners (the health service, a worker's report to its supervisor)
hear every change; the readiness gauge (a single process's) is set here with it. Compiles after ready are counted
here too: each one means a launch missed the warmed set.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from indexer_service.service.compute.warmup import Warmup, WarmupState
from indexer_service.service.observability.metrics import Metrics

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
        self._alive = False
        # Why the RPC port cannot take a new caller ("" when it can), and whether that is the server's own fault.
        self._rpc_port_problem = ""
        self._rpc_port_broken = False
        self._compiles_after_ready = 0
        self._listeners: list[Callable[[bool], None]] = []
        self._alive_listeners: list[Callable[[bool], None]] = []
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

    @property
    def rpc_port_broken(self) -> bool:
        with self._lock:
            return self._rpc_port_broken

    def add_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(ready)`` now and on every change (health service, a worker's report to its supervisor)."""
        with self._lock:
            self._listeners.append(listener)
            ready = self._ready
        listener(ready)

    def add_alive_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(alive)`` now and on every change (the server-wide health name)."""
        with self._lock:
            self._alive_listeners.append(listener)
            alive = self._alive
        listener(alive)

    def set_rpc_port(self, problem: str, broken: bool) -> None:
        """Why the RPC port cannot take a new caller now ("" once it can), and whether it is ``broken`` (the
        server's own fault, not its callers')."""
        with self._lock:
            changed = (problem, broken) != (self._rpc_port_problem, self._rpc_port_broken)
            self._rpc_port_problem, self._rpc_port_broken = problem, broken
        if changed:
            if problem:
                log.warning("rpc_port_not_taking_callers broken=%s reason=%s", broken, problem)
            else:
                log.info("rpc_port_taking_callers")
            self.refresh()

    def refresh(self) -> bool:
        """Ready = warmup finished well, not draining and the RPC port taking callers; alive = the same but for
        callers holding every place. Call after the warmup, on shutdown and when the RPC port's state changes."""
        with self._lock:
            base = self.warmup.finished_ok and not self._draining
            ready = base and not self._rpc_port_problem
            alive = base and not self._rpc_port_broken
            changed, self._ready = ready != self._ready, ready
            alive_changed, self._alive = alive != self._alive, alive
            listeners = list(self._listeners) if changed else []
            alive_listeners = list(self._alive_listeners) if alive_changed else []
        for listener in listeners:
            listener(ready)
        for listener in alive_listeners:
            listener(alive)
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
            draining, rpc_port = self._draining, self._rpc_port_problem
        if draining:
            return "draining: the server is shutting down"
        if rpc_port:
            return f"the gRPC port takes no new caller: {rpc_port}"
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
