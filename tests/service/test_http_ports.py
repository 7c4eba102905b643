"""The two HTTP ports: ``http_port`` serves metrics and probes only, plaintext; ``http_rpc_port`` serves the RPCs
with the gRPC port's TLS, so an unauthenticated HTTP call is refused whenever the gRPC port would refuse it.

Real servers on 127.0.0.1 (one process and two workers), real TLS with trustme certificates (conftest.py's
``pki``), real HTTP and HTTPS clients (http.client over ssl)."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess

import pytest

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import codec
from indexer_service.service.codec import SERVICE_NAME
from testkit.harness import INDEXER_SERVICE, LOOPBACK, channel, clean_env, http_get, listen_flags, metric_total, scrape
from testkit.payloads import BUILD_CHUNK_PATH as BUILD_CHUNK
from testkit.payloads import SMALL_BUILD_CHUNK

REQUEST = SMALL_BUILD_CHUNK.SerializeToString()
FAST = ("--backend", "numpy", "--warmup-target", "none")


def tls_flags(pki: dict[str, str], mode: str) -> tuple[str, ...]:
    """``serve``'s flags for TLS ``mode``: off, tls, or mutual (client certificates chained to pki's CA)."""
    if mode == "off":
        return ()
    flags = ("--tls-cert-file", pki["server_cert"], "--tls-key-file", pki["server_key"])
    return (*flags, "--tls-client-ca-file", pki["ca"]) if mode == "mutual" else flags


def client_context(pki: dict[str, str], cert: str | None = None) -> ssl.SSLContext:
    """A client trusting pki's CA, presenting ``cert`` ("client" or "foreign_client") when given."""
    context = ssl.create_default_context(cafile=pki["ca"])
    if cert is not None:
        context.load_cert_chain(pki[f"{cert}_cert"], pki[f"{cert}_key"])
    return context


def post(port: int, path: str = BUILD_CHUNK, body: bytes = REQUEST, context: ssl.SSLContext | None = None) -> object:
    """(status, body) of one POST, over HTTPS when ``context`` is given; or the name of the exception that ended
    it (the TLS handshake refused, the connection dropped): a refusal has no HTTP status."""
    if context is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    try:
        connection.request("POST", path, body=body, headers={"content-type": "application/x-protobuf"})
        reply = connection.getresponse()
        return reply.status, reply.read()
    except (OSError, http.client.HTTPException) as exc:  # ssl.SSLError is an OSError
        return type(exc).__name__
    finally:
        connection.close()


def served_calls(server) -> float:
    """BuildChunk calls that reached the data plane, whatever their outcome."""
    return metric_total(scrape(server.http_url), "indexer_request_duration_seconds_count", method="BuildChunk")


def assert_answered(outcome: object) -> None:
    assert isinstance(outcome, tuple), f"refused: {outcome}"
    status, body = outcome
    assert status == 200, body
    assert pb.BuildChunkResponse.FromString(body).metadata.total_seq_lens == 3


def assert_refused(outcome: object) -> None:
    """No HTTP answer at all: the connection failed in or before the TLS handshake."""
    assert not isinstance(outcome, tuple), f"answered over HTTP: {outcome!r}"


@pytest.mark.parametrize("mode", ["off", "tls", "mutual"])
def test_an_unauthenticated_http_call_is_refused_whenever_grpc_would_refuse_it(start_server, pki, mode) -> None:
    server = start_server(*FAST, *tls_flags(pki, mode))
    port = server.http_rpc_port
    plain = post(port)
    anonymous = post(port, context=client_context(pki)) if mode != "off" else None
    if mode == "off":  # gRPC takes plaintext callers: so does HTTP
        assert_answered(plain)
    elif mode == "tls":  # gRPC takes any TLS caller: HTTPS is required, no client certificate
        assert_refused(plain)
        assert_answered(anonymous)
    else:  # gRPC takes only callers with a certificate of its client CA
        assert_refused(plain)
        assert_refused(anonymous)
        assert_refused(post(port, context=client_context(pki, "foreign_client")))
        assert served_calls(server) == 0, "a refused caller's call reached the data plane"
        assert_answered(post(port, context=client_context(pki, "client")))
    # Metrics and probes stay plaintext, and answer no RPC in any mode.
    assert http_get(f"{server.http_url}/readyz") == (200, "ready\n")
    status, body = post(server.http_port)
    assert status == 404 and json.loads(body)["code"] == "NOT_FOUND"
    assert f"http_rpc_port ({port})" in json.loads(body)["message"]


