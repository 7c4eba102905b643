"""prometheus_client past its public API (service/adapters/prometheus.py): each name, signature and behaviour a feature
relies on, hidden in turn in stand-ins of prometheus_client's modules, takes exactly that feature onto its public
path, announced once; the multiprocess directory named before prometheus_client is imported needs no second pick of
the value class, and named after it without one leaves the process's metrics in memory; a dead process's files are
folded into the retired ones, or on the public path left with their counts; and a real replica of 2 workers on each
public path (a prometheus_client whose internals differ in every process) counts every call across a worker's
restart, shows the supervisor's series, and says which fallback it took."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import metrics as prometheus_metrics
from prometheus_client import mmap_dict, values
from prometheus_client.multiprocess import MultiProcessCollector

from indexer_service.client import IndexerClient
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import adapters
from indexer_service.service.adapters import prometheus
from indexer_service.service.observability.metrics import retire_process
from testkit.harness import clean_env, wait_for
from tests.service.conftest import StartServer, scrape
from tests.service.test_worker_faults import runtime_of, wait_worker_ready, worker_pid

FEATURES = adapters.FEATURES["prometheus_client"]
INPUTS = ChunkInputs(np.array([0, 4, 10]), np.array([8, 20]), 4, 0, 2)


@pytest.fixture(autouse=True)
def fresh_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no fallback taken in this process."""
    monkeypatch.setattr(adapters, "_taken", {})


def test_the_features_are_the_registrys() -> None:
    assert tuple(prometheus.RELIED_ON) == tuple(prometheus.PUBLIC_PATHS) == FEATURES


def test_the_installed_prometheus_client_has_every_feature() -> None:
    assert prometheus.probe() == {feature: [] for feature in FEATURES}
    assert prometheus.choose(prometheus.probe()) == prometheus.PrometheusFeatures(True, True)
    assert adapters.taken() == []


def copy(module: ModuleType, **replaced: object) -> SimpleNamespace:
    """``module``'s names with some replaced (None: removed)."""
    names = {**vars(module), **replaced}
    return SimpleNamespace(**{name: value for name, value in names.items() if value is not None})


def function(parameters: tuple[str, ...], body: str = "pass") -> Any:
    """A function taking ``parameters``, doing ``body``."""
    scope: dict[str, Any] = {}
    exec(f"def f({', '.join(parameters)}):\n    {body}\n", scope)
    return scope["f"]


def hidden(name: str) -> tuple[Any, Any, Any]:
    """prometheus_client's values, metrics and mmap_dict modules as a release without ``name`` (one of RELIED_ON)
    would ship them."""
    the_values, the_metrics, the_mmap_dict = values, prometheus_metrics, mmap_dict
    if name.startswith(f"{prometheus.VALUES_MODULE}.get_value_class reads"):
        the_values = copy(values, get_value_class=lambda: values.MutexValue)
    elif name.startswith(prometheus.VALUES_MODULE + "."):
        the_values = copy(values, **{name.rpartition(".")[2]: None})
    elif name.startswith("prometheus_client.metrics."):
        cls = name.split(".")[2].split()[0]
        the_metrics = copy(prometheus_metrics, **{cls: type(cls, (), {"_metric_init": lambda self: None})})
    elif name == f"{prometheus.MMAP_DICT_MODULE}.MmapedDict":
        the_mmap_dict = copy(mmap_dict, MmapedDict=None)
    elif name == "MmapedDict round trip":  # as it should be called, but what is written does not stay
        write = function(("self", "key", "value", "timestamp"))
        the_mmap_dict = copy(mmap_dict, MmapedDict=type("MmapedDict", (mmap_dict.MmapedDict,), {"write_value": write}))
    else:  # MmapedDict.<method>(<parameters>): a release whose method takes other ones
        method, parameters = name.removeprefix("MmapedDict.").removesuffix(")").split("(")
        other = tuple(f"{p.strip()}_" for p in parameters.split(",") if p.strip()) or ("force",)
        replacement = function(other) if method == "read_all_values_from_file" else function(("self", *other))
        if method == "read_all_values_from_file":
            replacement = staticmethod(replacement)
        the_mmap_dict = copy(mmap_dict, MmapedDict=type("MmapedDict", (mmap_dict.MmapedDict,), {method: replacement}))
    return the_values, the_metrics, the_mmap_dict


