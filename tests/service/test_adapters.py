"""The adapters together (service/adapters/__init__.py): one registry of features; probe_all probes every adapter's
library (Triton only where asked) and announces each fallback once, which the metrics then show; a real ``serve``
on a Triton without parallel compile warms up ahead of time, serves, and says which fallback it took; and nothing in
the product outside service/adapters/ and kernels/triton_adapter.py names a private module or attribute of grpcio,
uvicorn, prometheus_client or Triton (the sources, read with ``ast``; the reader itself is checked on snippets for
what it must and must not find)."""

from __future__ import annotations

import ast
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from indexer_service.kernels import triton_adapter
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import adapters, codec
from indexer_service.service.adapters import grpcio, prometheus, uvicorn_http
from indexer_service.service.observability.metrics import Metrics
from testkit.harness import ServiceProcess, clean_env, listen_flags, metric_total
from testkit.harness import scrape as scrape_samples
from testkit.paths import REPO
from tests.golden import GOLDEN, chunk_inputs, metadata_as_dict

LIBRARIES = ("grpc", "uvicorn", "prometheus_client", "triton")
ALLOWED = (REPO / "service" / "adapters", REPO / "kernels" / "triton_adapter.py")
# Modules of those libraries that are not their public API, besides any whose path has a part starting with "_".
PRIVATE_MODULES = (
    "uvicorn.protocols",
    "prometheus_client.values",
    "prometheus_client.mmap_dict",
    "prometheus_client.utils",
)
# Names the adapters reach for on the libraries' objects, wherever those objects come from (a servicer's context, a
# protocol instance): named anywhere else, on anything but our own ``self``, they are a reach-in too.
REACHED_NAMES = frozenset(
    {
        *grpcio._CONTEXT_FIELDS,  # a servicer context's call event and state
        *(name for names in uvicorn_http.ATTRIBUTES.values() for name in names if name != "scope"),
        *(name for name in uvicorn_http.METHODS if name.startswith("on_")),
        "HttpToolsProtocol",
        "H11Protocol",
        "RequestResponseCycle",
        "pipeline",
        "timeout_keep_alive_task",
        "_unset_keepalive_if_required",
        *prometheus.VALUE_NAMES,
        "MmapedDict",
        "read_all_values_from_file",
        "floatToGoString",
        "AsyncCompileMode",
        "triton_key",
        "_active",
    }
)


def private_module(name: str) -> bool:
    root, *rest = name.split(".")
    return root in LIBRARIES and (
        any(part.startswith("_") for part in rest)
        or any(name == m or name.startswith(m + ".") for m in PRIVATE_MODULES)
    )


