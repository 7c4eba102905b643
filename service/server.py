"""The serving process: start-up order, warmup-gated readiness, SIGTERM drain.

Start-up: both listeners come up first (HTTP /readyz 503, gRPC health NOT_SERVING, RPCs UNAVAILABLE), then
the warmup compiles every key; only when all compiled does the server turn ready. SIGTERM: NOT_SERVING and
/readyz 503 at once, keep serving for ``shutdown_delay_seconds``, then stop taking calls and give the
in-flight ones ``shutdown_grace_seconds`` to finish; exit 0.

One process is one worker; with ``workers`` above 1 the CLI runs service/supervisor.py instead, which starts
that many of these (service/worker.py), each given a :class:`service.worker.WorkerLink`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from indexer_service.kernels.specialization import warmup_keys
from indexer_service.service.allocator import IdleTrim, configure_malloc, idle_trim_caveat
from indexer_service.service.backends import make_backend, resolve_backend
from indexer_service.service.config import ServiceConfig
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.grpc_server import HEALTH_NAMES, create_grpc_server, create_health_server, host_port
from indexer_service.service.health import HealthServicer
from indexer_service.service.http_app import HttpApp, limited_protocol
from indexer_service.service.lifecycle import ShutdownSignals, raise_open_files_limit
from indexer_service.service.limits import launch_admission
from indexer_service.service.metrics import Metrics
from indexer_service.service.warmup import Warmup, use_triton_cache_dir

if TYPE_CHECKING:
    from indexer_service.service.worker import WorkerLink

log = logging.getLogger(__name__)

_HTTP_START_TIMEOUT_SECONDS = 10.0


class _HttpServer:
    """uvicorn (httptools + uvloop) on its own thread and event loop, on a socket bound up front."""

    def __init__(
        self, app: HttpApp, service_config: ServiceConfig, metrics: Metrics, bound: socket.socket | None = None
    ) -> None:
        host, port, grace = service_config.http_host, service_config.http_port, service_config.shutdown_grace_seconds
        if bound is not None:  # a worker: the supervisor's listening socket, which every worker accepts on
            self.socket = bound
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.socket = socket.socket(family, socket.SOCK_STREAM)
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self.socket.bind((host, port))
            except OSError as exc:
                self.socket.close()
                raise OSError(f"cannot bind HTTP to {host_port(host, port)}: {exc}") from None
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            loop="uvloop",
            http=limited_protocol(service_config, metrics),
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=max(grace, 0.1),
            timeout_keep_alive=service_config.http_idle_timeout_seconds,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, name="http")

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + _HTTP_START_TIMEOUT_SECONDS
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (see the log above)")
            time.sleep(0.01)

    def stop(self, timeout: float) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.socket.close()


class IndexerServer:
    """Everything one serving process runs; :meth:`start` returns once both listeners are up.

    ``worker``: this process is one worker of several (service/supervisor.py): the gRPC port is shared
    (SO_REUSEPORT), HTTP accepts on the supervisor's socket, the supervisor serves the health port, readiness is
    reported to it, and the warmup takes the replica's compile lock (the first worker compiles into the shared
    Triton cache, the others load from it)."""

    def __init__(self, config: ServiceConfig, worker: WorkerLink | None = None) -> None:
        self.config = config
        self.worker = worker
        cache_dir = use_triton_cache_dir(config.triton_cache_dir)
        self.backend = resolve_backend(config.backend)
        self.metrics = Metrics()
        self.warmup = Warmup(
            warmup_keys(config.model),
            target=None if self.backend != "numpy" else config.warmup_target,
            enabled=config.warmup_enabled,
            workers=config.warmup_workers,
            metrics=self.metrics,
            model=config.model,
        )
        admit = launch_admission(self.warmup) if config.strict else None
        backend = make_backend(self.backend, admit, config.native_fast_path)
        self.warmup.calibrate = backend.calibrate  # auto on CUDA: its crossover, measured before ready
        log.info(
            "backend=%s native_fast_path=%s warmup_target=%s triton_cache_dir=%s",
            self.backend,
            backend.build_chunk_fast is not None,
            self.warmup.target_name,
            cache_dir or "(Triton's default)",
        )
        self.plane = DataPlane(config, self.metrics, self.warmup, backend)
        self.health = HealthServicer(HEALTH_NAMES, self.plane.shed)
        self.plane.readiness.add_listener(self.health.set_serving)
        if worker is not None:
            self.plane.readiness.add_listener(worker.report_ready)
        self.grpc = create_grpc_server(config, self.plane, self.health, share_port=worker is not None)
        self.grpc_port = self.grpc.port
        if worker is None:
            self.health_server, self.health_port = create_health_server(config, self.health)
        else:  # the supervisor serves the health port, for the whole replica
            self.health_server, self.health_port = None, config.health_port
        app = HttpApp(self.plane, worker.pod_not_ready if worker is not None else None)
        self.http = _HttpServer(app, config, self.metrics, worker.http_socket() if worker is not None else None)
        self.http_port = self.http.port
        self._unwatch = None
        self._warmup_thread = threading.Thread(target=self._run_warmup, name="warmup", daemon=True)
        # Free heap back to the OS once no call has ended and no connection closed for idle_trim_seconds: a
        # burst's peak does not stay as idle RSS (glibc keeps freed memory for reuse, see service/allocator.py).
        self._idle_trim = IdleTrim(
            config.idle_trim_seconds, lambda: self.plane.last_call_end, self.metrics.open_fds.set
        )

    def start(self) -> None:
        self.grpc.server.start()
        if self.health_server is not None:
            self.health_server.start()
        self.http.start()
        log.info(
            "listening grpc=%s health=%s http=%s",
            host_port(self.config.grpc_host, self.grpc_port),
            host_port(self.config.grpc_host, self.health_port),
            host_port(self.config.http_host, self.http_port),
        )
        if self.config.idle_trim_seconds > 0:
            caveat = idle_trim_caveat(self.config.malloc_arena_max)
            if caveat is not None:
                log.warning("%s", caveat)
        self._idle_trim.start()
        if self.backend != "numpy":
            # Only a GPU backend launches kernels after ready; numpy never compiles.
            from indexer_service.kernels.compile_engine import watch_compiles

            self._unwatch = watch_compiles(self.plane.readiness.on_kernel_compile)
        self._warmup_thread.start()

    def _run_warmup(self) -> None:
        with self.worker.warmup_lock() if self.worker is not None else contextlib.nullcontext():
            self.warmup.run()
        self.plane.readiness.refresh()

    def shutdown(self) -> None:
        """Drain: NOT_SERVING (Watch streams told, then ended), optional delay, stop taking calls, let in-flight
        ones finish within the grace; calls still running when it ends are cut and counted as shed."""
        config = self.config
        self.plane.readiness.begin_drain()
        watchers = self.health.drain()
        log.info(
            "draining delay_seconds=%.1f grace_seconds=%.1f health_watchers_ended=%d",
            config.shutdown_delay_seconds,
            config.shutdown_grace_seconds,
            watchers,
        )
        if config.shutdown_delay_seconds:
            time.sleep(config.shutdown_delay_seconds)
        start = time.monotonic()
        # gRPC cancels what still runs once the grace is over; the data plane then names the shutdown as cause.
        cut = threading.Timer(config.shutdown_grace_seconds, self.plane.shutdown_cut.set)
        cut.daemon = True
        cut.start()
        self.grpc.stop(config.shutdown_grace_seconds)
        cut.cancel()
        self.http.stop(timeout=config.shutdown_grace_seconds + 1.0)
        if self.health_server is not None:
            self.health_server.stop(0).wait()
        self.health.close()
        self._idle_trim.stop()
        if self._unwatch is not None:
            self._unwatch()
        log.info("stopped drain_seconds=%.3f", time.monotonic() - start)


def _port_file_error(path: Path, exc: OSError) -> OSError:
    return OSError(f"cannot write --port-file {path}: {exc.strerror or exc}")


def _check_port_file(path: Path) -> None:
    """Fail before anything starts when the port file cannot be written (rather than half-start)."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text("")
        partial.unlink()
    except OSError as exc:
        raise _port_file_error(path, exc) from None


