"""grpcio past its public API (service/adapters/grpcio.py): each name and signature a feature relies on, hidden in
turn, takes that feature (and only the features relying on it) onto its public path, announced once; a server on
each public path answers correctly; and a real ``serve`` on a grpcio whose internals differ starts, serves, and says
which fallback it took (log, start line, /metrics, GetWarmupStatus)."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import grpc
import pytest
from grpc import _server
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import adapters, codec
from indexer_service.service.adapters import grpcio
from indexer_service.service.config import load_config
from indexer_service.service.transport.grpc_server import HEALTH_NAMES, create_grpc_server
from indexer_service.service.transport.health import HealthServicer
from testkit.harness import ServiceProcess, clean_env, listen_flags, metric_total, scrape
from testkit.planes import make_plane
from tests.golden import GOLDEN, chunk_inputs, metadata_as_dict

GRPC_SERVER_SOURCE = inspect.getsource(_server)
_MODULES = itertools.count()
FEATURES = adapters.FEATURES["grpcio"]


@pytest.fixture(autouse=True)
def fresh_fallbacks(monkeypatch) -> None:
    """Each test starts with no fallback taken in this process."""
    monkeypatch.setattr(adapters, "_taken", {})


def grpc_server_copy(tmp_path: Path, *edits: tuple[str, str]) -> ModuleType:
    """grpc._server as a grpcio release with these edits would ship it: its source, edited, loaded as a new module
    (grpc._server itself is untouched)."""
    source = GRPC_SERVER_SOURCE
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    name = f"changed_grpc_server_{next(_MODULES)}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cygrpc_changed(**replaced: object) -> SimpleNamespace:
    """grpcio's Cython module with some names replaced (None: removed)."""
    names = {**vars(cygrpc), **replaced}
    return SimpleNamespace(**{k: v for k, v in names.items() if v is not None})


def test_the_installed_grpcio_has_every_feature() -> None:
    assert grpcio.probe() == {feature: [] for feature in FEATURES}
    assert grpcio.choose(grpcio.probe()) == grpcio.GrpcioFeatures(True, True, True)
    assert adapters.taken() == []


def test_the_unchanged_source_loaded_as_a_module_has_every_feature(tmp_path: Path) -> None:
    assert grpcio.probe(grpc_server_copy(tmp_path), cygrpc) == {feature: [] for feature in FEATURES}


SERVER_NAMES = sorted({name for names in grpcio._SERVER_NAMES.values() for name in names})


@pytest.mark.parametrize("name", SERVER_NAMES)
def test_each_hidden_name_takes_exactly_the_features_that_rely_on_it(tmp_path: Path, name: str) -> None:
    changed = grpc_server_copy(tmp_path)
    delattr(changed, name)
    missing = grpcio.probe(changed, cygrpc)
    relying = {feature for feature, names in grpcio._SERVER_NAMES.items() if name in names}
    assert {feature for feature, found in missing.items() if f"grpc._server.{name}" in found} == relying
    assert {feature for feature, found in missing.items() if found} >= relying


@pytest.mark.parametrize(
    ("old", "new", "feature", "named"),
    [
        (
            "    state: _RPCState,\n    call: cygrpc.Call,\n    request_deserializer",
            "    call: cygrpc.Call,\n    state: _RPCState,\n    request_deserializer",
            "receive_ahead",
            "grpc._server._receive_message(state, call, request_deserializer)",
        ),
        (
            "def _send_message(state: _RPCState, token: str)",
            "def _send_message(state: _RPCState, operation_token: str)",
            "send_without_waiting",
            "grpc._server._send_message(state, token)",
        ),
        (
            "experimental_non_blocking",
            "experimental_nonblocking",
            "send_without_waiting",
            "grpc._server reads experimental_non_blocking",
        ),
        (
            "    callbacks: Optional[List[NullaryCallbackType]]\n",
            "",
            "call_state",
            "grpc._server._RPCState.callbacks",
        ),
    ],
    ids=["receive-order", "send-parameter", "non-blocking-attribute", "state-field"],
)
def test_a_changed_signature_or_field_is_named(tmp_path: Path, old: str, new: str, feature: str, named: str) -> None:
    changed = grpc_server_copy(tmp_path, (old, new))
    if named.endswith("._RPCState.callbacks"):  # gone from the instances too, as a release that dropped it would
        init = changed._RPCState.__init__

        def without_callbacks(self: object) -> None:
            init(self)
            del self.callbacks

        changed._RPCState.__init__ = without_callbacks
    assert named in grpcio.probe(changed, cygrpc)[feature]


def test_a_missing_cython_attribute_is_named() -> None:
    class CallDetailsWithoutDeadline:
        method = b""

    missing = grpcio.probe(_server, cygrpc_changed(CallDetails=CallDetailsWithoutDeadline, SendMessageOperation=None))
    assert missing == {
        "call_state": ["cygrpc.CallDetails.deadline"],
        "receive_ahead": [],
        "send_without_waiting": ["cygrpc.SendMessageOperation"],
    }


