"""OpenTelemetry tracing (service/observability/tracing.py) against a real OTLP/HTTP receiver on 127.0.0.1: a server
process configured only by OTEL_* variables exports one server span per RPC, gRPC and HTTP, child of the caller's W3C
traceparent, named after the method, with the code and the request id; with tracing off the process imports
no OpenTelemetry module and exports nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from indexer_service.client import IndexerClient
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.service.codec import SERVICE_NAME, chunk_inputs_to_proto
from indexer_service.service.config import ConfigError
from indexer_service.service.observability.tracing import exporter_names
from testkit.harness import FAST_START, LOOPBACK, clean_env
from tests.service.conftest import StartServer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
GOOD_REQUEST = chunk_inputs_to_proto(ChunkInputs(np.array([0, 4, 10]), np.array([8, 20]), 4, 0, 2)).SerializeToString()


class OtlpReceiver:
    """An OTLP/HTTP trace receiver: decodes every ExportTraceServiceRequest POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.path == "/v1/traces":
                    receiver.requests.append(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.url = f"http://{LOOPBACK}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) of every span received."""
        found = []
        for request in list(self.requests):
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found.extend((resource, span) for span in scope_spans.spans)
        return found

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


def attributes(span) -> dict[str, object]:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_each_rpc_is_a_server_span_child_of_the_caller_s_trace(start_server: StartServer, receiver) -> None:
    env = clean_env(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_SERVICE_NAME="indexer-under-test",
        OTEL_BSP_SCHEDULE_DELAY="50",  # milliseconds: export at once
    )
    server = start_server(*FAST_START, env=env)
    assert "tracing exporters=otlp_proto_http" in server.log()
    metadata = (("traceparent", TRACEPARENT), ("x-request-id", "traced-grpc-1"))
    with grpc.insecure_channel(server.address) as channel:
        channel.unary_unary(f"/{SERVICE_NAME}/BuildChunk")(GOOD_REQUEST, metadata=metadata, timeout=10)
        with pytest.raises(grpc.RpcError):
            channel.unary_unary(f"/{SERVICE_NAME}/PlanBatch")(b"\xff", metadata=metadata, timeout=10)
    http = urllib.request.Request(
        f"{server.http_rpc_url}/{SERVICE_NAME}/GetWarmupStatus",
        data=b"",
        headers={"content-type": "application/x-protobuf", "traceparent": TRACEPARENT, "x-request-id": "traced-http"},
    )
    with urllib.request.urlopen(http, timeout=10) as answer:
        assert answer.status == 200

    deadline = time.monotonic() + 30
    while len(receiver.spans()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    spans = {span.name: (resource, span) for resource, span in receiver.spans()}
    assert set(spans) == {f"{SERVICE_NAME}/{m}" for m in ("BuildChunk", "PlanBatch", "GetWarmupStatus")}, spans
    for resource, span in spans.values():
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
        assert span.kind == span.SPAN_KIND_SERVER
        assert resource["service.name"] == "indexer-under-test" and resource["service.version"]
    build = attributes(spans[f"{SERVICE_NAME}/BuildChunk"][1])
    assert build["rpc.method"] == "BuildChunk" and build["indexer.transport"] == "grpc"
    assert build["indexer.request_id"] == "traced-grpc-1" and build["indexer.code"] == "OK"
    plan_span = spans[f"{SERVICE_NAME}/PlanBatch"][1]
    plan = attributes(plan_span)
    assert plan["indexer.code"] == "INVALID_ARGUMENT" and plan["rpc.grpc.status_code"] == 3
    assert plan_span.status.code == plan_span.status.STATUS_CODE_ERROR
    status = attributes(spans[f"{SERVICE_NAME}/GetWarmupStatus"][1])
    assert status["indexer.transport"] == "http" and status["indexer.request_id"] == "traced-http"


def test_the_python_client_s_traceparent_and_request_id_reach_the_span(start_server: StartServer, receiver) -> None:
    """IndexerClient's metadata: the client's traceparent (every call of a scheduler's job in one trace) and the
    call's request id; the server's span is the traceparent's child and carries the request id."""
    env = clean_env(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    server = start_server(*FAST_START, env=env)
    inputs = ChunkInputs(np.array([0, 4, 10]), np.array([8, 20]), 4, 0, 2)
    with IndexerClient(server.address, metadata=(("traceparent", TRACEPARENT),)) as client:
        assert client.build_chunk(inputs, metadata=(("x-request-id", "client-traced-1"),)) is not None
    deadline = time.monotonic() + 30
    while not receiver.spans() and time.monotonic() < deadline:
        time.sleep(0.05)
    [(_, span)] = receiver.spans()
    assert span.name == f"{SERVICE_NAME}/BuildChunk"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    assert attributes(span)["indexer.request_id"] == "client-traced-1"


def test_without_tracing_nothing_is_imported_or_exported(receiver) -> None:
    """A real server in a subprocess, with an endpoint but no exporter named, and with the SDK disabled: after a
    call, no opentelemetry module is loaded and the receiver has heard nothing."""
    program = """
import json, sys, grpc
from indexer_service.service.config import load_config
from indexer_service.service.process.server import IndexerServer
config = load_config({"grpc_port": 0, "http_port": 0, "http_rpc_port": 0, "health_port": 0, "backend": "numpy",
                      "warmup_target": "none", "workers": 1})
server = IndexerServer(config)
server.start()
with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
    channel.unary_unary("/indexer.v1.PrefillMetadata/GetWarmupStatus")(b"", timeout=10)
server.shutdown()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))))
"""
    for extra in ({}, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}):
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf", **extra)
        done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1]) == [], extra
    assert receiver.requests == []


def test_the_exporters_come_from_the_standard_variables() -> None:
    assert exporter_names({}) == []
    assert exporter_names({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporter_names({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}) == []
    assert exporter_names({"OTEL_TRACES_EXPORTER": "otlp"}) == ["otlp_proto_grpc"]
    http = {"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert exporter_names(http) == ["otlp_proto_http", "console"]
    per_signal = {**http, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    assert exporter_names(per_signal) == ["otlp_proto_grpc", "console"]
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        exporter_names({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


@pytest.mark.parametrize(
    ("workers", "env"),
    [
        ("1", {"OTEL_TRACES_EXPORTER": "zipkin_json"}),
        # With workers the supervisor checks first: before, the first worker failed and the replica exited 1.
        ("2", {"OTEL_TRACES_EXPORTER": "zipkin_json"}),
        ("2", {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}),
    ],
)
def test_an_exporter_that_is_not_installed_stops_the_start(workers: str, env: dict[str, str]) -> None:
    serve = [sys.executable, "-m", "indexer_service.service.process.cli", "serve", *FAST_START]
    ports = [f"--{name}-port=0" for name in ("grpc", "http", "http-rpc", "health")]
    done = subprocess.run(
        [*serve, *ports, f"--workers={workers}"],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    setting, value = next(reversed(env.items()))
    assert done.returncode == 2 and setting in done.stderr and value in done.stderr, done.stderr
