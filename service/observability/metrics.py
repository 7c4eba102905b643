"""Every Prometheus metric of the service, defined in one place.

Naming follows Prometheus conventions: base units (seconds, counts), ``_seconds`` and ``_total`` suffixes, histograms
rather than summaries. Every label set is bounded: ``method`` by the proto, ``code`` by gRPC's status codes, ``key`` by
the model's warmup set, ``backend`` by three values (numpy, triton, native).

With several worker processes (``workers``, service/process/supervisor.py) every process writes its metrics to the files
of prometheus_client's multiprocess mode, in a private directory the supervisor names in ``PROMETHEUS_MULTIPROC_DIR``
before any worker starts: counters and histograms add up over every worker that ever ran (a dead worker's counts are
folded into one file of retired counts, :func:`retire_process`, so the directory, and a scrape's cost, stay the same
size however often workers restart), and each gauge says how its workers' values combine (``multiprocess_mode``, ignored
in a single process; a dead worker's gauges go with it). ``/metrics`` of any worker serves the whole replica;
``indexer_ready`` there is the supervisor's verdict alone.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from indexer_service.service import adapters
from indexer_service.service.observability.threadmetrics import LevelGauge, ThreadGauge, ThreadHistogram
from indexer_service.service.observability.version import build_labels
from indexer_service.service.reasons import HttpRefusal, Port, RestartReason

if TYPE_CHECKING:
    from prometheus_client.core import Metric

M = TypeVar("M", Counter, Gauge, Histogram, ThreadGauge, ThreadHistogram)

# Request latency spans from a tiny batch over loopback (the first bucket, 100 us) to seconds (a huge batch through
# the interpreter). One row, as the other bucket sets, so the 1-2.5-5 steps read across (the formatter would put
# one value a line).
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = tuple(float(4**i) for i in range(0, 11))  # 1 .. ~1M
REQUEST_COUNT_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0)

# planned: the warmup set's size; compiled: keys compiled by this warmup; cached: keys Triton loaded from its cache.
WARMUP_STATES = ("planned", "compiled", "cached", "failed")
# The method label of calls to a method the service does not have (gRPC and HTTP), counted with code UNIMPLEMENTED.
UNKNOWN_METHOD = "unknown"
# Metric types whose values add up over processes: a dead process's are folded into one file of retired values.
RETIRED_TYPES = ("counter", "histogram", "summary")
_FILES_LOCK = "files.lock"  # scrapes read the multiprocess files under it shared; retiring a process, exclusive


def per_call_histogram(
    name: str, documentation: str, labelnames: list[str], buckets: tuple[float, ...], registry: CollectorRegistry
) -> Histogram | ThreadHistogram:
    """A histogram every call records into: lock-free in a single process (service/observability/threadmetrics.py),
    prometheus_client's with workers (the multiprocess files are what a scrape reads)."""
    if multiprocess_dir() is None:
        return ThreadHistogram(name, documentation, labelnames, buckets, registry)
    return Histogram(name, documentation, labelnames, buckets=buckets, registry=registry)


def per_call_gauge(
    name: str, documentation: str, labelnames: list[str], registry: CollectorRegistry
) -> Gauge | ThreadGauge:
    """An up-down gauge every call moves, as :func:`per_call_histogram`; with workers, their sum (``livesum``)."""
    if multiprocess_dir() is None:
        return ThreadGauge(name, documentation, labelnames, registry)
    return Gauge(name, documentation, labelnames, registry=registry, multiprocess_mode="livesum")


def per_call_level_gauge(name: str, documentation: str, registry: CollectorRegistry) -> Gauge | LevelGauge:
    """An unlabelled gauge every call sets, as :func:`per_call_histogram`; with workers, their sum (``livesum``)."""
    if multiprocess_dir() is None:
        return LevelGauge(name, documentation, registry)
    return Gauge(name, documentation, registry=registry, multiprocess_mode="livesum")


def _ready_gauge(registry: CollectorRegistry) -> Gauge:
    """``indexer_ready``, the one definition, at 0 until readiness says otherwise: a single process's own
    (:class:`Metrics`); with workers, the supervisor's verdict for the replica (:class:`SupervisorMetrics`: only
    the supervisor writes it; ``livemin`` over that one process)."""
    ready = Gauge(
        "indexer_ready",
        "1 when warmup has finished and the server takes requests.",
        registry=registry,
        multiprocess_mode="livemin",
    )
    ready.set(0)
    return ready