def test_each_fallback_is_taken_and_announced_once(caplog) -> None:
    missing = {"call_state": [], "receive_ahead": ["grpc._server._receive_message"], "send_without_waiting": []}
    with caplog.at_level(logging.WARNING, logger=adapters.__name__):
        assert grpcio.choose(missing) == grpcio.GrpcioFeatures(True, False, True)
        assert grpcio.choose(missing) == grpcio.GrpcioFeatures(True, False, True)
    assert [r.getMessage() for r in caplog.records] == [
        "dependency_fallback grpcio receive_ahead: grpc._server._receive_message not as expected; "
        "a call waits for its request on a thread (grpcio's own request thunk)"
    ]
    assert adapters.summary() == "grpcio.receive_ahead"
    # the features reading the call state through it go with call_state
    off = {**missing, "call_state": ["grpc._server._Context"], "receive_ahead": []}
    assert grpcio.choose(off) == grpcio.GrpcioFeatures(False, False, False)


def answered(answer: pb.BuildChunkResponse) -> dict | None:
    """A BuildChunk answer as a golden case's ``expected`` (None: no chunk)."""
    return metadata_as_dict(codec.metadata_from_proto(answer.metadata)) if answer.HasField("metadata") else None


@pytest.fixture(params=FEATURES)
def public_path(request, monkeypatch) -> Iterator[str]:
    """This process's grpcio with one feature (and those relying on it) on its public path."""
    feature = request.param
    missing = {name: [f"hidden {name}"] if name == feature else [] for name in FEATURES}
    chosen = grpcio.choose(missing)
    monkeypatch.setattr(grpcio, "features", lambda: chosen)
    yield feature


def test_a_server_on_each_public_path_answers_as_on_the_fast_one(public_path: str) -> None:
    config = load_config({"grpc_host": "127.0.0.1", "grpc_port": "0", "warmup_target": "none"}, env={})
    plane = make_plane(config)
    plane.readiness.refresh()
    health = HealthServicer(HEALTH_NAMES)
    health.set_serving(True)
    server = create_grpc_server(config, plane, health)
    server.server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.PrefillMetadataStub(channel)
            for case in GOLDEN["chunk_metadata"][:4]:
                answer, call = stub.BuildChunk.with_call(
                    codec.chunk_inputs_to_proto(chunk_inputs(case)), timeout=10, metadata=(("x-request-id", "r1"),)
                )
                assert answered(answer) == case["expected"]
                assert ("x-request-id", "r1") in call.trailing_metadata()
            health_stub = health_pb2_grpc.HealthStub(channel)
            assert (
                health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
            watch = health_stub.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            health.set_serving(False)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            with pytest.raises(grpc.RpcError) as short:
                stub.BuildChunk(pb.BuildChunkRequest(), timeout=0.001)
            assert short.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        health.drain()
        server.stop(1.0)
        health.close()
    assert [f.feature for f in adapters.taken()] == [public_path]


# `serve` in a process whose grpcio differs where one feature looks: a function it relies on with other parameter
# names (grpcio itself still works), as a release that changed it would ship.
CHANGED = {
    "receive_ahead": (
        "_server._receive_message = (lambda original: lambda st, c, d: original(st, c, d))(_server._receive_message)\n"
    ),
    "send_without_waiting": (
        "_server._send_message = (lambda original: lambda st, t: original(st, t))(_server._send_message)\n"
    ),
}


def serve_script(feature: str) -> str:
    return (
        "import sys\n"
        "from grpc import _server\n"
        f"{CHANGED[feature]}"
        "from indexer_service.service.process.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )


@pytest.mark.parametrize("feature", sorted(CHANGED))
def test_serve_on_a_grpcio_whose_internals_differ_starts_serves_and_says_so(tmp_path: Path, feature: str) -> None:
    command = [sys.executable, "-c", serve_script(feature), "serve", *listen_flags()]
    env = clean_env(TRITON_CACHE_DIR=str(tmp_path / "triton"))
    with ServiceProcess("--backend", "numpy", "--warmup-target", "none", command=command, env=env) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.PrefillMetadataStub(channel)
            for case in GOLDEN["chunk_metadata"]:
                answer = stub.BuildChunk(codec.chunk_inputs_to_proto(chunk_inputs(case)), timeout=10)
                assert answered(answer) == case["expected"]
            status = stub.GetWarmupStatus(pb.GetWarmupStatusRequest(), timeout=10)
        assert [(f.library, f.feature) for f in status.dependency_fallbacks] == [("grpcio", feature)]
        samples = scrape(server.http_url)
        for name in FEATURES:
            value = metric_total(samples, "indexer_dependency_fallback", library="grpcio", feature=name)
            assert value == (name == feature), name
        assert server.terminate() == 0
        log = server.log()
    assert f"dependency_fallbacks=grpcio.{feature}" in log
    assert log.count(f"dependency_fallback grpcio {feature}:") == 1
