"""prometheus_client past its public API: the multiprocess mode's internals the supervisor of several workers uses,
each feature with its public fallback.

- ``multiprocess_value_class``: prometheus_client picks the class its metrics keep their values in (this process's
  memory, or the files of the multiprocess directory) once, when ``prometheus_client.values`` is imported, from
  ``PROMETHEUS_MULTIPROC_DIR``. The supervisor names its directory before anything imports prometheus_client, which
  is the public way (service/process/supervisor.py's ``supervise``, which ``serve`` always takes); where
  prometheus_client was imported first (a program that runs the supervisor itself), :func:`name_multiprocess_dir`
  picks the value class again (``values.ValueClass = values.get_value_class()``). Fallback: no second pick; a
  supervisor in such a process keeps its own series (:data:`SUPERVISOR_SERIES`) in memory, out of /metrics, and
  says so when it starts.
- ``retire_process``: a dead worker's counters, histograms and summaries are added into one file per type
  (``counter_retired.db``...) through ``prometheus_client.mmap_dict.MmapedDict`` and its files removed, so the
  directory, and a scrape's cost, keep their size however often workers restart (:func:`fold_into_retired`).
  Fallback: prometheus_client's public ``multiprocess.mark_process_dead`` alone (:data:`PUBLIC_PATHS`).

:func:`probe` checks every name, signature and behaviour each feature relies on, in the installed modules or in
stand-ins a test gives; :func:`features` takes each feature whose check fails onto its fallback, once a process
(service/adapters/__init__.py says how that is announced). Nothing here imports prometheus_client at import time: the
supervisor imports this module before it names its directory.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from indexer_service.service import adapters

LIBRARY = "prometheus_client"
ENVIRONMENT = "PROMETHEUS_MULTIPROC_DIR"
VALUES_MODULE = "prometheus_client.values"
MMAP_DICT_MODULE = "prometheus_client.mmap_dict"
# The series the supervisor itself writes (service/observability/metrics.py SupervisorMetrics): what the value class
# decides.
SUPERVISOR_SERIES = (
    "indexer_ready, indexer_worker_up, indexer_worker_ready, indexer_worker_restarts_total, and the supervisor's "
    "share of indexer_open_fds and of the health port's refusals"
)

# What each feature relies on. multiprocess_value_class: the values module's names (get_value_class called with no
# arguments), the environment variable get_value_class reads, and the metric classes that read values.ValueClass
# each time they make a value (so a new pick takes effect for every metric made after it).
VALUE_NAMES = ("ValueClass", "get_value_class", "MultiProcessValue")
VALUE_CLASS_READERS = ("Counter", "Gauge", "Histogram")
# retire_process: MmapedDict's methods, with their parameters (self aside), in the order they are called with.
MMAPED_DICT_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("filename",),
    "read_all_values_from_file": ("filename",),
    "read_value": ("key",),
    "write_value": ("key", "value", "timestamp"),
    "close": (),
}
RELIED_ON: dict[str, tuple[str, ...]] = {
    "multiprocess_value_class": (
        *(f"{VALUES_MODULE}.{name}" for name in VALUE_NAMES),
        f"{VALUES_MODULE}.get_value_class reads {ENVIRONMENT}",
        *(f"prometheus_client.metrics.{name} reads values.ValueClass" for name in VALUE_CLASS_READERS),
    ),
    "retire_process": (
        f"{MMAP_DICT_MODULE}.MmapedDict",
        *(f"MmapedDict.{name}({', '.join(parameters)})" for name, parameters in MMAPED_DICT_METHODS.items()),
        "MmapedDict round trip",
    ),
}
PUBLIC_PATHS = {
    "multiprocess_value_class": (
        "the multiprocess directory is named before prometheus_client is imported, as serve does; a supervisor run in "
        f"a process that imported prometheus_client first keeps its own series ({SUPERVISOR_SERIES}) out of /metrics"
    ),
    "retire_process": (
        "a dead worker's files are left to prometheus_client's multiprocess.mark_process_dead: its counts stay in "
        "/metrics, and the multiprocess directory (and each scrape's cost) grows by one set of files per worker "
        "restart until the replica restarts"
    ),
}


def _installed() -> tuple[ModuleType | None, ModuleType | None, ModuleType | None]:
    """prometheus_client's values, metrics and mmap_dict modules (None where one cannot be imported)."""
    found = []
    for name in (VALUES_MODULE, "prometheus_client.metrics", MMAP_DICT_MODULE):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            found.append(None)
    return found[0], found[1], found[2]


def _bindable(function: object, parameters: tuple[str, ...], skip_self: bool) -> bool:
    """Whether ``function`` takes exactly ``parameters`` (``self`` aside where ``skip_self``), by these names, in this
    order; more parameters with defaults are allowed (it is still called as relied on)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return False
    found = list(signature.parameters.values())[1 if skip_self else 0 :]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p for p in found if p.default is inspect.Parameter.empty and p.kind not in variadic]
    names = tuple(p.name for p in found[: len(parameters)])
    return names == parameters and len(required) <= len(parameters)


def _names(function: object) -> set[str]:
    code = getattr(function, "__code__", None)
    return set(code.co_names) if code is not None else set()


def _constants(function: object) -> set[object]:
    code = getattr(function, "__code__", None)
    return {c for c in code.co_consts if isinstance(c, str)} if code is not None else set()


def _reads_value_class(cls: object) -> bool:
    """Whether one of ``cls``'s own functions reads ``values.ValueClass`` (when it makes a value)."""
    return any("ValueClass" in _names(member) for member in vars(cls).values() if callable(member))