def _write_port_file(path: Path, server: IndexerServer) -> None:
    """Bound ports as JSON, written atomically (tests and wrappers read it once it exists)."""
    payload = {
        "grpc_port": server.grpc_port,
        "http_port": server.http_port,
        "health_port": server.health_port,
        "pid": os.getpid(),
    }
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(json.dumps(payload) + "\n")
        partial.replace(path)
    except OSError as exc:
        raise _port_file_error(path, exc) from None


def tls_mode(config: ServiceConfig) -> str:
    """``off``, ``tls`` or ``mutual`` (client certificates required), for the start-up log."""
    if not config.tls_enabled:
        return "off"
    return "mutual" if config.tls_client_ca_file else "tls"


def announce_start(config: ServiceConfig, port_file: Path | None) -> None:
    """The start-up log lines (every setting, the TLS mode), then the port file's check: a process that could
    not report its ports fails before anything listens. Shared by the one process and the supervisor."""
    log.info("start pid=%d config: %s", os.getpid(), config.summary())
    raise_open_files_limit()
    log.info(
        "tls mode=%s cert=%s client_ca=%s",
        tls_mode(config),
        config.tls_cert_file or "-",
        config.tls_client_ca_file or "-",
    )
    if port_file is not None:
        _check_port_file(port_file)


def serve(config: ServiceConfig, port_file: Path | None = None, signals: ShutdownSignals | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain; returns the exit code.

    ``signals``: the process's :class:`ShutdownSignals`, installed as early as possible (the CLI does it before
    reading the configuration); without, serve() installs its own. A signal at any moment ends the run with 0:
    before the listeners are up, nothing starts; during or after the warmup, the server drains. A fatal
    start-up error (port file, bind) raises OSError at once. The caller ends the process with
    :func:`service.lifecycle.end_process` (the CLI does), which also stops whatever had started: a warmup may
    still be compiling, and listeners may be up.
    """
    own_signals = signals is None
    signals = signals or ShutdownSignals()
    try:
        announce_start(config, port_file)
        configure_malloc(config.malloc_arena_max, config.malloc_retain_bytes)
        server = IndexerServer(config) if signals.pending() is None else None
        if server is None or signals.pending() is not None:
            log.info("shutdown signal=%s before the server started", signals.wait().name)
            return 0
        server.start()
        if port_file is not None:
            _write_port_file(port_file, server)
        received = signals.wait()
        log.info("shutdown signal=%s", received.name)
        # A second signal during the drain lands in the socket and is ignored: the drain is bounded anyway.
        server.shutdown()
    finally:
        if own_signals:
            signals.close()
    return 0
