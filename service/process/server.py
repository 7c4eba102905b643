"""The serving process: start-up order, warmup-gated readiness, SIGTERM drain.

Start-up: every listener comes up first (HTTP /readyz 503, gRPC health NOT_SERVING, RPCs UNAVAILABLE), then
the warmup compiles every key; only when all compiled does the server turn ready. SIGTERM: NOT_SERVING and
/readyz 503 at once, keep serving for ``shutdown_delay_seconds``, then stop taking calls and give the
in-flight ones ``shutdown_grace_seconds`` to finish; exit 0.

One process is one worker; with ``workers`` above 1 the CLI runs service/process/supervisor.py instead, which starts
that many of these (service/process/worker.py), each given a :class:`service.process.workerproto.WorkerLink`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path

import uvicorn

from indexer_service.kernels.specialization import warmup_keys
from indexer_service.service import adapters
from indexer_service.service.adapters.uvicorn_http import HttpLimits, protocol_settings
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.compute.backends import make_backend
from indexer_service.service.compute.devices import resolve_backend, uses_triton
from indexer_service.service.compute.warmup import Warmup, use_triton_cache_dir
from indexer_service.service.config import ServiceConfig
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.observability.tracing import start_tracing
from indexer_service.service.observability.version import VERSION, build
from indexer_service.service.overload.allocator import IdleTrim, configure_malloc, idle_trim_caveat
from indexer_service.service.overload.limits import strict_admission
from indexer_service.service.overload.peers import PeerCap, connection_limits
from indexer_service.service.process.addresses import host_port
from indexer_service.service.process.lifecycle import ShutdownSignals, raise_open_files_limit
from indexer_service.service.process.listeners import bind_shared
from indexer_service.service.process.workerproto import WorkerLink
from indexer_service.service.reasons import Port
from indexer_service.service.transport.gate import Accounting
from indexer_service.service.transport.grpc_server import (
    HEALTH_NAMES,
    GrpcServer,
    create_grpc_server,
    create_health_server,
)
from indexer_service.service.transport.health import HealthServicer
from indexer_service.service.transport.http_app import HttpConnectionEvents, HttpRefusals, ProbeApp, RpcApp

log = logging.getLogger(__name__)

# A worker's exit code when its gRPC port is broken (its supervisor restarts it): EX_SOFTWARE.
EXIT_RPC_PORT_BROKEN = 70

_HTTP_START_TIMEOUT_SECONDS = 10.0

# uvicorn's lines for the start and the stop of each server it runs: two of each a process, one per HTTP port. The
# process's own `start`, `listening` and `stopped` lines say the same once, naming both ports.
_UVICORN_LIFECYCLE = frozenset({"Started server process [%d]", "Shutting down", "Finished server process [%d]"})


class _WithoutUvicornLifecycle(logging.Filter):
    """Drops uvicorn's start and stop lines (:data:`_UVICORN_LIFECYCLE`); its other lines pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and record.msg in _UVICORN_LIFECYCLE)


_WITHOUT_UVICORN_LIFECYCLE = _WithoutUvicornLifecycle()


def uvicorn_tls(config: ServiceConfig) -> dict[str, object]:
    """uvicorn's TLS settings for ``http_rpc_port``: the gRPC port's certificate and key, and under mutual TLS its
    client CA with client certificates required, so HTTP refuses every caller gRPC would refuse."""
    settings: dict[str, object] = {"ssl_certfile": config.tls_cert_file, "ssl_keyfile": config.tls_key_file}
    if config.tls_client_ca_file:
        settings |= {"ssl_ca_certs": config.tls_client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return settings


class _HttpServer:
    """uvicorn (httptools + uvloop) on its own thread and event loop, on a socket bound up front; HTTPS with the
    gRPC port's certificate and key when ``tls``, requiring a client certificate chained to ``tls_client_ca_file``
    when that is set (mutual TLS). Its protocol and limits come from service/adapters/uvicorn_http.py (h11 with
    public settings where uvicorn's internals differ from what the limited protocol needs)."""

    def __init__(
        self,
        app: object,
        service_config: ServiceConfig,
        events: HttpConnectionEvents,
        bound: socket.socket,
        name: str,
        tls: bool,
    ) -> None:
        self.socket = bound
        self.port = bound.getsockname()[1]
        config = uvicorn.Config(
            app,
            loop="uvloop",
            **protocol_settings(HttpLimits.of(service_config), events),
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=max(service_config.shutdown_grace_seconds, 0.1),
            **(uvicorn_tls(service_config) if tls else {}),
        )
        self.server = uvicorn.Server(config)
        logging.getLogger("uvicorn.error").addFilter(_WITHOUT_UVICORN_LIFECYCLE)  # once: a filter is added once
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, name=name)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + _HTTP_START_TIMEOUT_SECONDS
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (see the log above)")
            time.sleep(0.01)

    def stop(self, timeout: float) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():  # a worker that never joined never started its RPC port
            self.thread.join(timeout)
        self.socket.close()