class Metrics:
    """The service's metrics on their own registry (tests start several servers in one process), with the
    process's own ``process_*`` (prometheus_client's ProcessCollector; with workers, every process's: see
    :class:`_ReplicaCollector`). ``worker``: one worker of several, which leaves ``indexer_ready`` to its supervisor
    (``ready`` is None)."""

    def __init__(self, registry: CollectorRegistry | None = None, worker: bool = False) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        if multiprocess_dir() is None:
            ProcessCollector(registry=r)
        self.build_info = Gauge(
            "indexer_build_info",
            "1, labelled with the server's version and those of Python, grpcio, protobuf, numpy, torch and triton.",
            list(build_labels()),
            registry=r,
            multiprocess_mode="livemax",  # every worker writes the same series: the replica shows it once
        )
        self.warmup_keys = Gauge(
            "indexer_warmup_keys",
            "Compile keys of the warmup set, by state (planned: the set's size; cached: loaded from Triton's cache).",
            ["state"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.warmup_key_compile_seconds = Gauge(
            "indexer_warmup_key_compile_seconds",
            "Seconds the last warmup spent compiling each key.",
            ["key"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.compile_duration_seconds = Histogram(
            "indexer_compile_duration_seconds",
            "Seconds per kernel compile (warmup and after ready).",
            ["phase"],
            buckets=COMPILE_BUCKETS,
            registry=r,
        )
        self.warmup_duration_seconds = Gauge(
            "indexer_warmup_duration_seconds",
            "Wall seconds of the start-up warmup, all keys.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.warmup_failures_total = Counter(
            "indexer_warmup_failures_total", "Keys whose warmup compile failed.", registry=r
        )
        self.ready = None if worker else _ready_gauge(r)
        self.warmup_misses_total = Counter(
            "indexer_warmup_misses_total",
            "Requests whose kernel variant is outside the model's warmup set, on any backend (a GPU replica would "
            'compile it after ready), by variant (the first 32 by name, then "other").',
            ["variant"],
            registry=r,
        )
        self.compiles_after_ready_total = Counter(
            "indexer_compiles_after_ready_total",
            "Kernel compiles (including disk-cache loads) after the server turned ready; should stay 0.",
            registry=r,
        )
        self.request_duration_seconds = per_call_histogram(
            "indexer_request_duration_seconds",
            "RPC latency inside the server, by method and gRPC status code.",
            ["method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.call_wait_seconds = per_call_histogram(
            "indexer_call_wait_seconds",
            "Seconds a gRPC call waited in the server for a thread, from its request being in, by method.",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.call_seconds = per_call_histogram(
            "indexer_call_seconds",
            "Seconds a gRPC call spent in the server, from its request being in to its end (answered, refused or "
            "cut), by method.",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_duration_seconds = per_call_histogram(
            "indexer_backend_duration_seconds",
            "Seconds spent in the compute backend per RPC.",
            ["method", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_query_tokens = per_call_histogram(
            "indexer_request_query_tokens", "Query tokens per RPC.", ["method"], buckets=TOKEN_BUCKETS, registry=r
        )
        self.request_batch_requests = per_call_histogram(
            "indexer_request_batch_requests",
            "Requests (sequences) per RPC.",
            ["method"],
            buckets=REQUEST_COUNT_BUCKETS,
            registry=r,
        )
        self.request_errors_total = _request_errors_counter(r)
        self.requests_in_flight = per_call_gauge(
            "indexer_requests_in_flight", "RPCs being served right now.", ["method"], registry=r
        )
        self.requests_shed_total = _shed_counter(r)
        self.response_bytes_held = per_call_level_gauge(
            "indexer_response_bytes_held", "Bytes of responses being built, queued or not yet read.", registry=r
        )
        self.response_budget_bytes = Gauge(
            "indexer_response_budget_bytes",
            "The most bytes of responses the server holds at once.",
            registry=r,
            multiprocess_mode="livesum",  # each worker has its own budget: the replica's is their sum
        )
        self.http_connections = Gauge(
            "indexer_http_connections", "Open HTTP connections.", registry=r, multiprocess_mode="livesum"
        )
        self.open_fds = _open_fds_gauge(r)
        self.peer_cap = PeerCapMetrics(r)
        self.http_refused_total = Counter(
            "indexer_http_refused_total",
            "HTTP connections or requests refused by a limit, by reason.",
            ["reason"],
            registry=r,
        )
        self.dependency_fallback = _dependency_fallback_gauge(r)
        self.library_callback_errors_total = _library_callback_errors_counter(r)
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}
        self.build_info.labels(**build_labels()).set(1)
        self.show_fallbacks()
        self.request_errors_total.labels(method=UNKNOWN_METHOD, code="UNIMPLEMENTED")
        for state in WARMUP_STATES:
            self.warmup_keys.labels(state=state).set(0)
        for reason in HttpRefusal:
            self.http_refused_total.labels(reason=reason)

    def show_fallbacks(self) -> None:
        """``indexer_dependency_fallback``: every adapter feature, 1 for those on their public path now."""
        show_fallbacks(self.dependency_fallback)

    def child(self, metric: M, *label_values: str) -> M:
        """``metric.labels(*label_values)``, resolved once: ``labels()`` validates its arguments and takes a
        lock on every call, microseconds each on a request path that touches five. Label sets are bounded, so
        is this cache; a race only resolves the same child twice."""
        key = (id(metric), label_values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*label_values)
        return found


def _request_errors_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "indexer_request_errors_total",
        "RPCs answered with a non-OK status, by method and code.",
        ["method", "code"],
        registry=registry,
    )


def _dependency_fallback_gauge(registry: CollectorRegistry) -> Gauge:
    """``indexer_dependency_fallback``, the one definition: each process's (a worker's and its supervisor's alike),
    the largest over the live ones (``livemax``)."""
    return Gauge(
        "indexer_dependency_fallback",
        "1 where a library's internals differ and the service took the feature's public path (service/adapters).",
        ["library", "feature"],
        registry=registry,
        multiprocess_mode="livemax",
    )


def show_fallbacks(gauge: Gauge) -> None:
    """Every adapter feature's series of ``gauge``: 1 for those on their public path in this process now, else 0."""
    on_fallback = {(f.library, f.feature) for f in adapters.taken()}
    for library, features in adapters.FEATURES.items():
        for feature in features:
            gauge.labels(library, feature).set(int((library, feature) in on_fallback))


def _library_callback_errors_counter(registry: CollectorRegistry) -> Counter:
    counter = Counter(
        "indexer_library_callback_errors_total",
        "Exceptions of the service's own code on a library's thread (gRPC's polling thread, uvicorn's event loop), "
        "caught there, by where they came from.",
        ["where"],
        registry=registry,
    )
    for where in adapters.LIBRARY_THREAD_CALLBACKS:
        counter.labels(where)
    return counter


def _shed_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "indexer_requests_shed_total",
        "Calls the server refused or cut to protect itself (overload or abuse), by method and reason.",
        ["method", "reason"],
        registry=registry,
    )


def _open_fds_gauge(registry: CollectorRegistry) -> Gauge:
    """Each connection is a file descriptor: this shows a port at its connection cap, where gRPC core refuses
    new connections without a count (docs/overload.md, "Connections"). The replica's sum over its processes."""
    return Gauge(
        "indexer_open_fds",
        "Open file descriptors of the serving processes (each connection is one).",
        registry=registry,
        multiprocess_mode="livesum",
    )


class PeerCapMetrics:
    """The per-peer connection cap's series (service/overload/peers.py), by port (grpc, health, http, http_rpc),
    in every process that caps its ports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.peer_connections_closed_total = Counter(
            "indexer_peer_connections_closed_total",
            "Connections closed because their peer held more than its share of the port (max_connections_per_peer, "
            "less on a crowded port), by port.",
            ["port"],
            registry=registry,
        )
        # SYNs of peers at the cap (the listener's filter: service/overload/listenfilter.py) and connections past a
        # full accept queue; each process counts the listeners it alone holds (not the HTTP ports' with workers).
        self.connections_dropped_before_accept_total = Counter(
            "indexer_connections_dropped_before_accept_total",
            "New connections dropped by the kernel before accept (peers at their share, a full accept queue), by port.",
            ["port"],
            registry=registry,
        )
        self.peers_at_connection_cap = Gauge(
            "indexer_peers_at_connection_cap",
            "Peers at their share of the port (max_connections_per_peer, less on a crowded port) whose new connections "
            "are dropped before accept, by port.",
            ["port"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        for port in Port:
            self.peer_connections_closed_total.labels(port=port)
            self.connections_dropped_before_accept_total.labels(port=port)
            self.peers_at_connection_cap.labels(port=port)


def multiprocess_dir() -> str | None:
    """The multiprocess directory this process writes its metrics to (worker mode), or None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def exposition_registry(registry: CollectorRegistry) -> CollectorRegistry:
    """What ``/metrics`` serves: ``registry`` in a single process; in worker mode, every process's files merged."""
    path = multiprocess_dir()
    if path is None:
        return registry
    merged = CollectorRegistry()
    merged.register(_ReplicaCollector(registry, path))
    return merged


class _ReplicaCollector:
    """Every worker's metrics from the multiprocess files, and, as in a single process, the families no process
    has a sample of yet (shed calls, by reason) declared empty: the multiprocess files hold only samples. Then
    ``process_*`` of every live process of the replica (each writes its files under its pid: the supervisor and
    the workers), read from /proc at scrape time and labelled ``process`` (``supervisor`` or ``worker``) and, for
    a worker, ``worker`` (its slot, as in ``indexer_worker_up``): a restarted worker continues its slot's series,
    so the series stay the same however often workers restart."""

    def __init__(self, own: CollectorRegistry, path: str) -> None:
        from prometheus_client import multiprocess

        self.files = multiprocess.MultiProcessCollector(None, path)
        self.path = path
        self.own = own

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import Metric

        seen = set()
        with _files_locked(self.path, fcntl.LOCK_SH):  # not while a dead worker's files are retired
            families = list(self.files.collect())
        for family in families:
            seen.add(family.name)
            yield family
        for family in self.own.collect():
            if family.name not in seen and not family.samples:
                yield Metric(family.name, family.documentation, family.type)
        yield from self._process_families()

    def _process_families(self):
        from prometheus_client.core import Metric

        from indexer_service.service.process.workerproto import worker_slot

        families: dict[str, Metric] = {}
        supervisor = os.getppid()
        for pid in _file_pids(self.path):
            if pid == supervisor:
                labels = {"process": "supervisor"}
            elif (slot := worker_slot(pid)) is not None:
                labels = {"process": "worker", "worker": str(slot)}
            else:
                continue  # dead (its files not yet retired), or gone since they were listed
            for family in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, **labels}, sample.value)
        yield from families.values()


def _file_pids(path: str) -> list[int]:
    """The processes with multiprocess files in ``path`` (``<kind>_<pid>.db``; a dead one's until they are
    retired)."""
    pids = set()
    for name in os.listdir(path):
        pid = name.removesuffix(".db").rpartition("_")[2]
        if name.endswith(".db") and pid.isdigit():
            pids.add(int(pid))
    return sorted(pids)


@contextmanager
def _files_locked(path: str, operation: int) -> Iterator[None]:
    with open(os.path.join(path, _FILES_LOCK), "a") as lock:
        fcntl.flock(lock, operation)  # released when the file closes
        yield


def retire_process(pid: int, path: str) -> bool:
    """The files of dead process ``pid`` in multiprocess directory ``path``: its live gauges removed
    (prometheus_client's ``mark_process_dead``), its counters, histograms and summaries added into one file per type
    (``counter_retired.db``...) and removed (service/adapters/prometheus.py, ``retire_process``; on its public path
    they stay, counted as before). Totals never go down, and the directory keeps one set of files per live process
    plus the retired ones, however many processes died. Done under an exclusive lock, so a scrape never sees a value
    twice or not at all; False (nothing done, try again) while a scrape holds the files."""
    from prometheus_client import multiprocess

    from indexer_service.service.adapters import prometheus

    try:
        with _files_locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB):
            multiprocess.mark_process_dead(pid, path)
            if prometheus.features().retire_process:
                prometheus.fold_into_retired(pid, path, RETIRED_TYPES)
    except BlockingIOError:
        return False
    return True


class SupervisorMetrics:
    """What the supervisor of several workers writes into the shared multiprocess directory: each worker slot's
    state, its restarts by reason, the replica's readiness (``indexer_ready``, which workers leave to it), and its
    own open descriptors, health port's refusals (peer cap, Watch streams) and dependency fallbacks, added to the
    workers'."""

    def __init__(self, workers: int) -> None:
        r = CollectorRegistry()  # never served: the workers' /metrics read the files
        self.worker_up = Gauge(
            "indexer_worker_up",
            "1 while the worker process of this slot runs.",
            ["worker"],
            registry=r,
            multiprocess_mode="max",
        )
        self.worker_ready = Gauge(
            "indexer_worker_ready",
            "1 while the worker of this slot is ready (warmed up, not draining).",
            ["worker"],
            registry=r,
            multiprocess_mode="max",
        )
        self.worker_restarts_total = Counter(
            "indexer_worker_restarts_total",
            "Worker processes restarted after they died, by slot and why (exit, killed, hung).",
            ["worker", "reason"],
            registry=r,
        )
        self.ready = _ready_gauge(r)
        self.open_fds = _open_fds_gauge(r)
        self.peer_cap = PeerCapMetrics(r)
        # The health port's refusals (Watch streams over their cap, watchers that do not read): admission.ShedLog.
        self.requests_shed_total = _shed_counter(r)
        # The health port's calls to other methods, and exceptions on its gRPC polling thread.
        self.request_errors_total = _request_errors_counter(r)
        self.library_callback_errors_total = _library_callback_errors_counter(r)
        # Its own fallbacks (its health port's grpcio, the multiprocess files' prometheus_client) beside the workers'.
        self.dependency_fallback = _dependency_fallback_gauge(r)
        show_fallbacks(self.dependency_fallback)
        for n in range(workers):
            slot = str(n)
            self.worker_up.labels(worker=slot).set(0)
            self.worker_ready.labels(worker=slot).set(0)
            for reason in RestartReason:
                self.worker_restarts_total.labels(worker=slot, reason=reason)

    def child(self, metric: M, *label_values: str) -> M:
        """``metric.labels(*label_values)`` (admission.ShedLog's interface; the supervisor's sheds are rare)."""
        return metric.labels(*label_values)