RELIED_ON = [(feature, name) for feature, names in prometheus.RELIED_ON.items() for name in names]


@pytest.mark.parametrize(("feature", "name"), RELIED_ON, ids=[name for _, name in RELIED_ON])
def test_each_hidden_name_takes_exactly_its_feature(feature: str, name: str) -> None:
    missing = prometheus.probe(*hidden(name))
    assert {f for f, found in missing.items() if found} == {feature}, missing
    (found,) = missing[feature]
    assert found == name or found.startswith(f"{name} ("), found  # the round trip says what it read back
    chosen = prometheus.choose(missing)
    assert {f for f in FEATURES if not getattr(chosen, f)} == {feature}
    (taken,) = adapters.taken()
    assert (taken.library, taken.feature, taken.missing) == ("prometheus_client", feature, (found,))
    assert taken.public_path == prometheus.PUBLIC_PATHS[feature]
    assert adapters.summary() == f"prometheus_client.{feature}"


def test_a_parameter_with_a_default_is_no_difference() -> None:
    """More parameters with defaults: still called as relied on."""
    wider = type("MmapedDict", (mmap_dict.MmapedDict,), {"close": function(("self", "flush=True"))})
    assert prometheus.probe(values, prometheus_metrics, copy(mmap_dict, MmapedDict=wider))["retire_process"] == []


def test_each_fallback_is_taken_and_announced_once(caplog: pytest.LogCaptureFixture) -> None:
    missing = {"multiprocess_value_class": [], "retire_process": ["MmapedDict.close()"]}
    with caplog.at_level(logging.WARNING, logger=adapters.__name__):
        assert prometheus.choose(missing) == prometheus.PrometheusFeatures(True, False)
        assert prometheus.choose(missing) == prometheus.PrometheusFeatures(True, False)
    assert [r.getMessage() for r in caplog.records] == [
        f"dependency_fallback prometheus_client retire_process: MmapedDict.close() not as expected; "
        f"{prometheus.PUBLIC_PATHS['retire_process']}"
    ]


# A fresh interpreter names a multiprocess directory, before or after importing prometheus_client, with or without
# the second pick, then makes a counter: does its value land in the directory?
NAMING = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from indexer_service.service.adapters import prometheus
    if {imported_first}:
        import prometheus_client.values
        if {hidden}:
            del prometheus_client.values.get_value_class
    in_files = prometheus.name_multiprocess_dir(Path(sys.argv[1]))
    import prometheus_client
    prometheus_client.Counter("probe_total", "", registry=None).inc()
    print(in_files, sorted(os.listdir(sys.argv[1])) == ["counter_%d.db" % os.getpid()])
    """
)


@pytest.mark.parametrize(
    ("imported_first", "hidden", "expected"),
    [(False, False, "True True"), (True, False, "True True"), (True, True, "False False")],
    ids=["named-first", "imported-first-picked-again", "imported-first-fallback"],
)
def test_naming_the_directory_before_the_import_needs_no_second_pick(
    tmp_path: Path, imported_first: bool, hidden: bool, expected: str
) -> None:
    """Named before prometheus_client is imported (what the supervisor does), the values land in the directory with
    no second pick; named after, only with it, and without it the caller is told."""
    script = NAMING.format(imported_first=imported_first, hidden=hidden)
    env = {k: v for k, v in os.environ.items() if k != prometheus.ENVIRONMENT}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == expected


def write_file(path: Path, kind: str, pid: object, samples: dict[str, float]) -> None:
    """A multiprocess file as prometheus_client's multiprocess values write it: ``<kind>_<pid>.db``."""
    written = mmap_dict.MmapedDict(str(path / f"{kind}_{pid}.db"))
    try:
        for name, value in samples.items():
            key = mmap_dict.mmap_key(name.removesuffix("_total"), name, [], [], "help")
            written.write_value(key, value, 0.0)
    finally:
        written.close()


def counted(path: Path) -> dict[str, float]:
    """Every sample prometheus_client's public multiprocess collector reads from ``path``."""
    return {s.name: s.value for family in MultiProcessCollector(None, str(path)).collect() for s in family.samples}