class IndexerServer:
    """Everything one serving process runs; :meth:`start` returns once every listener is up.

    ``worker``: this process is one worker of several (service/process/supervisor.py): both HTTP ports accept on the
    supervisor's sockets (the RPC port once joined), the warmup takes the replica's compile lock (the first worker
    compiles into the shared Triton cache, the others load from it), the gRPC port is shared (SO_REUSEPORT) and
    joined only once warmed up (:meth:`join_rpc_port`), readiness is reported to the supervisor, which serves the
    health port."""

    def __init__(self, config: ServiceConfig, worker: WorkerLink | None = None) -> None:
        self.config = config
        self.worker = worker
        cache_dir = use_triton_cache_dir(config.triton_cache_dir)
        self.backend = resolve_backend(config.backend)
        # Probed already where the CLI started this process (the start line names the fallbacks); here for servers
        # made otherwise, before the metrics show them.
        adapters.probe_all(triton=uses_triton(self.backend, config.warmup_enabled))
        self.metrics = Metrics(worker=worker is not None)
        self.warmup = Warmup(
            warmup_keys(config.model),
            target=None if self.backend != "numpy" else config.warmup_target,
            enabled=config.warmup_enabled,
            workers=config.warmup_workers,
            metrics=self.metrics,
            model=config.model,
        )
        admit = strict_admission(config, self.warmup)
        backend = make_backend(self.backend, admit, config.native_fast_path)
        self.warmup.calibrate = backend.calibrate  # auto on CUDA: its crossover, measured before ready
        log.info(
            "backend=%s native_fast_path=%s warmup_target=%s triton_cache_dir=%s",
            self.backend,
            backend.build_chunk_fast is not None,
            self.warmup.target_name,
            cache_dir or "(Triton's default)",
        )
        self.tracer = start_tracing()
        self.plane = DataPlane(config, self.metrics, self.warmup, backend, admit, self.tracer)
        self.health = HealthServicer(HEALTH_NAMES)
        readiness = self.plane.readiness
        readiness.add_listener(lambda ready: self.health.set_serving(ready, [SERVICE_NAME]))
        readiness.add_alive_listener(lambda alive: self.health.set_serving(alive, [""]))
        if worker is not None:
            readiness.add_listener(worker.report_ready)
            readiness.add_alive_listener(self._exit_if_broken)
        self.grpc: GrpcServer | None = None
        self.grpc_port = config.grpc_port
        # The RPC port's own probe socket, for its watch (a worker's is its supervisor's too).
        self._probe_dir = None if worker is not None else tempfile.TemporaryDirectory(prefix="indexer-probe-")
        if worker is None:
            probe = Path(self._probe_dir.name) / "rpc.sock"
            self.grpc = create_grpc_server(config, self.plane, self.health, probe_socket=probe, report=self._rpc_port)
            self.grpc_port = self.grpc.port
            accounting = Accounting(self.metrics, self.plane.shed_on(Port.HEALTH))
            self.health_server = create_health_server(config, self.health, accounting, self.grpc_port)
            self.health_port = self.health_server.port
            sockets = bind_shared(config)
        else:  # the gRPC server comes once warmed up (join_rpc_port); the supervisor serves the health port
            self.health_server, self.health_port = None, config.health_port
            sockets = {name: worker.inherited_socket(name) for name in worker.sockets}
        http_socket, rpc_socket = sockets["http"], sockets.get("http_rpc")
        self.http_port = http_socket.getsockname()[1]
        self.http_rpc_port = rpc_socket.getsockname()[1] if rpc_socket is not None else None
        refusals = HttpRefusals(self.metrics)  # both ports', one log (a line per reason and port)
        probes = ProbeApp(
            self.plane, self.http_rpc_port, refusals, worker.pod_not_ready if worker is not None else None
        )
        events = HttpConnectionEvents(config, self.metrics, refusals, Port.HTTP)
        self.http = _HttpServer(probes, config, events, http_socket, "http", tls=False)
        self.http_rpc = None
        if rpc_socket is not None:
            rpcs = RpcApp(self.plane, self.http_port, refusals)
            events = HttpConnectionEvents(config, self.metrics, refusals, Port.HTTP_RPC)
            self.http_rpc = _HttpServer(rpcs, config, events, rpc_socket, "http-rpc", tls=config.tls_enabled)
        self.metrics.show_fallbacks()  # the HTTP ports' protocol was probed just now, after Metrics was made
        self._unwatch = None
        self._warmup_thread = threading.Thread(target=self._run_warmup, name="warmup", daemon=True)
        self.warmup_done = threading.Event()
        # Free heap back to the OS once no call has ended and no connection closed for idle_trim_seconds: a
        # burst's peak does not stay as idle RSS (glibc keeps freed memory for reuse, see
        # service/overload/allocator.py).
        self._idle_trim = IdleTrim(
            config.idle_trim_seconds, lambda: self.plane.last_call_end, self.metrics.open_fds.set
        )
        ports = {self.http_port: Port.HTTP}
        if self.http_rpc_port is not None:
            ports[self.http_rpc_port] = Port.HTTP_RPC
        shared = ()
        if worker is None:
            ports |= {self.grpc_port: Port.GRPC, self.health_port: Port.HEALTH}
        else:  # the HTTP ports' listeners are the supervisor's, inherited by every worker
            shared = tuple(ports)
        self.peer_cap = PeerCap(
            config.max_connections_per_peer,
            ports,
            self.metrics.peer_cap,
            shared=shared,
            limits=connection_limits(config),
        )

    def _rpc_port(self, problem: str, broken: bool) -> None:
        self.plane.readiness.set_rpc_port(problem, broken)

    def _exit_if_broken(self, alive: bool) -> None:
        """A worker whose RPC port is broken (not its callers' doing) ends, and its supervisor starts another."""
        if not alive and self.plane.readiness.rpc_port_broken:
            log.critical("worker exiting: its gRPC port is broken (%s)", self.plane.readiness.not_ready_reason())
            logging.shutdown()
            os._exit(EXIT_RPC_PORT_BROKEN)

    def start(self) -> None:
        if self.grpc is not None:
            self.grpc.start()
        if self.health_server is not None:
            self.health_server.server.start()
        self.http.start()
        if self.http_rpc is not None and self.worker is None:  # a worker's starts in join_rpc_port
            self.http_rpc.start()
        listening = listening_addresses(
            self.config, self.grpc_port, self.health_port, self.http_port, self.http_rpc_port
        )
        self.plane.readiness.listening = listening
        log.info("listening %s", listening)
        if self.config.idle_trim_seconds > 0:
            caveat = idle_trim_caveat(self.config.malloc_arena_max)
            if caveat is not None:
                log.warning("%s", caveat)
        self._idle_trim.start()
        self.peer_cap.start()
        if self.backend != "numpy":
            # Only a GPU backend launches kernels after ready; numpy never compiles.
            from indexer_service.kernels.compile_engine import watch_compiles

            self._unwatch = watch_compiles(self.plane.readiness.on_kernel_compile)
        self._warmup_thread.start()

    def _run_warmup(self) -> None:
        try:
            self.warmup.load_compiler()  # outside the replica's compile lock: the workers import torch at once
            with self.worker.warmup_lock() if self.worker is not None else contextlib.nullcontext():
                self.warmup.run()
            if self.worker is None:  # a worker turns ready in join_rpc_port
                self.plane.readiness.refresh()
        finally:
            self.warmup_done.set()

    def join_rpc_port(self) -> None:
        """A worker, once its warmup is over: if it went well, bind the shared gRPC port (SO_REUSEPORT) and the
        private probe socket, start serving them, then turn ready (which tells the supervisor). The kernel hands
        a worker connections only from here on, so no gRPC connection lands on one still starting or warming up.
        A failed warmup leaves the worker off the port and not ready, as a single process stays."""
        if not self.warmup.finished_ok:
            return
        self.grpc = create_grpc_server(
            self.config,
            self.plane,
            self.health,
            share_port=True,
            probe_socket=self.worker.probe_socket(),
            report=self._rpc_port,
        )
        self.grpc.start()
        self.peer_cap.add_port(self.grpc.port, Port.GRPC)
        address = host_port(self.config.grpc_host, self.grpc.port)
        if self.http_rpc is not None:  # the RPCs over HTTP too: the shared socket's connections go to ready workers
            self.http_rpc.start()
        log.info("joined grpc=%s probe=%s", address, self.worker.probe_socket())
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
        if self.grpc is not None:
            self.grpc.stop(config.shutdown_grace_seconds)
        cut.cancel()
        if self.http_rpc is not None:
            self.http_rpc.stop(timeout=config.shutdown_grace_seconds + 1.0)
        self.http.stop(timeout=config.shutdown_grace_seconds + 1.0)
        if self.health_server is not None:
            self.health_server.stop()
        self.health.close()
        if self._probe_dir is not None:
            self._probe_dir.cleanup()
        self._idle_trim.stop()
        self.peer_cap.stop()
        if self._unwatch is not None:
            self._unwatch()
        if self.tracer is not None:
            self.tracer.shutdown()  # the spans still batched
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


