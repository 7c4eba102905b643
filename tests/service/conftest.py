"""Fixtures of the service layer. Service processes: real ``indexer-service serve`` processes on 127.0.0.1
(testkit.harness's ServiceProcess, the benchmarks' too), each killed in teardown whatever the test did."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from indexer_service.service.compute.devices import resolve_backend
from indexer_service.service.compute.warmup import IN_PROCESS
from indexer_service.service.dataplane import DataPlane
from testkit.harness import ServiceProcess, clean_env, http_get
from testkit.planes import make_plane

# A warmup that fails every key and so never becomes ready: sm_1 does not exist and ptxas says so. The numpy
# backend keeps this ahead-of-time target in use on a CUDA machine too, where the Triton backend would compile
# in-process for its own GPU instead.
FAILING_WARMUP = ("--backend", "numpy", "--warmup-target", "cuda:1")


def default_backend_and_target() -> tuple[str, str]:
    """What the default config serves with on this machine (``backend = auto``: ``auto`` on CUDA, else numpy):
    the live server's. The embedded default's ``warmup_target`` (cuda:90) applies to numpy only; Triton and
    auto compile in-process."""
    backend = resolve_backend("auto")
    return backend, IN_PROCESS if backend != "numpy" else "cuda:90"


class Scrape:
    """One real scrape of ``/metrics``, parsed by prometheus_client's own parser."""

    def __init__(self, text: str) -> None:
        self.families: dict[str, Metric] = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, name: str, **labels: str) -> list:
        """Samples called ``name`` (a family's sample, e.g. ``x_count``) whose labels include ``labels``."""
        return [
            s
            for f in self.families.values()
            for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()
        ]

    def value(self, name: str, **labels: str) -> float | None:
        """The one sample ``name`` with exactly ``labels`` (None when absent)."""
        found = [s.value for s in self.samples(name, **labels) if s.labels == labels]
        assert len(found) <= 1, f"{name}{labels} is ambiguous"
        return found[0] if found else None


def scrape(server: ServiceProcess) -> Scrape:
    status, text = http_get(f"{server.http_url}/metrics")
    assert status == 200, text
    return Scrape(text)


StartServer = Callable[..., ServiceProcess]


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PEM files: a CA, a server certificate for 127.0.0.1 and a client certificate it issued, and a client
    certificate (with its key) from another CA, which a server trusting only the first must refuse."""
    folder = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("scheduler@example.org")
    stranger = other_ca.issue_cert("scheduler@example.org")
    files = {
        "ca": ca.cert_pem,
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
        "foreign_client_cert": stranger.cert_chain_pems[0],
        "foreign_client_key": stranger.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(folder / f"{name}.pem"))
    return {name: str(folder / f"{name}.pem") for name in files}


@pytest.fixture(scope="session")
def triton_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One Triton cache for the session's servers: after the first warmup, the others load instead of compile."""
    return tmp_path_factory.mktemp("triton-cache")


def _server_factory(workdir: Path, cache_dir: Path) -> tuple[StartServer, list[ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(*args: str, ready: bool = True, env: dict[str, str] | None = None) -> ServiceProcess:
        server = ServiceProcess(*args, workdir=workdir, env=env or clean_env(TRITON_CACHE_DIR=str(cache_dir)))
        started.append(server.start())
        server.wait_listening()
        if ready:
            server.wait_ready(timeout=120.0, poll=0.05)
        return server

    return start, started


@pytest.fixture
def start_server(tmp_path: Path, triton_cache_dir: Path) -> Iterator[StartServer]:
    """``start_server(*flags, ready=True, env=None)``: a server process for this test, killed afterwards."""
    start, started = _server_factory(tmp_path, triton_cache_dir)
    try:
        yield start
    finally:
        for server in started:
            server.kill()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory: pytest.TempPathFactory, triton_cache_dir: Path) -> Iterator[ServiceProcess]:
    """The default configuration as the README starts it (ahead-of-time warmup for cuda:90), ready."""
    start, started = _server_factory(tmp_path_factory.mktemp("live-server"), triton_cache_dir)
    try:
        yield start()
    finally:
        for server in started:
            server.kill()


@pytest.fixture
def plane() -> DataPlane:
    """A data plane for one test: the numpy backend, no warmup keys and no warmup (run, so it is over), the
    default settings otherwise."""
    plane = make_plane(backend="numpy", keys=(), warmup_target="none")
    plane.warmup.run()
    return plane