@pytest.mark.parametrize("on", [True, False], ids=["retire_process", "public-path"])
def test_a_dead_process_keeps_its_counts_on_either_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on: bool
) -> None:
    """Process 111 died: its live gauge goes (mark_process_dead, both paths); its counter is folded into the retired
    file and its own removed, or, on the public path, left where it is; the total is the same either way."""
    monkeypatch.setattr(prometheus, "features", lambda: prometheus.PrometheusFeatures(True, on))
    write_file(tmp_path, "counter", 111, {"calls_total": 3.0})
    write_file(tmp_path, "counter", 222, {"calls_total": 4.0})
    write_file(tmp_path, "counter", "retired", {"calls_total": 10.0})
    write_file(tmp_path, "gauge_livesum", 111, {"open": 5.0})
    assert counted(tmp_path) == {"calls_total": 17.0, "open": 5.0}
    assert retire_process(111, str(tmp_path))
    assert counted(tmp_path) == {"calls_total": 17.0}
    left = {"counter_222.db", "counter_retired.db"} | (set() if on else {"counter_111.db"})
    assert {p.name for p in tmp_path.glob("*.db")} == left


# Every process of the replica imports a prometheus_client whose internals differ where one feature looks (as a
# release that changed it would ship), and which still works itself: a sitecustomize edits the module once imported.
EDITS = {
    "multiprocess_value_class": ("prometheus_client.values", "del module.get_value_class"),
    "retire_process": (
        "prometheus_client.mmap_dict",
        "read = module.MmapedDict.read_all_values_from_file\n"
        "module.MmapedDict.read_all_values_from_file = staticmethod(lambda path: read(path))",
    ),
}
SITECUSTOMIZE = '''
import sys

EDITS = {edits!r}


class EditOnImport:
    """Runs EDITS[name] on module ``name`` once its own code has run."""

    def find_spec(self, name, path, target=None):
        if name not in EDITS:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            exec(EDITS[name], {{"module": module}})

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, EditOnImport())
'''


@pytest.mark.parametrize("feature", FEATURES)
def test_a_replica_on_each_public_path_counts_across_a_restart_and_says_so(
    start_server: StartServer, tmp_path: Path, feature: str
) -> None:
    module, edit = EDITS[feature]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(edits={module: edit}))
    env = clean_env(PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    server = start_server(
        "--workers=2", "--backend=numpy", "--warmup-target=none", "--worker-restart-backoff-seconds=0.1", env=env
    )
    metrics_dir = runtime_of(server) / "metrics"
    with IndexerClient(server.address, connections=16) as client:
        for _ in range(20):
            assert client.build_chunk(INPUTS, timeout=10).cu_seq_lens.tolist() == [0, 2, 7]
        victim = worker_pid(server, 1)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: worker_pid(server, 1) != victim, 30, "the restart")
        wait_worker_ready(server, 1, worker_pid(server, 1))
        wait_for(lambda: not list(metrics_dir.glob(f"gauge_live*_{victim}.db")), 10, "the dead worker's gauges gone")
        for _ in range(20):
            assert client.build_chunk(INPUTS, timeout=10).cu_seq_lens.tolist() == [0, 2, 7]
    # Retired (its files folded and gone), or on the public path left with their counts.
    kept = sorted(p.name for p in metrics_dir.glob(f"*_{victim}.db"))
    assert bool(kept) == (feature == "retire_process"), kept
    metrics = scrape(server)
    count = sum(s.value for s in metrics.samples("indexer_request_duration_seconds_count", method="BuildChunk"))
    assert count == 40  # the dead worker's calls too
    # The supervisor's own series: its values are in the directory, named before it imported prometheus_client.
    assert metrics.value("indexer_worker_restarts_total", worker="1", reason="killed") == 1
    assert metrics.value("indexer_worker_up", worker="1") == 1 == metrics.value("indexer_ready")
    for name in FEATURES:
        labels = {"library": "prometheus_client", "feature": name}
        assert metrics.value("indexer_dependency_fallback", **labels) == (name == feature), name
    with grpc.insecure_channel(server.address) as channel:
        status = pb_grpc.PrefillMetadataStub(channel).GetWarmupStatus(pb.GetWarmupStatusRequest(), timeout=10)
    assert [(f.library, f.feature) for f in status.dependency_fallbacks] == [("prometheus_client", feature)]
    log = server.log()
    # Each process says it once, on its start line too: the supervisor, both workers, and the restarted one.
    assert log.count(f"dependency_fallback prometheus_client {feature}:") == 4, log
    assert log.count(f"dependency_fallbacks=prometheus_client.{feature}") == 4, log