def write_port_file(path: Path, ports: dict[str, object]) -> None:
    """The bound ports as JSON, written atomically (tests and wrappers read it once it exists); the one writer of
    the single process's and the supervisor's port files."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(json.dumps(ports) + "\n")
        partial.replace(path)
    except OSError as exc:
        raise _port_file_error(path, exc) from None


def listening_addresses(
    config: ServiceConfig, grpc_port: int, health_port: int, http_port: int, http_rpc_port: int | None
) -> str:
    """``grpc=HOST:PORT health=... http=... http_rpc=...`` (``http_rpc=off`` when the HTTP RPCs are off): what the
    ``listening`` and ``ready`` log lines name."""
    http_rpc = host_port(config.http_host, http_rpc_port) if http_rpc_port is not None else "off"
    return (
        f"grpc={host_port(config.grpc_host, grpc_port)} health={host_port(config.grpc_host, health_port)} "
        f"http={host_port(config.http_host, http_port)} http_rpc={http_rpc}"
    )


def tls_mode(config: ServiceConfig) -> str:
    """``off``, ``tls`` or ``mutual`` (client certificates required), for the start-up log."""
    if not config.tls_enabled:
        return "off"
    return "mutual" if config.tls_client_ca_file else "tls"


def announce_start(config: ServiceConfig, workers: int, port_file: Path | None) -> None:
    """The start-up log lines (what is starting, with the dependency fallbacks its libraries took; every setting;
    the TLS mode), then the port file's check: a process that could not report its ports fails before anything
    listens. Shared by the one process and the supervisor (whose workers probe Triton themselves: it never imports
    it)."""
    adapters.probe_all(triton=workers == 1 and uses_triton(config.backend, config.warmup_enabled))
    mode = "one process" if workers == 1 else f"supervisor of {workers} worker processes"
    log.info(
        "start pid=%d indexer-service %s commit=%s image_revision=%s mode=%s backend=%s warmup_target=%s "
        "dependency_fallbacks=%s",
        os.getpid(),
        VERSION,
        build()["commit"],
        build()["image_revision"] or "-",
        mode,
        config.backend,
        config.warmup_target,
        adapters.summary(),
    )
    log.info("config %s", config.summary())
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
    """Run until SIGTERM, SIGINT or SIGHUP, then drain; returns the exit code.

    ``signals``: the process's :class:`ShutdownSignals`, installed as early as possible (the CLI does it before
    reading the configuration); without, serve() installs its own. A signal at any moment ends the run with 0:
    before the listeners are up, nothing starts; during or after the warmup, the server drains. A fatal
    start-up error (port file, bind) raises OSError at once. The caller ends the process with
    :func:`service.process.lifecycle.end_process` (the CLI does), which also stops whatever had started: a warmup may
    still be compiling, and listeners may be up.
    """
    own_signals = signals is None
    signals = signals or ShutdownSignals()
    try:
        announce_start(config, 1, port_file)
        configure_malloc(config.malloc_arena_max, config.malloc_retain_bytes)
        server = IndexerServer(config) if signals.pending() is None else None
        if server is None or signals.pending() is not None:
            log.info("shutdown signal=%s before the server started", signals.wait().name)
            return 0
        server.start()
        if port_file is not None:
            write_port_file(
                port_file,
                {
                    "grpc_port": server.grpc_port,
                    "http_port": server.http_port,
                    "http_rpc_port": server.http_rpc_port,
                    "health_port": server.health_port,
                    "pid": os.getpid(),
                },
            )
        received = signals.wait()
        log.info("shutdown signal=%s", received.name)
        # A second signal during the drain lands in the socket and is ignored: the drain is bounded anyway.
        server.shutdown()
    finally:
        if own_signals:
            signals.close()
    return 0
