"""One worker process of several, started by service/process/supervisor.py, never by hand:
``python -m indexer_service.service.process.worker HANDOFF`` (service/process/workerproto.py says what it holds).

A worker is the single-process server (:class:`service.process.server.IndexerServer`) with a :class:`WorkerLink` to its
supervisor: ``http_port`` accepts at once on the supervisor's listening socket (inherited), so ``/livez``, ``/readyz``
(the replica's readiness, read from the supervisor's ``pod-status`` file) and ``/metrics`` answer from the start
(``http_rpc_port``'s inherited socket only once the worker has joined the gRPC port, below); the warmup takes the
replica's compile lock (the first worker compiles into the shared Triton cache, the others load from it); only once
warmed up does the worker's gRPC server bind the shared gRPC port (SO_REUSEPORT, reserved by the supervisor) and its
private probe socket, then say ``ready 1``: the kernel hands a worker gRPC connections only once it can serve them,
after a restart too. The supervisor's health probes come through the probe socket; the health port is the supervisor's.
The worker dies with its supervisor (``PR_SET_PDEATHSIG``), and drains on SIGTERM (or SIGINT, SIGHUP) as the single
process does.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys

from indexer_service.service.process.workerproto import CONFIG_FILE, Handoff, Status, WorkerLink, config_from_json

_PR_SET_PDEATHSIG = 1
# How often the main thread looks whether the warmup has finished, while it waits for a signal.
_WARMUP_POLL_SECONDS = 0.05

log = logging.getLogger("indexer_service.service.process.worker")  # its name also when run as __main__


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the supervisor dies (a container's PID 1 taking its children down, outside one)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def run_worker(link: WorkerLink, signals: object) -> int:
    """Serve until a shutdown signal (from the supervisor), then drain; the single process's
    :func:`service.process.server.serve`, with a link instead of a port file and the gRPC port joined once warmed up."""
    # Imported here, not at the top: main() has tied this process to its supervisor's life before the server's
    # imports (numpy, grpc, a backend) take their time.
    from indexer_service.service import adapters
    from indexer_service.service.compute.devices import uses_triton
    from indexer_service.service.observability.logs import configure_logging
    from indexer_service.service.observability.version import VERSION
    from indexer_service.service.overload.allocator import configure_malloc
    from indexer_service.service.process.server import IndexerServer

    config = config_from_json((link.runtime_dir / CONFIG_FILE).read_text())
    configure_logging(config.log_level, config.log_format, link.slot)
    # Its libraries as its supervisor's, and Triton, which only workers import: their fallbacks on its start line.
    adapters.probe_all(triton=uses_triton(config.backend, config.warmup_enabled))
    log.info("start pid=%d indexer-service %s dependency_fallbacks=%s", os.getpid(), VERSION, adapters.summary())
    configure_malloc(config.malloc_arena_max, config.malloc_retain_bytes)
    server = IndexerServer(config, link) if signals.pending() is None else None
    if server is None or signals.pending() is not None:
        log.info("shutdown signal=%s before the server started", signals.wait().name)
        return 0
    server.start()
    link.report(Status.LISTENING)
    received = signals.pending()
    while received is None and not server.warmup_done.is_set():
        received = signals.wait(_WARMUP_POLL_SECONDS)
    if received is None:
        server.join_rpc_port()
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
    handoff = Handoff.from_argv(argv)
    die_with_parent(handoff.parent_pid)
    if handoff.cpu >= 0:
        pin_to_cpu(handoff.cpu)
    from indexer_service.service.process.lifecycle import ShutdownSignals, end_process

    signals = ShutdownSignals()
    link = WorkerLink(handoff)
    try:
        code = run_worker(link, signals)
    except OSError as exc:  # a fatal start-up error (bind): the supervisor stops the replica if none started
        log.error("fatal %s", exc)
        print(f"indexer-service serve: worker {handoff.slot}: {exc}", file=sys.stderr)
        code = 1
    except BaseException:
        log.exception("fatal internal error")
        code = 1
    end_process(code)


if __name__ == "__main__":
    main(sys.argv[1:])