def private_name(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def chain_root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (``a`` of ``a.b().c``)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def reach_ins(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each place ``source`` names a private module or attribute of the libraries."""
    tree = ast.parse(source)
    bound: set[str] = set()  # names bound to a library's module or object by an import
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            bound.update(alias.asname or alias.name for alias in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, f"import {a.name}") for a in node.names if private_module(a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            if private_module(node.module):
                yield node.lineno, f"from {node.module} import"
            for alias in node.names:
                if (
                    private_name(alias.name)
                    or alias.name in REACHED_NAMES
                    or private_module(f"{node.module}.{alias.name}")
                ):
                    yield node.lineno, f"from {node.module} import {alias.name}"
        elif isinstance(node, ast.Attribute):
            root = chain_root(node.value)
            if root in ("self", "cls"):
                continue
            if (private_name(node.attr) and root in bound) or node.attr in REACHED_NAMES:
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Name) and node.id in REACHED_NAMES:
            yield node.lineno, node.id
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # importlib.import_module("..."), sys.modules["..."]; getattr(x, "...")
            module = re.fullmatch(r"[\w.]+", node.value) is not None and private_module(node.value)
            if module or (node.value in REACHED_NAMES and private_name(node.value)):
                yield node.lineno, repr(node.value)


def product_sources() -> Iterator[Path]:
    for folder in (REPO / "service", REPO / "kernels"):
        for path in sorted(folder.rglob("*.py")):
            if not any(path == allowed or allowed in path.parents for allowed in ALLOWED):
                yield path


def test_nothing_outside_the_adapters_reaches_into_the_libraries() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in product_sources()
        for line, what in reach_ins(path.read_text())
    ]
    assert not found, found


def test_the_scan_covers_the_adapters_own_files() -> None:
    """What the adapters hold is what the scan would find elsewhere: it does look in the right places."""
    for path in (REPO / "service" / "adapters" / "grpcio.py", REPO / "kernels" / "triton_adapter.py"):
        assert list(reach_ins(path.read_text())), path
    assert len(list(product_sources())) > 50


@pytest.mark.parametrize(
    "snippet",
    [
        "from grpc import _server",
        "from grpc._cython import cygrpc",
        "import grpc._server as s",
        "import uvicorn.protocols.http.httptools_impl",
        "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol",
        "from prometheus_client import values",
        "from prometheus_client.mmap_dict import MmapedDict",
        "from prometheus_client.utils import floatToGoString",
        "from triton.runtime._async_compile import AsyncCompileMode",
        "from triton.runtime.cache import triton_key",
        "from triton.runtime.driver import driver\nprevious = driver._active",
        "import triton\ntriton.runtime.driver.driver._active",
        "def f(context):\n    return context._rpc_event",
        "def f(context):\n    return context._state.condition",
        "def f(protocol):\n    return protocol.cycle.response_started",
        "import importlib\nimportlib.import_module('uvicorn.protocols.http.h11_impl')",
        "import sys\nsys.modules['prometheus_client.values'].ValueClass",
        "def f(context):\n    return getattr(context, '_rpc_event')",
    ],
)
def test_the_scan_finds_each_kind_of_reach_in(snippet: str) -> None:
    assert list(reach_ins(snippet)), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "class A:\n    def f(self):\n        return self._state, self._active, self.cycle",
        "def f(limits):\n    return limits._replace(a=1)",  # a namedtuple's public method
        "import os\nos._exit(0)",
        "def f(ticket):\n    return ticket._watched",  # our own object
        "import grpc\ngrpc.StatusCode.OK",
        "from prometheus_client.core import Metric\nfrom prometheus_client import multiprocess",
        "import triton.language as tl\ntl.constexpr(1)",
        '"""grpc._server and prometheus_client.values, named in prose."""',
    ],
)
def test_the_scan_leaves_public_api_and_our_own_privates_alone(snippet: str) -> None:
    assert not list(reach_ins(snippet)), snippet


# -- the registry and probe_all ---------------------------------------------------------------------------------


@pytest.fixture
def fresh_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters, "_taken", {})


def test_one_registry() -> None:
    """Each adapter's features are the registry's, and Triton's adapter names the same ones."""
    assert set(adapters.FEATURES) == {"grpcio", "uvicorn", "prometheus_client", "triton"}
    assert adapters.FEATURES["triton"] == triton_adapter.FEATURES
    assert tuple(prometheus.PUBLIC_PATHS) == adapters.FEATURES["prometheus_client"]
    assert tuple(grpcio._PUBLIC_PATHS) == adapters.FEATURES["grpcio"]
    assert adapters.FEATURES["uvicorn"] == (uvicorn_http.FEATURE,)


def test_probe_all_takes_tritons_fallbacks_only_where_asked_and_says_each_once(
    fresh_fallbacks, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Triton's adapter reports plain data; probe_all takes it (one WARNING, the summary, the gauge), where the
    process imports Triton, and leaves Triton alone elsewhere."""
    missing = {"async_compile": [triton_adapter.ASYNC_COMPILE_MODULE], "compiler_key": [], "compile_only_driver": []}
    monkeypatch.setattr(triton_adapter, "probed", lambda: missing)
    with caplog.at_level(logging.WARNING, logger=adapters.__name__):
        assert adapters.probe_all(triton=False) == []
        (taken,) = adapters.probe_all(triton=True)
        assert adapters.probe_all(triton=True) == [taken]
    assert (taken.library, taken.feature, taken.missing) == (
        "triton",
        "async_compile",
        ("triton.runtime._async_compile",),
    )
    assert taken.public_path == triton_adapter.PUBLIC_PATHS["async_compile"]
    assert [r.getMessage() for r in caplog.records] == [f"dependency_fallback {taken.describe()}"]
    assert adapters.summary() == "triton.async_compile"
    metrics = Metrics()
    for feature in adapters.FEATURES["triton"]:
        value = metrics.registry.get_sample_value(
            "indexer_dependency_fallback", {"library": "triton", "feature": feature}
        )
        assert value == (feature == "async_compile"), feature


# `serve` in a process whose Triton has no AsyncCompileMode where the JIT still works (its parallel compile gone, as
# Triton 3.4 ships it): the default configuration's ahead-of-time warmup, with two compile workers.
WITHOUT_ASYNC_COMPILE = (
    "import sys\n"
    "import triton.runtime._async_compile as mode\n"
    "del mode.AsyncCompileMode\n"
    "from indexer_service.service.process.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_serve_on_a_triton_without_parallel_compile_warms_up_serves_and_says_so(triton_cache_dir: Path) -> None:
    command = [sys.executable, "-c", WITHOUT_ASYNC_COMPILE, "serve", *listen_flags()]
    env = clean_env(TRITON_CACHE_DIR=str(triton_cache_dir))
    with ServiceProcess("--warmup-workers", "2", command=command, env=env) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.PrefillMetadataStub(channel)
            status = stub.GetWarmupStatus(pb.GetWarmupStatusRequest(), timeout=10)
            for case in GOLDEN["chunk_metadata"][:4]:
                answer = stub.BuildChunk(codec.chunk_inputs_to_proto(chunk_inputs(case)), timeout=10)
                assert metadata_as_dict(codec.metadata_from_proto(answer.metadata)) == case["expected"]
        assert status.ready and status.target == "cuda:90" and status.keys
        # Compiled, or loaded from the session's cache where an earlier server filled it.
        assert all(key.state in (pb.KEY_STATE_COMPILED, pb.KEY_STATE_CACHED) for key in status.keys), status.keys
        assert [(f.library, f.feature) for f in status.dependency_fallbacks] == [("triton", "async_compile")]
        samples = scrape_samples(server.http_url)
        for feature in adapters.FEATURES["triton"]:
            value = metric_total(samples, "indexer_dependency_fallback", library="triton", feature=feature)
            assert value == (feature == "async_compile"), feature
        log = server.log()
    assert "dependency_fallbacks=triton.async_compile" in log
    assert log.count("dependency_fallback triton async_compile: triton.runtime._async_compile.AsyncCompileMode") == 1
