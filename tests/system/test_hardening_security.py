"""Limits and exposure of a real server process: message size on both transports, concurrency, the metrics
listener apart from the RPC one, and a request field that must not buy unbounded work.

Covered elsewhere, not repeated here: TLS and mutual TLS on the gRPC port with trustme certificates
(tests/service/test_tls.py); per-request limits on tokens, sequences, max_model_len, the KV workspace and
the response size, each RESOURCE_EXHAUSTED naming its field (tests/service/test_rpc.py).
"""

from __future__ import annotations

import http.client
import json
import socket

import grpc
import numpy as np
import pytest

from indexer_service.kernels.inputs import MAX_DCP_WORLD_SIZE
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from testkit.fuzzing import stubs_for
from testkit.harness import FAST_START, ServiceProcess, channel, http_get
from tests.system.hardening_support import SLOW, SLOW_CHUNKS, SLOW_FLAGS, SMALL, assert_healthy_after, wait_idle


def oversized(limit: int) -> pb.BuildChunkRequest:
    """A request whose query_start_loc alone is larger than ``limit`` bytes."""
    elements = limit // 4 + 1024
    return pb.BuildChunkRequest(
        query_start_loc=np.arange(elements, dtype="<i4").tobytes(),
        seq_lens=np.ones(elements - 1, dtype="<i4").tobytes(),
        req_end=1,
    )


def test_messages_over_max_message_bytes_are_resource_exhausted_on_both_transports() -> None:
    limit = 65_536
    with ServiceProcess(*FAST_START, "--max-message-bytes", str(limit)) as server:
        with channel(server.address) as chan:
            stubs = stubs_for(chan)
            with pytest.raises(grpc.RpcError) as refused:
                stubs["BuildChunk"](oversized(limit), timeout=10)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
            assert stubs["BuildChunk"](SMALL, timeout=10).metadata.total_seq_lens == 3

        connection = http.client.HTTPConnection("127.0.0.1", server.http_rpc_port, timeout=10)
        try:
            connection.request(
                "POST", "/indexer.v1.PrefillMetadata/BuildChunk", body=oversized(limit).SerializeToString()
            )
            reply = connection.getresponse()
            body = json.loads(reply.read())
        finally:
            connection.close()
        assert reply.status == 429, body
        assert body["code"] == "RESOURCE_EXHAUSTED" and body["message"].startswith("body: "), body
        assert_healthy_after(server)


def test_calls_over_max_concurrent_rpcs_are_resource_exhausted() -> None:
    limit, calls = 2, 8
    flags = ("--max-concurrent-rpcs", str(limit), "--grpc-workers", str(limit), *SLOW_FLAGS)
    with ServiceProcess(*FAST_START, *flags) as server:
        with channel(server.address) as chan:
            plan = stubs_for(chan)["PlanBatch"]
            futures = [plan.future(SLOW, timeout=60) for _ in range(calls)]
            codes = [grpc.StatusCode.OK if f.exception(timeout=60) is None else f.exception().code() for f in futures]
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            assert 1 <= codes.count(grpc.StatusCode.OK) <= calls - 1, codes
            wait_idle(server, timeout=30)
            # The limit counts calls being served, not calls ever made: once they end, new ones are taken.
            assert all(len(plan(SLOW, timeout=60).chunks) == SLOW_CHUNKS for _ in range(limit + 1))
        assert_healthy_after(server)


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def _http1_get(host: str, port: int, path: str) -> bytes:
    """Whatever a listener sends back to a plain HTTP/1.1 GET, until it closes or goes quiet."""
    received = []
    with socket.create_connection((host, port), timeout=3) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        try:
            while data := sock.recv(65536):
                received.append(data)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(received)


def test_metrics_listener_is_separable_from_the_rpc_listener() -> None:
    """Metrics and probes on their own address and port (here 127.0.0.2), gRPC on 127.0.0.1 only."""
    rpc_host, metrics_host = "127.0.0.1", "127.0.0.2"
    with ServiceProcess(*FAST_START, grpc_host=rpc_host, http_host=metrics_host) as server:
        status, body = http_get(f"http://{metrics_host}:{server.http_port}/metrics")
        assert status == 200 and "indexer_requests_in_flight" in body
        assert server.http_port != server.grpc_port
        assert _refused(rpc_host, server.http_port), "metrics reachable on the RPC address"
        assert _refused(metrics_host, server.grpc_port), "gRPC reachable on the metrics address"
        assert b"indexer_requests_in_flight" not in _http1_get(rpc_host, server.grpc_port, "/metrics")
        with channel(server.address) as chan:
            assert stubs_for(chan)["BuildChunk"](SMALL, timeout=10).metadata.total_seq_lens == 3


def test_dcp_world_size_cannot_buy_unbounded_work() -> None:
    """Found by the fuzz (fixed since): the kernel layer summed every rank's share one rank at a time, about
    18 us a rank, so dcp_world_size 2^31 - 1 held a server thread for 11 hours. It must be refused at once, and
    the largest allowed world answered within a deadline that a per-rank loop could not meet."""

    def request(world: int) -> pb.BuildChunkRequest:
        return pb.BuildChunkRequest(
            query_start_loc=np.array([0, 4], "<i4").tobytes(),
            seq_lens=np.array([100], "<i4").tobytes(),
            compress_ratio=1,
            req_start=0,
            req_end=1,
            dcp_rank=world - 1,
            dcp_world_size=world,
        )

    # Its own server: a regression keeps a worker thread busy until the process is killed.
    with ServiceProcess(*FAST_START) as server, channel(server.address) as chan:
        build = stubs_for(chan)["BuildChunk"]
        with pytest.raises(grpc.RpcError) as refused:
            build(request(2**31 - 1), timeout=3)
        code, details = refused.value.code(), refused.value.details() or ""
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (code, details)
        assert details.startswith("dcp_world_size"), details
        assert build(request(MAX_DCP_WORLD_SIZE), timeout=0.5).metadata.total_seq_lens == 100
        assert_healthy_after(server)


def test_memory_of_one_request_is_bounded_by_its_response() -> None:
    """Found by the fuzz oracle running out of memory: a PlanBatch of a few bytes whose chunks each reach a
    long sequence. The service must not need gigabytes to send back kilobytes."""
    rows, sequence = 64, 1_000_000
    request = pb.PlanBatchRequest(
        query_start_loc=np.array([0, rows], "<i4").tobytes(),
        seq_lens=np.array([sequence], "<i4").tobytes(),
        compress_ratio=1,
        max_logits_bytes=4,
        omit_token_to_seq=True,
    )
    budget = 64 * 2**20
    with ServiceProcess(*FAST_START) as server, channel(server.address) as chan:
        before = server.peak_rss_bytes()
        response = stubs_for(chan)["PlanBatch"](request, timeout=60)
        grown = server.peak_rss_bytes() - before
        assert len(response.chunks) == rows
        assert grown <= budget, f"peak RSS grew {grown / 2**20:.0f} MiB"
        assert_healthy_after(server)
