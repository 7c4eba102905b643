"""What the tests and the benchmarks share: a served process on loopback (the one server harness of both), a
bounded closed-loop load generator, RSS readings and Prometheus scrapes.

Every process started here is killed by its owner (``with ServiceProcess(...)``), every load loop stops at a
call count or a deadline, whichever comes first, and traffic only ever goes to loopback addresses.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from indexer_service.service.process.addresses import host_port
from testkit.paths import REPO
from testkit.record import note_pinned

INDEXER_SERVICE = str(Path(sys.executable).with_name("indexer-service"))
LOOPBACK = "127.0.0.1"
# Where the attack tools connect from when they can choose (any of 127.0.0.0/8 reaches a server on loopback): another
# peer than the victims, clients and probes on LOOPBACK, as another tenant's pod is to the per-peer shares and caps.
FLOOD_PEER = "127.0.0.2"
# Flags that make a server take requests within about a second: the numpy backend never imports torch and
# nothing compiles. The warmup benchmark measures the default start instead.
FAST_START = ("--backend", "numpy", "--warmup-target", "none")
# What `indexer-service serve` imports on a machine without a GPU: the numpy backend, and Triton for the
# ahead-of-time warmup; never torch (tests/service/test_start_messages.py holds that). bench_service_warmup's
# memory baseline is a process that imports only these.
CPU_SERVER_IMPORTS = (
    "numpy",
    "grpc",
    "triton",
    "uvicorn",
    "prometheus_client",
    "indexer_service.service.process.server",
    "indexer_service.kernels.compile_engine",
)
_serial = itertools.count()


def clean_env(**overrides: str) -> dict[str, str]:
    """This process's environment without INDEXER_* settings, so only the flags given count."""
    from indexer_service.service.config import CONFIG_FILE_ENV, ENV_PREFIX

    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k != CONFIG_FILE_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    # One process, as before worker processes existed (workers = 0 would start one per CPU): the tests and
    # benchmarks of the single process stay what they were; worker tests and bench_workers ask for more.
    env[ENV_PREFIX + "WORKERS"] = "1"
    env.update(overrides)
    return env


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """Status and body; HTTP errors are answers, not exceptions."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def poll(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> object:
    """Calls ``predicate`` until it returns a truthy value, and returns that value; returns the last (falsy)
    value once ``timeout`` seconds have passed. Tests wait this way for any state they can observe, not for a
    fixed time: a loaded 2-core CI machine may take far longer than this one to get there."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()) and time.monotonic() < deadline:
        time.sleep(interval)
    return result


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """:func:`poll`, failing with ``what`` when ``predicate`` has not come true within ``timeout`` seconds."""
    result = poll(predicate, timeout, interval)
    assert result, f"timed out after {timeout} s waiting for {what}"
    return result


def listen_flags(grpc_host: str = LOOPBACK, http_host: str = LOOPBACK, grpc_port: int = 0) -> list[str]:
    """``serve``'s flags for listening on these hosts at ports the OS picks (gRPC, both HTTP ports and the health
    port), or at ``grpc_port`` for gRPC when given."""
    return [
        f"--grpc-host={grpc_host}",
        f"--http-host={http_host}",
        f"--grpc-port={grpc_port}",
        "--http-port=0",
        "--http-rpc-port=0",
        "--health-port=0",
    ]


