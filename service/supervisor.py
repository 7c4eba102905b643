"""Several worker processes behind one replica's ports: ``serve`` with ``workers`` above 1.

One Python process serves about one core (the GIL), so a replica with N CPUs runs N workers
(service/worker.py), each a whole single-process server. This supervisor owns what the replica shares:

- **The gRPC port**, shared by the workers with SO_REUSEPORT: the kernel hands each new connection to one of
  them. Before any worker binds, the supervisor binds the port *without* SO_REUSEPORT (so a port anybody else
  holds, another replica of this service included, is refused: ``cannot bind gRPC``), then holds it with an
  SO_REUSEPORT socket that never listens (it reserves the port and receives no connection) for the workers to
  join. Left open: a process of the same user that sets SO_REUSEPORT itself can still join the group; the kernel
  refuses one of another user.
- **The HTTP port**: one listening socket, inherited by every worker, which all accept on (``/metrics``,
  ``/livez``, ``/readyz`` and the RPCs over HTTP are answered by whichever worker accepts).
- **The health port** (grpc.health.v1 for the kubelet): served here, SERVING only while every worker is ready.
  ``/readyz`` says the same (each worker reads the supervisor's verdict). The gRPC port's own health service is
  per worker, i.e. per connection, which is what a client's health checking needs.
- **Metrics**: prometheus_client's multiprocess mode in a private directory (``PROMETHEUS_MULTIPROC_DIR``, made
  fresh at start and removed at exit), so ``/metrics`` of any worker is the replica's; here
  ``indexer_worker_up``, ``indexer_worker_ready`` and ``indexer_worker_restarts_total`` by ``worker`` slot.
- **The warmup**: workers warm up one at a time under a file lock; the first compiles into the Triton cache,
  the others load what it wrote.

A worker that dies is logged (``worker exited``), counted, takes the replica out of readiness, and is restarted
after a backoff (0.5 s doubling to 10 s; back to 0.5 s once a worker has lived 30 s). A worker that fails before
it ever listened on its first start (a bind error, say) stops the replica with exit 1. SIGTERM: the health port
turns NOT_SERVING, every worker gets SIGTERM and drains as a single process does, and the supervisor exits 0 once
all have ended (SIGKILL for any still running after delay + grace + 5 s).
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from indexer_service.service.allocator import IdleTrim, configure_malloc
from indexer_service.service.config import ServiceConfig
from indexer_service.service.lifecycle import ShutdownSignals
from indexer_service.service.worker import CONFIG_FILE, POD_STATUS_FILE

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
BACKOFF_FIRST_SECONDS, BACKOFF_MAX_SECONDS, STABLE_SECONDS = 0.5, 10.0, 30.0
HTTP_BACKLOG = 1024
_POLL_SECONDS = 0.2


# --- how many ----------------------------------------------------------------------------------------------


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs this process's cgroup may use (its CFS quota over its period), or None where there is no quota.

    cgroup v2: ``cpu.max`` (``"max 100000"`` or ``"200000 100000"``) of this process's cgroup and every parent up
    to the root, the smallest; v1: ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (-1: none)."""
    quotas: list[float] = []
    try:
        v2_path = next(
            (line.split("::", 1)[1] for line in proc_cgroup.read_text().splitlines() if line.startswith("0::")), None
        )
    except OSError:
        v2_path = None
    if (root / "cgroup.controllers").exists():
        here = root / (v2_path or "/").lstrip("/")
        for directory in (here, *here.parents):
            if not directory.is_relative_to(root):
                break
            try:
                quota, period = (directory / "cpu.max").read_text().split()[:2]
            except (OSError, ValueError):
                continue
            if quota != "max" and int(period) > 0:
                quotas.append(int(quota) / int(period))
    else:
        for controller in ("cpu", "cpu,cpuacct"):
            try:
                quota_us = int((root / controller / "cpu.cfs_quota_us").read_text())
                period_us = int((root / controller / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if quota_us > 0 and period_us > 0:
                quotas.append(quota_us / period_us)
            break
    return min(quotas) if quotas else None


def available_cpus() -> tuple[int, str]:
    """The CPUs the container may use, and where the figure came from: the cgroup quota rounded up (1.5 CPUs
    run 2 workers, which between them can use the whole quota) or the CPU affinity, whichever is smaller; at
    least 1."""
    affinity = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    if quota is not None and math.ceil(quota) < affinity:
        return max(1, math.ceil(quota)), f"cgroup cpu quota {quota:g}"
    return max(1, affinity), f"cpu affinity {affinity}"


def worker_cpus(workers: int, mode: str) -> tuple[list[int] | None, str]:
    """Each worker's CPU when they are pinned (``pin_workers``), else None; and why. A pinned worker's threads
    stay on its CPU instead of wandering over the others' (8 workers on 8 CPUs of the H200 host served 1.5x the
    calls pinned: benchmarks/RESULTS.md). ``auto`` pins only where the CPUs are the replica's own: a CPU quota
    equal to the CPU set, one worker per CPU (a Guaranteed pod under the static CPU manager); a CPU set shared
    with other pods is left to the scheduler."""
    cpus = sorted(os.sched_getaffinity(0))
    if mode == "off" or len(cpus) < workers:
        return None, f"pin_workers {mode}, {len(cpus)} CPUs for {workers} workers"
    if mode == "auto":
        quota = cgroup_cpu_quota()
        if quota is None or abs(quota - len(cpus)) > 1e-6 or workers != len(cpus):
            return None, f"pin_workers auto: cpu quota {quota}, {len(cpus)} CPUs, {workers} workers (not exclusive)"
    return cpus[:workers], f"pin_workers {mode}"


def resolve_workers(setting: int) -> tuple[int, str]:
    """``workers`` as configured, or for 0 the container's CPUs; and why."""
    if setting > 0:
        return setting, "setting"
    return available_cpus()


# --- the shared ports --------------------------------------------------------------------------------------


def _address(host: str, port: int) -> tuple:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, ((host, port, 0, 0) if family == socket.AF_INET6 else (host, port))


def reserve_grpc_port(host: str, port: int) -> tuple[socket.socket, int]:
    """Own ``host:port`` for this replica's workers: refused if anyone holds it (bound without SO_REUSEPORT
    first), then held by an SO_REUSEPORT socket that never listens, which the workers' listeners join."""
    from indexer_service.service.grpc_server import host_port

    family, address = _address(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(address)
        except OSError as exc:
            raise OSError(f"cannot bind gRPC to {host_port(host, port)}: {exc}") from None
        port = probe.getsockname()[1]
    family, address = _address(host, port)
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind(address)
    except OSError as exc:
        held.close()
        raise OSError(f"cannot bind gRPC to {host_port(host, port)}: {exc}") from None
    return held, port


def listen_http(host: str, port: int) -> socket.socket:
    from indexer_service.service.grpc_server import host_port

    family, address = _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind HTTP to {host_port(host, port)}: {exc}") from None
    sock.listen(HTTP_BACKLOG)
    return sock


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
    ever_listened: bool = False
    lives: int = 0
    failures_in_a_row: int = 0
    restart_at: float | None = None
    last_exit: str = ""
    pids: list[int] = field(default_factory=list)

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


class Supervisor:
    def __init__(self, config: ServiceConfig, workers: int, source: str, signals: ShutdownSignals) -> None:
        self.config = config
        self.workers = workers
        self.source = source
        self.signals = signals
        self.slots = [Slot(n) for n in range(workers)]
        self.cpus, self.pinning = worker_cpus(workers, config.pin_workers.lower())
        self.draining = False
        self.pod_ready = False
        self.runtime = Path(tempfile.mkdtemp(prefix="indexer-workers-"))
        self.metrics_dir = self.runtime / "metrics"
        self.metrics_dir.mkdir()
        _use_multiprocess_metrics(self.metrics_dir)
        self._grpc_hold: socket.socket | None = None
        self._http: socket.socket | None = None
        self.health = self.health_server = None
        self.metrics = None
        self._idle_trim: IdleTrim | None = None

    # -- start ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        from indexer_service.service.admission import ShedLog
        from indexer_service.service.grpc_server import HEALTH_NAMES, create_health_server, host_port
        from indexer_service.service.health import HealthServicer
        from indexer_service.service.metrics import SupervisorMetrics

        config = self.config
        self.metrics = SupervisorMetrics(self.workers)
        self._grpc_hold, grpc_port = reserve_grpc_port(config.grpc_host, config.grpc_port)
        self._http = listen_http(config.http_host, config.http_port)
        self.health = HealthServicer(HEALTH_NAMES, ShedLog(self.metrics).record)
        self.health_server, health_port = create_health_server(config, self.health)
        self.config = replace(
            config, grpc_port=grpc_port, http_port=self._http.getsockname()[1], health_port=health_port, workers=1
        )
        self._write_status("starting")
        (self.runtime / CONFIG_FILE).write_text(json.dumps(asdict(self.config)))
        self.health_server.start()
        # The health port's connections come and go here too: counted, and their memory handed back.
        self._idle_trim = IdleTrim(config.idle_trim_seconds, on_fds=self.metrics.open_fds.set)
        self._idle_trim.start()
        log.info(
            "workers n=%d from=%s cpus=%s (%s) grpc=%s (shared, SO_REUSEPORT) health=%s http=%s runtime=%s",
            self.workers,
            self.source,
            ",".join(map(str, self.cpus)) if self.cpus else "shared",
            self.pinning,
            host_port(config.grpc_host, grpc_port),
            host_port(config.grpc_host, health_port),
            host_port(config.http_host, self.config.http_port),
            self.runtime,
        )
        for slot in self.slots:
            self._spawn(slot)

    def _spawn(self, slot: Slot) -> None:
        read, write = os.pipe()
        http_fd = self._http.fileno()
        cpu = self.cpus[slot.number] if self.cpus else -1
        worker_args = (self.runtime, slot.label, write, http_fd, os.getpid(), cpu)  # service/worker.py's argv
        command = [sys.executable, "-m", "indexer_service.service.worker", *map(str, worker_args)]
        try:
            slot.process = subprocess.Popen(command, pass_fds=(write, http_fd))
        finally:
            os.close(write)
        os.set_blocking(read, False)
        slot.status_fd, slot.buffer = read, b""
        slot.started_at, slot.listening, slot.ready, slot.restart_at = time.monotonic(), False, False, None
        slot.lives += 1
        slot.pids.append(slot.process.pid)
        self.metrics.worker_up.labels(worker=slot.label).set(1)
        if slot.lives > 1:
            self.metrics.worker_restarts_total.labels(worker=slot.label).inc()
            log.warning("worker restarted worker=%d pid=%d restarts=%d", slot.number, slot.process.pid, slot.lives - 1)
        else:
            log.info("worker started worker=%d pid=%d", slot.number, slot.process.pid)

    # -- run ------------------------------------------------------------------------------------------------

    def all_listening(self) -> bool:
        return all(slot.ever_listened for slot in self.slots)

    def step(self, timeout: float = _POLL_SECONDS) -> bool:
        """Wait up to ``timeout`` for a signal or a worker's word; handle exits and restarts. False once a
        shutdown signal has come."""
        now = time.monotonic()
        due = [s.restart_at for s in self.slots if s.restart_at is not None]
        timeout = max(0.0, min([timeout, *(d - now for d in due)]))
        fds = [s.status_fd for s in self.slots if s.status_fd >= 0]
        readable, _, _ = select.select([self.signals, *fds], [], [], timeout)
        if self.signals.pending() is not None:
            return False
        for slot in self.slots:
            if slot.status_fd in readable:
                self._read_status(slot)
            if slot.process is not None and slot.process.poll() is not None:
                self._exited(slot)
            if slot.restart_at is not None and time.monotonic() >= slot.restart_at and not self.draining:
                self._spawn(slot)
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
            if line == b"listening":
                slot.listening = slot.ever_listened = True
            elif line.startswith(b"ready "):
                slot.ready = line == b"ready 1"
                self.metrics.worker_ready.labels(worker=slot.label).set(int(slot.ready))
                log.info(
                    "worker %s worker=%d pid=%d",
                    "ready" if slot.ready else "not ready",
                    slot.number,
                    slot.process.pid if slot.process else -1,
                )

    def _exited(self, slot: Slot) -> None:
        from prometheus_client import multiprocess

        process = slot.process
        code = process.returncode
        if slot.status_fd >= 0:
            os.close(slot.status_fd)
            slot.status_fd = -1
        lived = time.monotonic() - slot.started_at
        slot.process, slot.listening, slot.ready = None, False, False
        slot.last_exit = f"exit {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
        multiprocess.mark_process_dead(process.pid, str(self.metrics_dir))
        self.metrics.worker_up.labels(worker=slot.label).set(0)
        self.metrics.worker_ready.labels(worker=slot.label).set(0)
        if self.draining:
            log.info("worker stopped worker=%d pid=%d code=%d", slot.number, process.pid, code)
            return
        if slot.lives == 1 and not slot.ever_listened and code == 1:
            raise RuntimeError(f"worker {slot.number} failed to start (exit {code}; its log is above)")
        slot.failures_in_a_row = 0 if lived >= STABLE_SECONDS else slot.failures_in_a_row
        backoff = min(BACKOFF_MAX_SECONDS, BACKOFF_FIRST_SECONDS * 2**slot.failures_in_a_row)
        slot.failures_in_a_row += 1
        slot.restart_at = time.monotonic() + backoff
        log.error(
            "worker exited worker=%d pid=%d code=%d %s lived_seconds=%.1f restart_in_seconds=%.1f",
            slot.number,
            process.pid,
            code,
            slot.last_exit,
            lived,
            backoff,
        )

    def _refresh(self) -> None:
        """The replica is ready when every worker is (and it is not draining): health port, gauge, /readyz."""
        ready = not self.draining and all(slot.ready for slot in self.slots)
        reason = "" if ready else self.not_ready_reason()
        if ready != self.pod_ready:
            self.pod_ready = ready
            self.health.set_serving(ready)
            self.metrics.ready.set(int(ready))
            if ready:
                log.info("ready workers=%d", self.workers)
            else:
                log.info("not ready reason=%s", reason)
        self._write_status(reason)

    def not_ready_reason(self) -> str:
        if self.draining:
            return "draining"
        waiting = [f"worker {s.number}: {s.state()}" for s in self.slots if not s.ready]
        return f"{len(waiting)} of {self.workers} workers not ready ({'; '.join(waiting)})"

    def _write_status(self, reason: str) -> None:
        path = self.runtime / POD_STATUS_FILE
        if getattr(self, "_status_written", None) == reason:
            return
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
        """Stop what is left (workers included, at once) and remove the private directory."""
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.kill()
                slot.process.wait()
            if slot.status_fd >= 0:
                os.close(slot.status_fd)
                slot.status_fd = -1
        if self.health_server is not None:
            self.health_server.stop(0).wait()
            self.health.close()
            self.health_server = None
        if self._idle_trim is not None:
            self._idle_trim.stop()
        for sock in (self._grpc_hold, self._http):
            if sock is not None:
                sock.close()
        shutil.rmtree(self.runtime, ignore_errors=True)


def _use_multiprocess_metrics(path: Path) -> None:
    """Metrics of this process and of every worker (which inherit the environment) go to files in ``path``.
    prometheus_client picks its value class when imported: pick it again if it was imported already."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    if "prometheus_client.values" in sys.modules:
        from prometheus_client import values

        values.ValueClass = values.get_value_class()


def supervise(
    config: ServiceConfig, workers: int, source: str, port_file: Path | None, signals: ShutdownSignals
) -> int:
    """Run ``workers`` worker processes until SIGTERM or SIGINT, then drain them all; returns the exit code."""
    from indexer_service.service.server import announce_start

    announce_start(config, port_file)
    configure_malloc(config.malloc_arena_max, config.malloc_retain_bytes)  # one arena: the idle trim returns all
    if signals.pending() is not None:
        log.info("shutdown signal=%s before the server started", signals.wait().name)
        return 0
    supervisor = Supervisor(config, workers, source, signals)
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
    config = supervisor.config
    payload = {
        "grpc_port": config.grpc_port,
        "http_port": config.http_port,
        "health_port": config.health_port,
        "pid": os.getpid(),
        "workers": supervisor.workers,
    }
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload) + "\n")
    partial.replace(path)