def test_the_metrics_port_answers_no_rpc_and_counts_what_it_refused(start_server) -> None:
    server = start_server(*FAST)
    for method in ("BuildChunk", "PlanBatch", "GetWarmupStatus"):
        status, body = post(server.http_port, f"/{SERVICE_NAME}/{method}")
        assert status == 404, body
    assert served_calls(server) == 0
    samples = scrape(server.http_url)
    assert metric_total(samples, "indexer_http_refused_total", reason="rpc_on_metrics_port") == 3
    # Logged once for the three (rate-limited), naming what came from where.
    logged = [line for line in server.log().splitlines() if "http refused reason=rpc_on_metrics_port" in line]
    assert len(logged) == 1 and f"POST /{SERVICE_NAME}/BuildChunk from http:127.0.0.1:" in logged[0], logged
    assert_answered(post(server.http_rpc_port))
    # ... and the RPC port serves no metrics or probes.
    status, body = http_get(f"{server.http_rpc_url}/metrics")
    assert status == 404 and f"http_port ({server.http_port})" in json.loads(body)["message"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_http_rpcs_false_leaves_the_port_unbound(start_server) -> None:
    port = free_port()
    server = start_server(*FAST, "--http-rpc-port", str(port), "--no-http-rpcs")
    assert server.ports["http_rpc_port"] is None
    assert "http_rpc=off" in server.log()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with socket.socket() as nobody_holds_it:
        nobody_holds_it.bind(("127.0.0.1", port))
    status, body = post(server.http_port)
    assert status == 404 and "http_rpcs = false" in json.loads(body)["message"]
    # gRPC still serves.
    with channel(server.address) as chan:
        answer = chan.unary_unary(BUILD_CHUNK)(REQUEST, timeout=10)
    assert pb.BuildChunkResponse.FromString(answer).metadata.total_seq_lens == 3


def test_workers_share_the_https_rpc_port_under_mutual_tls(start_server, pki) -> None:
    """Two workers accept on the supervisor's one HTTPS socket: each new connection may land on either, and every
    one is held to the client CA."""
    server = start_server(*FAST, "--workers", "2", *tls_flags(pki, "mutual"))
    assert server.ports["workers"] == 2 and server.http_rpc_port
    port = server.http_rpc_port
    for _ in range(4):  # fresh connections, spread over the workers by the kernel
        assert_refused(post(port))
        assert_refused(post(port, context=client_context(pki)))
        assert_refused(post(port, context=client_context(pki, "foreign_client")))
    assert served_calls(server) == 0
    for _ in range(4):
        assert_answered(post(port, context=client_context(pki, "client")))
    assert served_calls(server) == 4
    assert http_get(f"{server.http_url}/readyz") == (200, "ready\n")


def test_the_start_log_and_port_file_name_the_rpc_port(start_server) -> None:
    server = start_server(*FAST)
    assert server.ports["http_rpc_port"] == server.http_rpc_port > 0
    assert server.http_rpc_port not in (server.http_port, server.grpc_port, server.health_port)
    assert f"http_rpc=127.0.0.1:{server.http_rpc_port}" in server.log()
    empty = pb.BuildChunkRequest(query_start_loc=codec.encode_int32([0])).SerializeToString()
    assert post(server.http_rpc_port, body=empty) == (200, b"")


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "two-workers"])
def test_an_rpc_port_in_use_stops_the_start_naming_it(workers: str) -> None:
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = [INDEXER_SERVICE, "serve", *FAST, *listen_flags(), "--http-rpc-port", str(port), "--workers", workers]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=clean_env())
    assert out.returncode == 1, out.stderr
    assert f"cannot bind HTTP RPCs to {LOOPBACK}:{port}" in out.stderr and "Traceback" not in out.stderr, out.stderr
