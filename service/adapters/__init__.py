"""Where the service reaches past a library's public API, and what it does where that reach fails.

One adapter module per library holds every such reach-in: :mod:`.grpcio`, :mod:`.uvicorn_http`, :mod:`.prometheus`,
and, since the kernels never import the service, ``kernels/triton_adapter.py``, which reports what it finds as plain
data for :func:`probe_all` to take. Nothing else in the product names a library's private module or attribute
(tests/service/test_adapters.py reads the sources). Each reach-in is a *feature* with a public fallback. An adapter
probes its library once a process, at start, before anything listens (Triton only in a process that imports it:
:func:`probe_all`): where the internals a feature uses are all there, the feature is on; where one is missing or
differs, the service takes the public path instead and says so through :func:`take`: one WARNING naming what is off,
the start line, ``indexer_dependency_fallback{library,feature}`` 1, and GetWarmupStatus's ``dependency_fallbacks``.
A version within the declared range never refuses to start, and never loses a feature silently. Each adapter's
tests hide what it relies on, one name at a time: tests/service/test_adapter_grpcio.py,
tests/service/test_adapter_uvicorn.py, tests/service/test_adapter_prometheus.py, tests/kernels/test_triton_adapter.py.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Every feature of every adapter: ``indexer_dependency_fallback`` has a series for each, 0 while the feature is on.
FEATURES: dict[str, tuple[str, ...]] = {
    # grpc._server's call state read directly; the receive of a unary request before a thread is spent on it;
    # a streaming send that does not wait for the peer's window.
    "grpcio": ("call_state", "receive_ahead", "send_without_waiting"),
    # uvicorn's httptools protocol with this server's limits on heads, trailers, idle time and connections.
    "uvicorn": ("limited_protocol",),
    # prometheus_client's value class picked again where it was imported before the multiprocess directory was
    # named; a dead worker's counts folded into one file.
    "prometheus_client": ("multiprocess_value_class", "retire_process"),
    # Triton's parallel compile inside the JIT; its installation hash computed ahead of the first compile; the
    # driver that was active put back after an ahead-of-time compile's stand-in; its argument binder set up without
    # torch where nothing launches on a GPU.
    "triton": ("async_compile", "compiler_key", "compile_only_driver", "binder_without_torch"),
}
TRITON = "triton"

# Where code of the service runs on a library's own thread (indexer_library_callback_errors_total's ``where``):
# a receive's and a send's completion on gRPC's polling thread; the limited HTTP protocol's steps in its callbacks
# and timers on uvicorn's event loop.
LIBRARY_THREAD_CALLBACKS = ("receive_ahead", "send_without_waiting", "limited_protocol")


@dataclass(frozen=True)
class Fallback:
    """A feature on its public path: ``missing`` names what the library lacks, ``public_path`` what runs instead."""

    library: str
    feature: str
    missing: tuple[str, ...]
    public_path: str

    def describe(self) -> str:
        return f"{self.library} {self.feature}: {', '.join(self.missing)} not as expected; {self.public_path}"


_lock = threading.Lock()
_taken: dict[tuple[str, str], Fallback] = {}


def take(fallback: Fallback) -> None:
    """Record that ``fallback`` is taken in this process; the first time, log it as a WARNING."""
    if fallback.feature not in FEATURES.get(fallback.library, ()):
        raise ValueError(f"unknown dependency feature {fallback.library}.{fallback.feature}")
    key = (fallback.library, fallback.feature)
    with _lock:
        if key in _taken:
            return
        _taken[key] = fallback
    log.warning("dependency_fallback %s", fallback.describe())


def taken() -> list[Fallback]:
    """The fallbacks this process has taken, in the order of :data:`FEATURES`."""
    with _lock:
        found = dict(_taken)
    return [
        found[(lib, feature)] for lib, features in FEATURES.items() for feature in features if (lib, feature) in found
    ]


def summary() -> str:
    """``none``, or ``library.feature,...``: the start line's ``dependency_fallbacks``."""
    return ",".join(f"{f.library}.{f.feature}" for f in taken()) or "none"


def probe_all(triton: bool = False) -> list[Fallback]:
    """Probe every adapter's library now (each probes once per process) and return the fallbacks taken. ``triton``:
    Triton too, where this process imports it anyway (a warmup, a GPU backend, ``precompile``); it is left alone
    elsewhere (the numpy backend with no warmup, the supervisor of several workers), and so are its fallbacks. Call
    it once the process's multiprocess directory, if it has one, is named (:mod:`.prometheus` says why)."""
    from indexer_service.service.adapters import grpcio, prometheus, uvicorn_http

    grpcio.features()
    uvicorn_http.limited_protocol_on()
    prometheus.features()
    if triton:
        from indexer_service.kernels import triton_adapter

        for feature, missing, public_path in triton_adapter.fallbacks():
            take(Fallback(TRITON, feature, missing, public_path))
    return taken()