class ServiceProcess:
    """One server process on loopback ports chosen by the OS, found through the ``--port-file`` it writes.

    ``command`` defaults to ``indexer-service serve``; any command that writes ``{"grpc_port": ...}`` (and
    optionally ``"http_port"``) to the file named by its ``--port-file`` argument works (the echo baseline).
    ``cpus`` pins the process and every thread it will start. The tests' ``start_server`` fixture and the
    benchmarks both start their servers through this class; ``ports`` holds the port file as it was written.
    """

    def __init__(
        self,
        *flags: str,
        workdir: Path | None = None,
        env: dict[str, str] | None = None,
        cpus: Iterable[int] | None = None,
        command: Sequence[str] | None = None,
        grpc_host: str = LOOPBACK,
        http_host: str = LOOPBACK,
    ) -> None:
        self._scratch = None if workdir else tempfile.TemporaryDirectory(prefix="indexer-bench-")
        self.workdir = Path(workdir or self._scratch.name)
        n = next(_serial)
        self.port_file = self.workdir / f"server-{os.getpid()}-{n}.ports.json"
        self.log_path = self.workdir / f"server-{os.getpid()}-{n}.log"
        self.grpc_host, self.http_host = grpc_host, http_host
        if command is None:
            command = [INDEXER_SERVICE, "serve", *listen_flags(grpc_host, http_host)]
        self.command = [*command, "--port-file", str(self.port_file), *flags]
        self.env = env if env is not None else clean_env(TRITON_CACHE_DIR=str(self.workdir / "triton-cache"))
        self.cpus = set(cpus) if cpus is not None else None
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self.grpc_port = self.http_port = self.health_port = 0
        self.http_rpc_port: int | None = None  # None: the server serves no RPCs over HTTP (http_rpcs = false)
        self.ports: dict[str, int] = {}

    def start(self) -> ServiceProcess:
        cpus = self.cpus
        if cpus:
            note_pinned(self.command, cpus)  # the run record names what ran where
        with open(self.log_path, "wb") as log:
            self.started_at = time.perf_counter()
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    @property
    def address(self) -> str:
        return host_port(self.grpc_host, self.grpc_port)

    @property
    def http_url(self) -> str:
        """``/metrics``, ``/livez``, ``/readyz`` (``http_port``)."""
        return f"http://{host_port(self.http_host, self.http_port)}"

    @property
    def http_rpc_url(self) -> str:
        """The RPCs over HTTP (``http_rpc_port``), plaintext: a server with TLS answers ``https://`` there."""
        assert self.http_rpc_port, "this server serves no RPCs over HTTP"
        return f"http://{host_port(self.http_host, self.http_rpc_port)}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _fail(self, why: str) -> RuntimeError:
        return RuntimeError(f"{why} (exit code {self.process.poll() if self.process else None}):\n{self.log()}")

    def wait_listening(self, timeout: float = 60.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout
        while not self.port_file.exists():
            if self.process is None or self.process.poll() is not None:
                raise self._fail("server exited before listening")
            if time.monotonic() > deadline:
                raise self._fail(f"server not listening after {timeout} s")
            time.sleep(0.01)
        self.ports = ports = json.loads(self.port_file.read_text())
        self.grpc_port, self.http_port = ports["grpc_port"], ports.get("http_port", 0)
        self.health_port = ports.get("health_port", 0)  # servers before issue 10 have no health listener
        self.http_rpc_port = ports.get("http_rpc_port")
        return self

    def wait_ready(self, timeout: float = 180.0, poll: float = 0.01) -> float:
        """Block until /readyz answers 200; returns seconds since :meth:`start`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if http_get(f"{self.http_url}/readyz", timeout=2.0)[0] == 200:
                    self._note_pinned_workers()
                    return time.perf_counter() - self.started_at
            except OSError:
                pass  # the listener is up but a probe can still race a slow accept; poll again
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                raise self._fail("server not ready")
            time.sleep(poll)

    def _note_pinned_workers(self) -> None:
        """Name in the run record the CPUs of each worker that the service pinned itself (``pin_workers``), which
        :meth:`start`'s note does not see."""
        try:
            own = os.sched_getaffinity(self.pid)
            for worker in psutil.Process(self.pid).children():
                if set(cpus := worker.cpu_affinity()) != own:
                    note_pinned([*self.command[:2], "worker"], cpus)
        except (psutil.Error, OSError):  # it exited meanwhile: the next wait says so
            pass

    def __enter__(self) -> ServiceProcess:
        self.start().wait_listening()
        if self.http_port:
            self.wait_ready()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def connections_on(self, port: int) -> int:
        """Established TCP connections the server holds on its ``port``: how many connections its callers use."""
        held = psutil.Process(self.pid).net_connections(kind="tcp")
        return sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port for c in held)

    def rss_bytes(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def peak_rss_bytes(self) -> int:
        """The kernel's high-water mark of the resident set (VmHWM): a peak no sampling can miss."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/<pid>/status")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code."""
        assert self.process is not None, "not started"
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait(10)
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None


# gRPC shares one connection between the channels of a process that have the same target and options (its
# global subchannel pool): ten callers and a victim made with the same arguments were one HTTP/2 connection, so
# the server's per-connection stream limit refused the victim's calls along with the flooders' (issue 19).
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


def channel(address: str, max_message_bytes: int = 64 * 2**20) -> grpc.Channel:
    """A plain channel on a connection of its own (:data:`OWN_CONNECTION`), without retries, so every refusal
    reaches the caller as it happened."""
    return grpc.insecure_channel(
        address,
        options=[
            OWN_CONNECTION,
            ("grpc.enable_retries", 0),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )


# --- load ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallRecord:
    """One call: when it started (seconds since the run began), how long it took, its status, what was wrong."""

    start: float
    seconds: float
    code: grpc.StatusCode
    problem: str = ""


@dataclass
class LoadRun:
    in_flight: int
    elapsed: float
    records: list[CallRecord] = field(default_factory=list)

    @property
    def calls_per_second(self) -> float:
        return len(self.records) / self.elapsed if self.elapsed else 0.0

    def latencies(self, start: float = 0.0, stop: float = float("inf")) -> np.ndarray:
        """Seconds of the OK calls that started in ``[start, stop)``."""
        return np.array([r.seconds for r in self.records if r.code is grpc.StatusCode.OK and start <= r.start < stop])

    def codes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            counts[r.code.name] = counts.get(r.code.name, 0) + 1
        return counts

    def problems(self) -> list[CallRecord]:
        return [r for r in self.records if r.problem]


# A call: performs call number i; returns its status code and a problem description ("" when the answer
# was right). Exceptions other than grpc.RpcError count as problems too.
Call = Callable[[int], tuple[grpc.StatusCode, str]]


def closed_loop(call: Call, in_flight: int, max_calls: int, max_seconds: float) -> LoadRun:
    """``in_flight`` threads, each issuing its next call as soon as the previous one returns, until
    ``max_calls`` calls were issued or ``max_seconds`` passed."""
    counter = itertools.count()
    records: list[CallRecord] = []
    lock = threading.Lock()
    begin = time.perf_counter()
    deadline = begin + max_seconds

    def worker() -> None:
        local = []
        while True:
            i = next(counter)
            if i >= max_calls:
                break
            started = time.perf_counter()
            if started >= deadline:
                break
            try:
                code, problem = call(i)
            except grpc.RpcError as exc:
                code, problem = exc.code(), f"unhandled {exc.code().name}: {exc.details()}"
            except Exception as exc:  # a checker bug or a decode failure must show up, not kill the thread
                code, problem = grpc.StatusCode.UNKNOWN, f"client-side {type(exc).__name__}: {exc}"
            local.append(CallRecord(started - begin, time.perf_counter() - started, code, problem))
        with lock:
            records.extend(local)

    threads = [threading.Thread(target=worker, name=f"load-{n}", daemon=True) for n in range(in_flight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max_seconds + 120.0)
    run = LoadRun(in_flight, time.perf_counter() - begin)
    run.records = sorted(records, key=lambda r: r.start)
    return run


def merged_counts(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Several runs' counts by name (failed calls by code, an attacker's GOAWAYs or stream endings) added up."""
    total: Counter[str] = Counter()
    for one in counts:
        total.update(one)
    return dict(total)


def percentile_us(seconds: np.ndarray, q: float) -> float:
    return float(np.percentile(seconds, q) * 1e6) if seconds.size else float("nan")


class RssSampler:
    """Samples a process's RSS every ``interval`` seconds on a thread, between ``with`` and its end."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def _run(self) -> None:
        begin = time.perf_counter()
        while not self._stop.is_set():
            try:
                self.samples.append((time.perf_counter() - begin, self.process.memory_info().rss))
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def median(self, start: float, stop: float = float("inf")) -> float:
        """Median RSS of the samples taken in ``[start, stop)``: in-flight buffers make single samples jump by
        tens of MiB, while retained memory (a leak) moves the median."""
        window = [rss for t, rss in self.samples if start <= t < stop]
        return float(np.median(window)) if window else float("nan")


# --- metrics ------------------------------------------------------------------------------------------------


def scrape(http_url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of the server's /metrics, keyed by (sample name, labels)."""
    status, body = http_get(f"{http_url}/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def metric_total(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


# --- output -------------------------------------------------------------------------------------------------


def mib(n: float) -> float:
    return n / 2**20


def start_all(servers: Iterable[ServiceProcess]) -> None:
    """Start every server, then wait until each listens and is ready: their start-ups overlap."""
    servers = list(servers)
    for server in servers:
        server.start()
    for server in servers:
        server.wait_listening()
        server.wait_ready()
