"""Several worker processes behind one replica's ports: ``serve`` with ``workers`` above 1.

One Python process serves about one core (the GIL), so a replica with N CPUs runs N workers (service/process/worker.py),
each a whole single-process server; service/process/workerproto.py is the protocol between them. This supervisor owns
what the replica shares:

- **The gRPC port**, shared by the workers with SO_REUSEPORT: the kernel hands each new connection to one of
  them. Before any worker binds, the supervisor binds the port *without* SO_REUSEPORT (so a port anybody else
  holds, another replica of this service included, is refused: ``cannot bind gRPC``), then holds it with an
  SO_REUSEPORT socket that never listens (it reserves the port and receives no connection) for the workers to
  join. A worker joins only once warmed up, so no connection lands on a worker that cannot serve it yet (after a
  restart the Triton cache is warm: a restarted worker joins within its start-up time). Left open: a process of the
  same user that sets SO_REUSEPORT itself can still join the group; the kernel refuses one of another user.
- **The HTTP ports** (workerproto.SHARED_LISTENERS: ``http_port``, and ``http_rpc_port`` unless ``http_rpcs`` is
  false): one listening socket each, inherited by every worker, which all accept on (``/metrics``, ``/livez``,
  ``/readyz`` are answered by whichever worker accepts); on ``http_rpc_port`` a worker accepts only once it has
  joined the gRPC port (warmed up).
- **Readiness** (the health port's grpc.health.v1 for the kubelet, served here; ``/readyz``, each worker reading
  the supervisor's verdict; ``indexer_ready``): ready the first time once every worker is, then while at least
  ``min_ready_workers`` are (0: a majority) and not draining; so a replica that can serve says so while a worker
  restarts or crash-loops. The gRPC port's own health service is per worker, i.e. per connection, which is what
  a client's health checking needs.
- **Hangs**: each ready worker's gRPC server also listens on a private unix socket, where the supervisor sends a
  grpc.health.v1 Check every quarter of ``worker_hang_seconds`` (at most every second); a worker that has not
  answered for ``worker_hang_seconds`` is killed (SIGKILL), logged (``worker hung``) and restarted.
- **Metrics**: prometheus_client's multiprocess mode in the runtime directory (``PROMETHEUS_MULTIPROC_DIR``), so
  ``/metrics`` of any worker is the replica's; here ``indexer_ready``, ``indexer_worker_up``,
  ``indexer_worker_ready`` and ``indexer_worker_restarts_total{worker,reason}``, and this process's share of
  ``indexer_open_fds`` and of the health port's ``indexer_peer_connections_closed_total`` and
  ``indexer_requests_shed_total`` (:class:`~service.observability.metrics.SupervisorMetrics`). The directory is named
  before this process imports prometheus_client (:func:`supervise`), which then keeps the supervisor's values there as
  it does the workers'. A dead worker's files are retired (service/observability/metrics.py :func:`retire_process`): the
  directory does not grow with restarts.
- **The warmup**: workers warm up one at a time under a file lock; the first compiles into the Triton cache,
  the others load what it wrote.
- **The runtime directory** (``$TMPDIR/indexer-workers-*``): removed on every exit the supervisor controls; one
  left by a supervisor killed by SIGKILL (which cannot clean up) is removed by the next supervisor's start.

A worker that dies is logged (``worker exited``), counted by reason (``exit``, ``killed``, ``hung``), and
restarted after a backoff (``worker_restart_backoff_seconds``, 0.5 s, doubling to
``worker_restart_backoff_max_seconds``, 10 s; back to the first once a worker has lived 30 s). A worker that
fails (exit 1) on its first start before it was ever ready (a bind error, say) stops the replica with exit 1.
SIGTERM (or SIGINT, SIGHUP): the health port turns NOT_SERVING, every worker gets SIGTERM and drains as a single
process does, and the supervisor exits 0 once all have ended (SIGKILL for any still running after delay + grace +
5 s).
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from indexer_service.service.adapters import prometheus
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.config import ServiceConfig
from indexer_service.service.overload.allocator import IdleTrim, configure_malloc
from indexer_service.service.process import cgroups
from indexer_service.service.process.lifecycle import ShutdownSignals
from indexer_service.service.process.listeners import bind_shared, bind_tcp
from indexer_service.service.process.workerproto import (
    CONFIG_FILE,
    MAX_PID,
    MAX_SOCKET_PATH_CHARS,
    METRICS_DIR,
    OWNER_LOCK_FILE,
    POD_STATUS_FILE,
    RUNTIME_PREFIX,
    SHARED_LISTENERS,
    Handoff,
    Status,
    config_to_json,
    probe_socket,
)
from indexer_service.service.reasons import Port, RestartReason

if TYPE_CHECKING:  # the module imports prometheus_client, which must wait until the directory is named
    from indexer_service.service.overload.peers import PeerCap

log = logging.getLogger(__name__)

STABLE_SECONDS = 30.0  # a worker that lived this long starts the restart backoff over
_POLL_SECONDS = 0.2
_PROBE_INTERVAL_SECONDS = 1.0  # the most time between two probes of a worker
# A gap this long between two steps (which come every _POLL_SECONDS) means the supervisor itself did not run.
_STALL_SECONDS = 1.0


# --- how many ----------------------------------------------------------------------------------------------


def worker_cpus(workers: int, mode: str) -> tuple[list[int] | None, str]:
    """Each worker's CPU when they are pinned (``pin_workers``), else None; and why. A pinned worker's threads
    stay on its CPU instead of wandering over the others', and the replica serves more calls (docs/performance.md).
    ``auto`` pins only where the CPUs are the replica's own: a CPU quota equal to the CPU set, one worker per CPU (a
    Guaranteed pod under the static CPU manager); a CPU set shared with other pods is left to the scheduler."""
    cpus = cgroups.cpu_set()
    if mode == "off" or len(cpus) < workers:
        return None, f"pin_workers {mode}, {len(cpus)} CPUs for {workers} workers"
    if mode == "auto":
        quota = cgroups.cpu_quota()
        if quota is None or abs(quota - len(cpus)) > 1e-6 or workers != len(cpus):
            return None, f"pin_workers auto: cpu quota {quota}, {len(cpus)} CPUs, {workers} workers (not exclusive)"
    return cpus[:workers], f"pin_workers {mode}"


def resolve_workers(setting: int) -> tuple[int, str]:
    """``workers`` as configured, or for 0 the container's CPUs; and why."""
    if setting > 0:
        return setting, "setting"
    return cgroups.available_cpus()


