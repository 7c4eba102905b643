"""The one place tests and benchmarks assemble a :class:`DataPlane` in process (no server, no transport): a
change to its constructor is one edit here."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from indexer_service.kernels.specialization import CompileKey, warmup_keys
from indexer_service.service.compute.backends import Backend, make_backend
from indexer_service.service.compute.warmup import Warmup
from indexer_service.service.config import ServiceConfig, load_config
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.overload.limits import strict_admission


def make_plane(
    config: ServiceConfig | None = None,
    *,
    backend: Backend | str = "numpy",
    admit: Callable[[CompileKey], None] | None = None,
    native_fast_path: bool = False,
    metrics: Metrics | None = None,
    warmup: Warmup | None = None,
    keys: Iterable[CompileKey] | None = None,
    warmup_on: str | None = None,
    **settings: object,
) -> DataPlane:
    """A data plane over ``config`` (or the defaults with ``settings`` and a named ``backend``, no environment
    read).

    ``backend``: a :class:`Backend`, or a name for ``make_backend(name, admit, native_fast_path)``. ``admit``: strict
    mode's launch admission, the backend's and the data plane's (None: ``strict_admission`` of the config, as a server
    builds it). ``warmup`` defaults to one over ``keys`` (the model's warmup keys when None), ahead of time for
    ``warmup_on`` and disabled when that is None, with one worker. Nothing is run or refreshed: the caller decides."""
    if config is None:
        config = load_config({"backend": backend, **settings} if isinstance(backend, str) else settings, env={})
    elif settings:
        raise TypeError(f"settings {sorted(settings)} given with a config")
    metrics = metrics if metrics is not None else Metrics()
    if warmup is None:
        keys = warmup_keys(config.model) if keys is None else keys
        warmup = Warmup(
            keys, target=warmup_on, enabled=warmup_on is not None, workers=1, metrics=metrics, model=config.model
        )
    if admit is None:
        admit = strict_admission(config, warmup)
    if isinstance(backend, str):
        backend = make_backend(backend, admit, native_fast_path=native_fast_path)
    return DataPlane(config, metrics, warmup, backend, admit)
