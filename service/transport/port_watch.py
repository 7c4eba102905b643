"""Whether the RPC port takes new callers, told to readiness every second (service/compute/readiness.py).

Three ways the port can stop taking calls, each seen from outside the RPC lane's own threads:

- **every place held**: the RPC lane's ``max_concurrent_rpcs`` places all held for ``FULL_SECONDS``. Callers did it:
  the replica turns not ready (the Service routes new callers elsewhere), never not alive.
- **no call finishing**: calls queued for the RPC threads and none finished for ``STUCK_SECONDS`` (every thread in a
  call that does not end): not ready; after ``BROKEN_SECONDS``, not alive either (a deadlock is the server's fault).
- **no answer**: a health Check sent to the port's own probe socket (a unix socket, plaintext whatever the port's
  TLS) every ``interval`` and unanswered for ``STUCK_SECONDS`` (gRPC's polling thread gone or wedged): not ready;
  after ``BROKEN_SECONDS``, not alive.

Time the watch itself did not run (the whole process stopped, a frozen container) is excused, as the supervisor's
probes excuse it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from indexer_service.service.transport.gate import CallGate, Lane

log = logging.getLogger(__name__)

FULL_SECONDS = 2.0
STUCK_SECONDS = 5.0
BROKEN_SECONDS = 30.0
INTERVAL_SECONDS = 1.0


class RpcPortWatch:
    """Checks the RPC lane of ``gate`` and, where ``probe_socket`` is given, the port itself; ``report(problem,
    broken)`` hears every change ("" once the port takes callers again)."""

    def __init__(
        self,
        gate: CallGate,
        lane: Lane,
        report: Callable[[str, bool], None],
        probe_socket: Path | None = None,
        interval: float = INTERVAL_SECONDS,
    ) -> None:
        self.gate, self.lane, self.report = gate, lane, report
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rpc-port-watch", daemon=True)
        self._channel = self._check = None
        if probe_socket is not None:
            import grpc
            from grpc_health.v1 import health_pb2_grpc

            self._channel = grpc.insecure_channel(f"unix:{probe_socket}")
            self._check = health_pb2_grpc.HealthStub(self._channel).Check
        now = time.monotonic()
        self._last_run = now
        self._full_since: float | None = None
        self._finished, self._progress_at = lane.finished, now
        self._answered_at, self._in_flight = now, None
        self._state = ("", False)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self._in_flight is not None:
            self._in_flight.cancel()
        if self._channel is not None:
            self._channel.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                state = self.check(time.monotonic())
            except Exception:  # the watch must outlive anything it looks at
                log.exception("the RPC port's watch failed a check")
                continue
            if state != self._state:
                self._state = state
                self.report(*state)

    def check(self, now: float) -> tuple[str, bool]:
        """``(problem, broken)`` now: "" while the port takes callers."""
        gap = now - self._last_run - self.interval
        self._last_run = now
        if gap > 2 * self.interval:  # this process did not run meanwhile: nobody's silence
            self._progress_at += gap
            self._answered_at += gap
            if self._full_since is not None:
                self._full_since += gap
        lane = self.lane
        self._full_since = (self._full_since or now) if self.gate.held(lane) >= lane.places else None
        finished = lane.finished
        if finished != self._finished or lane.queue.qsize() == 0:
            self._finished, self._progress_at = finished, now
        self._poll_probe(now)
        stuck_for = now - self._progress_at
        silent_for = now - self._answered_at
        if silent_for >= STUCK_SECONDS:
            return f"it answered no health check for {silent_for:.0f} s", silent_for >= BROKEN_SECONDS
        if stuck_for >= STUCK_SECONDS:
            return f"calls are queued and none finished for {stuck_for:.0f} s", stuck_for >= BROKEN_SECONDS
        if self._full_since is not None and now - self._full_since >= FULL_SECONDS:
            return f"all {lane.places} places held by calls (max_concurrent_rpcs)", False
        return "", False

    def _poll_probe(self, now: float) -> None:
        if self._check is None:
            self._answered_at = now
            return
        from grpc_health.v1 import health_pb2

        if self._in_flight is not None and self._in_flight.done():
            if self._in_flight.exception() is None:
                self._answered_at = now
            self._in_flight = None
        if self._in_flight is None:
            self._in_flight = self._check.future(health_pb2.HealthCheckRequest(), timeout=STUCK_SECONDS)