# --- the shared ports --------------------------------------------------------------------------------------


def reserve_grpc_port(host: str, port: int) -> tuple[socket.socket, int]:
    """Own ``host:port`` for this replica's workers: refused if anyone holds it (bound without SO_REUSEPORT
    first), then held by an SO_REUSEPORT socket that never listens, which the workers' listeners join."""
    with bind_tcp(host, port, "gRPC") as probe:
        port = probe.getsockname()[1]
    return bind_tcp(host, port, "gRPC", socket.SO_REUSEPORT), port


# --- the runtime directory ---------------------------------------------------------------------------------


class RuntimeDir:
    """The supervisor's private directory (``$TMPDIR/indexer-workers-*``, mode 0700): the workers' configuration,
    the replica's readiness, the warmup lock, the metrics files and the probe sockets. Its ``supervisor.lock`` is
    flock-ed for the supervisor's life, so a later supervisor removes the directories whose lock nobody holds
    (:func:`remove_leftovers`): those of supervisors killed by SIGKILL (or OOM-killed), which could not remove
    their own."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX))
        # Locked before it gets the name remove_leftovers looks for, so no live directory ever looks dead.
        partial = self.path / (OWNER_LOCK_FILE + ".partial")
        self._lock = open(partial, "w")  # noqa: SIM115 - held open (and locked) until remove()
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        partial.rename(self.path / OWNER_LOCK_FILE)
        if len(str(probe_socket(self.path, MAX_PID))) > MAX_SOCKET_PATH_CHARS:
            self.remove()
            raise OSError(f"the runtime directory {self.path} is too long for a unix socket: set a shorter TMPDIR")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._lock.close()


def remove_leftovers(parent: Path) -> list[Path]:
    """Remove the runtime directories in ``parent`` of supervisors that are gone (their lock is free); returns
    them. Directories of live supervisors (locked), of other users (unreadable) or without a lock are left."""
    removed = []
    for candidate in sorted(parent.glob(RUNTIME_PREFIX + "*")):
        try:
            lock = open(candidate / OWNER_LOCK_FILE)  # noqa: SIM115 - closed below, after the removal
        except OSError:
            continue
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its supervisor lives
                continue
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


# --- the workers -------------------------------------------------------------------------------------------


@dataclass
class Slot:
    """One worker's place: the process now in it, and its history."""

    number: int
    process: subprocess.Popen | None = None
    status_fd: int = -1
    buffer: bytes = b""
    started_at: float = 0.0
    listening: bool = False
    ready: bool = False
    ever_ready: bool = False
    lives: int = 0
    failures_in_a_row: int = 0
    restart_at: float | None = None
    last_exit: str = ""
    restart_reason: RestartReason | None = None
    hung: bool = False  # the supervisor killed it for not answering
    probe: WorkerProbe | None = None

    def close_channels(self) -> None:
        """Close what the supervisor holds to talk to this slot's process: the status pipe and the probe channel."""
        if self.status_fd >= 0:
            os.close(self.status_fd)
            self.status_fd = -1
        if self.probe is not None:
            self.probe.close()
            self.probe = None

    @property
    def label(self) -> str:
        return str(self.number)

    def state(self) -> str:
        if self.ready:
            return "ready"
        if self.process is None:
            when = f", restarting in {max(0.0, self.restart_at - time.monotonic()):.1f} s" if self.restart_at else ""
            return f"down ({self.last_exit}){when}"
        return "warming up" if self.listening else "starting"