def probe(
    values: ModuleType | None = None, metrics: ModuleType | None = None, mmap_dict: ModuleType | None = None
) -> dict[str, list[str]]:
    """For each feature, what of :data:`RELIED_ON` the given modules lack or do otherwise (empty: the feature can
    be on). ``values``, ``metrics``, ``mmap_dict``: prometheus_client's modules (the installed ones by default; tests
    give stand-ins). Importing the installed ones picks the value class: call this only once the process's
    multiprocess directory, if any, is named."""
    if values is None and metrics is None and mmap_dict is None:
        values, metrics, mmap_dict = _installed()
    return {
        "multiprocess_value_class": _probe_value_class(values, metrics),
        "retire_process": _probe_mmaped_dict(mmap_dict),
    }


def _probe_value_class(values: ModuleType | None, metrics: ModuleType | None) -> list[str]:
    if values is None:
        return [VALUES_MODULE]
    missing = [f"{VALUES_MODULE}.{name}" for name in VALUE_NAMES if not hasattr(values, name)]
    pick = getattr(values, "get_value_class", None)
    if pick is not None and not _bindable(pick, (), skip_self=False):
        missing.append(f"{VALUES_MODULE}.get_value_class()")
    if pick is not None and ENVIRONMENT not in _constants(pick):
        missing.append(f"{VALUES_MODULE}.get_value_class reads {ENVIRONMENT}")
    for name in VALUE_CLASS_READERS:
        cls = getattr(metrics, name, None)
        if cls is None or not _reads_value_class(cls):
            missing.append(f"prometheus_client.metrics.{name} reads values.ValueClass")
    return missing


def _probe_mmaped_dict(mmap_dict: ModuleType | None) -> list[str]:
    cls = getattr(mmap_dict, "MmapedDict", None) if mmap_dict is not None else None
    if not isinstance(cls, type):
        return [f"{MMAP_DICT_MODULE}.MmapedDict"]
    missing = []
    for name, parameters in MMAPED_DICT_METHODS.items():
        method = inspect.getattr_static(cls, name, None)
        is_static = isinstance(method, staticmethod)
        if method is None or not _bindable(getattr(cls, name), parameters, skip_self=not is_static):
            missing.append(f"MmapedDict.{name}({', '.join(parameters)})")
    if not missing:
        error = _round_trip(cls)
        if error is not None:
            missing.append(f"MmapedDict round trip ({error})")
    return missing


def _round_trip(cls: type) -> str | None:
    """Write a value and add to it as :func:`fold_into_retired` does, in a file of a directory of its own; None when
    every read gives back what was written, else what went wrong."""
    with tempfile.TemporaryDirectory(prefix="indexer-probe-") as folder:
        path = os.path.join(folder, "counter_1.db")
        try:
            written = cls(path)
            try:
                written.write_value("key", 2.0, 0.0)
                written.write_value("key", written.read_value("key")[0] + 3.0, 0.0)
            finally:
                written.close()
            found = [(entry[0], entry[1]) for entry in cls.read_all_values_from_file(path)]
        except Exception as error:  # any failure means the feature cannot rely on it
            return f"{type(error).__name__}: {error}"
    return None if found == [("key", 5.0)] else f"read back {found!r}"


@dataclass(frozen=True)
class PrometheusFeatures:
    """Which prometheus_client features are on in this process (the others are on their public path)."""

    multiprocess_value_class: bool
    retire_process: bool


def choose(missing: dict[str, list[str]]) -> PrometheusFeatures:
    """The features ``missing`` (:func:`probe`'s answer) allows; each one it does not is taken as a fallback."""
    for feature, names in missing.items():
        if names:
            adapters.take(adapters.Fallback(LIBRARY, feature, tuple(names), PUBLIC_PATHS[feature]))
    return PrometheusFeatures(**{feature: not names for feature, names in missing.items()})


@functools.cache
def features() -> PrometheusFeatures:
    """This process's prometheus_client features, probed once (see :func:`probe` on when)."""
    return choose(probe())


# -- multiprocess_value_class -----------------------------------------------------------------------------------


def name_multiprocess_dir(path: Path) -> bool:
    """Make ``path`` this process's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``, which processes started from
    here inherit); returns whether the metrics this process makes from now on keep their values there. Named before
    prometheus_client is imported, they do: prometheus_client picks the multiprocess value class itself. Named after,
    only through the second pick (``multiprocess_value_class``)."""
    os.environ[ENVIRONMENT] = str(path)
    if VALUES_MODULE not in sys.modules:
        return True
    if not features().multiprocess_value_class:
        return False
    values = sys.modules[VALUES_MODULE]
    values.ValueClass = values.get_value_class()
    return True


# -- retire_process ---------------------------------------------------------------------------------------------


def fold_into_retired(pid: int, path: str, kinds: Iterable[str]) -> None:
    """Add dead process ``pid``'s values of each metric type in ``kinds`` (its ``<kind>_<pid>.db`` in multiprocess
    directory ``path``) into ``<kind>_retired.db``, which prometheus_client's collector reads as any other file, and
    remove its file. The caller holds the directory so that no scrape reads it meanwhile, and calls this only where
    ``retire_process`` is on."""
    from prometheus_client.mmap_dict import MmapedDict

    for kind in kinds:
        dead = os.path.join(path, f"{kind}_{pid}.db")
        if not os.path.exists(dead):
            continue
        retired = MmapedDict(os.path.join(path, f"{kind}_retired.db"))
        try:
            for key, value, *_ in MmapedDict.read_all_values_from_file(dead):
                retired.write_value(key, retired.read_value(key)[0] + value, 0.0)
        finally:
            retired.close()
        os.remove(dead)