class WorkerProbe:
    """grpc.health.v1 Check, every ``interval``, to one worker's gRPC server over its private unix socket: an
    answer proves the worker's gRPC poller and threads run (a heartbeat thread would answer from a process whose
    server is wedged). At most one probe is in flight; :meth:`silent_seconds` is the time since the last answer
    (SERVING or not), or since the worker turned ready."""

    def __init__(self, path: Path, interval: float, deadline: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2_grpc

        self.channel = grpc.insecure_channel(f"unix:{path}")
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.interval, self.deadline = interval, deadline
        self.last_answer = self.last_sent = time.monotonic()
        self.in_flight = None

    def poll(self, now: float) -> None:
        from grpc_health.v1 import health_pb2

        if self.in_flight is not None and self.in_flight.done():
            if self.in_flight.exception() is None:
                self.last_answer = now
            self.in_flight = None
        if self.in_flight is None and now - self.last_sent >= self.interval:
            self.last_sent = now
            self.in_flight = self.stub.Check.future(health_pb2.HealthCheckRequest(), timeout=self.deadline)

    def silent_seconds(self, now: float) -> float:
        return now - self.last_answer

    def excuse(self, seconds: float) -> None:
        """Time the supervisor itself did not run (the whole container starved or frozen) is nobody's silence."""
        self.last_answer += seconds

    def close(self) -> None:
        if self.in_flight is not None:
            self.in_flight.cancel()
        self.channel.close()


class Supervisor:
    """The replica's shared parts and its workers; ``runtime``: its directory, the multiprocess one named
    (:func:`supervise`), ``metrics_in_files`` whether this process's metrics keep their values there."""

    def __init__(
        self,
        config: ServiceConfig,
        workers: int,
        source: str,
        signals: ShutdownSignals,
        runtime: RuntimeDir,
        metrics_in_files: bool = True,
    ) -> None:
        self.config = config
        self.workers = workers
        self.source = source
        self.signals = signals
        self.slots = [Slot(n) for n in range(workers)]
        self.cpus, self.pinning = worker_cpus(workers, config.pin_workers.lower())
        self.min_ready = min(workers, config.min_ready_workers or workers // 2 + 1)
        self.hang_seconds = config.worker_hang_seconds
        self.draining = False
        self.pod_ready = self.ever_ready = False
        self.runtime: RuntimeDir | None = runtime
        self.metrics_in_files = metrics_in_files
        self._grpc_hold: socket.socket | None = None
        self.listeners: dict[str, socket.socket] = {}
        self.health = self.health_server = None
        self.metrics = None
        self._idle_trim: IdleTrim | None = None
        self.peer_cap: PeerCap | None = None
        self._to_retire: list[int] = []  # dead workers whose metrics files are still to fold in
        self._last_step = time.monotonic()
        self._status_written: str | None = None

    @property
    def metrics_dir(self) -> Path:
        return self.runtime.path / METRICS_DIR

    # -- start ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        from indexer_service.service.observability.metrics import SupervisorMetrics
        from indexer_service.service.overload.admission import ShedLog
        from indexer_service.service.overload.peers import PeerCap, connection_limits
        from indexer_service.service.process.server import listening_addresses
        from indexer_service.service.transport.gate import Accounting
        from indexer_service.service.transport.grpc_server import HEALTH_NAMES, create_health_server
        from indexer_service.service.transport.health import HealthServicer

        for leftover in remove_leftovers(Path(tempfile.gettempdir())):
            log.warning("removed the runtime directory of a supervisor that is gone path=%s", leftover)
        if not self.metrics_in_files:
            log.warning(
                "the supervisor's own series are not in /metrics (%s): prometheus_client was imported before the "
                "multiprocess directory was named, and its value class cannot be picked again",
                prometheus.SUPERVISOR_SERIES,
            )
        config = self.config
        self.metrics = SupervisorMetrics(self.workers)
        self._grpc_hold, grpc_port = reserve_grpc_port(config.grpc_host, config.grpc_port)
        self.listeners = bind_shared(config)
        bound = {SHARED_LISTENERS[name].port_setting: sock.getsockname()[1] for name, sock in self.listeners.items()}
        shed = ShedLog(self.metrics).on(Port.HEALTH)
        self.health = HealthServicer(HEALTH_NAMES)
        self.health_server = create_health_server(config, self.health, Accounting(self.metrics, shed), grpc_port)
        health_port = self.health_server.port
        self.config = replace(config, grpc_port=grpc_port, health_port=health_port, workers=1, **bound)
        self._write_status("starting")
        (self.runtime.path / CONFIG_FILE).write_text(config_to_json(self.config))
        self.health_server.server.start()
        # The health port's connections come and go here too: counted, and their memory handed back.
        self.peer_cap = PeerCap(
            config.max_connections_per_peer,
            {health_port: Port.HEALTH},
            self.metrics.peer_cap,
            limits=connection_limits(config),
        )
        self._idle_trim = IdleTrim(config.idle_trim_seconds, on_fds=self.metrics.open_fds.set)
        self._idle_trim.start()
        self.peer_cap.start()
        rpc_listener = self.listeners.get("http_rpc")
        self.listening = listening_addresses(
            self.config,
            grpc_port,
            health_port,
            self.config.http_port,
            self.config.http_rpc_port if rpc_listener is not None else None,
        )
        log.info(
            "workers n=%d from=%s cpus=%s (%s) min_ready_workers=%d worker_hang_seconds=%g %s (gRPC shared, "
            "SO_REUSEPORT) runtime=%s",
            self.workers,
            self.source,
            ",".join(map(str, self.cpus)) if self.cpus else "shared",
            self.pinning,
            self.min_ready,
            self.hang_seconds,
            self.listening,
            self.runtime.path,
        )
        for slot in self.slots:
            self._spawn(slot)

    def _spawn(self, slot: Slot) -> None:
        read, write = os.pipe()
        handoff = Handoff(
            runtime_dir=str(self.runtime.path),
            slot=slot.number,
            status_fd=write,
            sockets={name: sock.fileno() for name, sock in self.listeners.items()},
            parent_pid=os.getpid(),
            cpu=self.cpus[slot.number] if self.cpus else -1,
        )
        try:
            slot.process = subprocess.Popen(handoff.command(), pass_fds=handoff.inherited_fds())
        finally:
            os.close(write)
        os.set_blocking(read, False)
        slot.status_fd, slot.buffer = read, b""
        slot.started_at, slot.listening, slot.ready, slot.restart_at = time.monotonic(), False, False, None
        slot.lives += 1
        self.metrics.worker_up.labels(worker=slot.label).set(1)
        if slot.lives > 1:
            self.metrics.worker_restarts_total.labels(worker=slot.label, reason=slot.restart_reason).inc()
            log.warning(
                "worker restarted worker=%d pid=%d reason=%s restarts=%d",
                slot.number,
                slot.process.pid,
                slot.restart_reason,
                slot.lives - 1,
            )
        else:
            log.info("worker started worker=%d pid=%d", slot.number, slot.process.pid)

    # -- run ------------------------------------------------------------------------------------------------

    def all_listening(self) -> bool:
        return all(slot.listening or slot.ever_ready for slot in self.slots)

    def step(self, timeout: float = _POLL_SECONDS) -> bool:
        """Wait up to ``timeout`` for a signal or a worker's word; handle exits, hangs and restarts. False once a
        shutdown signal has come."""
        now = time.monotonic()
        due = [s.restart_at for s in self.slots if s.restart_at is not None]
        timeout = max(0.0, min([timeout, *(d - now for d in due)]))
        fds = [s.status_fd for s in self.slots if s.status_fd >= 0]
        readable, _, _ = select.select([self.signals, *fds], [], [], timeout)
        if self.signals.pending() is not None:
            return False
        now = time.monotonic()
        stalled, self._last_step = now - self._last_step, now
        for slot in self.slots:
            if slot.status_fd in readable:
                self._read_status(slot)
            if slot.probe is not None:
                if stalled > _STALL_SECONDS:
                    slot.probe.excuse(stalled)
                self._check_alive(slot, now)
            if slot.process is not None and slot.process.poll() is not None:
                self._exited(slot)
            if slot.restart_at is not None and time.monotonic() >= slot.restart_at and not self.draining:
                self._spawn(slot)
        if self._to_retire:
            from indexer_service.service.observability.metrics import retire_process

            self._to_retire = [pid for pid in self._to_retire if not retire_process(pid, str(self.metrics_dir))]
        self._refresh()
        return True

    def _read_status(self, slot: Slot) -> None:
        try:
            data = os.read(slot.status_fd, 4096)
        except BlockingIOError:
            return
        if not data:  # the worker closed it: it is ending
            os.close(slot.status_fd)
            slot.status_fd = -1
            return
        *lines, slot.buffer = (slot.buffer + data).split(b"\n")
        for line in lines:
            status = Status(line.decode())
            if status is Status.LISTENING:
                slot.listening = True
                continue
            slot.ready = status is Status.READY
            slot.ever_ready = slot.ever_ready or slot.ready
            self.metrics.worker_ready.labels(worker=slot.label).set(int(slot.ready))
            pid = slot.process.pid if slot.process else -1
            log.info("worker %s worker=%d pid=%d", "ready" if slot.ready else "not ready", slot.number, pid)
            if slot.ready and slot.probe is None and self.hang_seconds > 0:
                interval = min(_PROBE_INTERVAL_SECONDS, self.hang_seconds / 4)
                slot.probe = WorkerProbe(probe_socket(self.runtime.path, pid), interval, self.hang_seconds)

    def _check_alive(self, slot: Slot, now: float) -> None:
        """Probe a ready worker; kill one silent for ``worker_hang_seconds`` (SIGKILL: its connections close and
        their clients reconnect to workers that answer); it is then restarted as any dead worker is."""
        slot.probe.poll(now)
        silent = slot.probe.silent_seconds(now)
        if silent < self.hang_seconds or slot.process is None or slot.hung:
            return
        slot.hung = True
        log.error(
            "worker hung worker=%d pid=%d silent_seconds=%.1f worker_hang_seconds=%g: killed",
            slot.number,
            slot.process.pid,
            silent,
            self.hang_seconds,
        )
        slot.process.kill()

    def _exited(self, slot: Slot) -> None:
        process = slot.process
        code = process.returncode
        slot.close_channels()
        probe_socket(self.runtime.path, process.pid).unlink(missing_ok=True)
        lived = time.monotonic() - slot.started_at
        slot.process, slot.listening, slot.ready = None, False, False
        slot.last_exit = f"exit {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
        slot.restart_reason = (
            RestartReason.HUNG if slot.hung else RestartReason.KILLED if code < 0 else RestartReason.EXIT
        )
        slot.hung = False
        self._to_retire.append(process.pid)
        self.metrics.worker_up.labels(worker=slot.label).set(0)
        self.metrics.worker_ready.labels(worker=slot.label).set(0)
        if self.draining:
            log.info("worker stopped worker=%d pid=%d code=%d", slot.number, process.pid, code)
            return
        if slot.lives == 1 and not slot.ever_ready and code == 1:
            raise RuntimeError(f"worker {slot.number} failed to start (exit {code}; its log is above)")
        slot.failures_in_a_row = 0 if lived >= STABLE_SECONDS else slot.failures_in_a_row
        config = self.config
        backoff = min(
            config.worker_restart_backoff_max_seconds,
            config.worker_restart_backoff_seconds * 2**slot.failures_in_a_row,
        )
        slot.failures_in_a_row += 1
        slot.restart_at = time.monotonic() + backoff
        log.error(
            "worker exited worker=%d pid=%d code=%d %s reason=%s lived_seconds=%.1f restart_in_seconds=%g",
            slot.number,
            process.pid,
            code,
            slot.last_exit,
            slot.restart_reason,
            lived,
            backoff,
        )

    def ready_workers(self) -> int:
        return sum(slot.ready for slot in self.slots)

    def needed(self) -> int:
        """Workers that must be ready for the replica to be: all of them until the replica was ready once (so
        the first connections spread over every worker), then ``min_ready_workers``."""
        return self.min_ready if self.ever_ready else self.workers

    def _refresh(self) -> None:
        """The replica is ready while enough workers are (and it is not draining): health port, gauge, /readyz.
        It is alive (the health port's server-wide name, liveness) while enough workers run that were ready once:
        a worker not ready because callers hold all its places keeps the replica alive (a worker whose port is
        broken exits, and is restarted)."""
        alive = not self.draining and sum(s.process is not None and s.ever_ready for s in self.slots) >= self.needed()
        self.health.set_serving(alive, [""])
        ready = not self.draining and self.ready_workers() >= self.needed()
        reason = "" if ready else self.not_ready_reason()
        if ready != self.pod_ready:
            self.pod_ready = ready
            self.ever_ready = self.ever_ready or ready
            self.health.set_serving(ready, [SERVICE_NAME])
            self.metrics.ready.set(int(ready))
            if ready:
                log.info("ready workers=%d workers_ready=%d %s", self.workers, self.ready_workers(), self.listening)
            else:
                log.info("not ready reason=%s", reason)
        self._write_status(reason)

    def not_ready_reason(self) -> str:
        if self.draining:
            return "draining"
        waiting = [f"worker {s.number}: {s.state()}" for s in self.slots if not s.ready]
        return f"{self.ready_workers()} of {self.workers} workers ready, {self.needed()} needed ({'; '.join(waiting)})"

    def _write_status(self, reason: str) -> None:
        if self._status_written == reason:
            return
        path = self.runtime.path / POD_STATUS_FILE
        partial = path.with_name(path.name + ".partial")
        partial.write_text(reason)
        partial.replace(path)
        self._status_written = reason

    # -- stop -----------------------------------------------------------------------------------------------

    def drain(self) -> None:
        config = self.config
        self.draining = True
        watchers = self.health.drain() if self.health is not None else 0
        if self.metrics is not None:
            self._refresh()
        live = [s for s in self.slots if s.process is not None]
        log.info(
            "draining workers=%d delay_seconds=%.1f grace_seconds=%.1f health_watchers_ended=%d",
            len(live),
            config.shutdown_delay_seconds,
            config.shutdown_grace_seconds,
            watchers,
        )
        start = time.monotonic()
        for slot in live:
            slot.process.send_signal(signal.SIGTERM)
        deadline = start + config.shutdown_delay_seconds + config.shutdown_grace_seconds + 5.0
        for slot in live:
            try:
                slot.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error(
                    "worker still running after the grace worker=%d pid=%d: killed", slot.number, slot.process.pid
                )
                slot.process.kill()
                slot.process.wait()
            if slot.process.returncode != 0:
                log.warning(
                    "worker ended worker=%d pid=%d code=%d", slot.number, slot.process.pid, slot.process.returncode
                )
        self.close()
        log.info("stopped drain_seconds=%.3f", time.monotonic() - start)

    def close(self) -> None:
        """Stop what is left (workers included, at once) and remove the runtime directory."""
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.kill()
                slot.process.wait()
            slot.close_channels()
        if self.health_server is not None:
            self.health_server.stop()
            self.health.close()
            self.health_server = None
        if self._idle_trim is not None:
            self._idle_trim.stop()
        if self.peer_cap is not None:
            self.peer_cap.stop()
        for sock in (self._grpc_hold, *self.listeners.values()):
            if sock is not None:
                sock.close()
        if self.runtime is not None:
            self.runtime.remove()


def supervise(
    config: ServiceConfig, workers: int, source: str, port_file: Path | None, signals: ShutdownSignals
) -> int:
    """Run ``workers`` worker processes until a shutdown signal (SIGTERM, SIGINT, SIGHUP), then drain them all;
    returns the exit code. The runtime directory is removed on every way out of here (a drain, an error)."""
    # The multiprocess directory is named first: prometheus_client picks where its values live when it is imported
    # (by the start line's probes and the server's modules, below), and finds it named, as its documentation asks.
    runtime = RuntimeDir()
    try:
        metrics_dir = runtime.path / METRICS_DIR
        metrics_dir.mkdir()
        metrics_in_files = prometheus.name_multiprocess_dir(metrics_dir)
        from indexer_service.service.process.server import announce_start

        announce_start(config, workers, port_file)
        configure_malloc(config.malloc_arena_max, config.malloc_retain_bytes)  # one arena: the idle trim returns all
    except BaseException:
        runtime.remove()
        raise
    if signals.pending() is not None:
        log.info("shutdown signal=%s before the server started", signals.wait().name)
        runtime.remove()
        return 0
    supervisor = Supervisor(config, workers, source, signals, runtime, metrics_in_files)
    try:
        supervisor.start()
        wrote_ports = False
        while supervisor.step():
            if not wrote_ports and port_file is not None and supervisor.all_listening():
                _write_ports(port_file, supervisor)
                wrote_ports = True
        log.info("shutdown signal=%s", signals.wait().name)
        supervisor.drain()
    except BaseException:
        supervisor.close()
        raise
    return 0


def _write_ports(path: Path, supervisor: Supervisor) -> None:
    from indexer_service.service.process.server import write_port_file

    config = supervisor.config
    write_port_file(
        path,
        {
            "grpc_port": config.grpc_port,
            "health_port": config.health_port,
            # A listener that is off (http_rpcs = false) is null, as in the single process's port file.
            **{
                listener.port_setting: getattr(config, listener.port_setting) if name in supervisor.listeners else None
                for name, listener in SHARED_LISTENERS.items()
            },
            "pid": os.getpid(),
            "workers": supervisor.workers,
        },
    )
