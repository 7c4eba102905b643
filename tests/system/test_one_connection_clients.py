"""The deployed shape reaches every CPU with the client settings docs/clients.md gives ("Load balancing"): pods
of one worker, and a grpcio channel with one connection per address and round_robin (Go's equivalent is in
tests/system/test_loadgen.py). The counter-case, a replica of several workers where one connection reaches one
worker, is measured by benchmarks/bench_shapes.py."""

from __future__ import annotations

import grpc

from testkit.harness import FAST_START, ServiceProcess, metric_total, scrape, wait_for
from testkit.payloads import BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK

SERVED = "indexer_request_duration_seconds_count"
CALLS = 40


def served(server: ServiceProcess) -> float:
    return metric_total(scrape(server.http_url), SERVED, method="BuildChunk")


def test_grpcio_round_robin_with_one_connection_per_address_reaches_every_pod() -> None:
    with ServiceProcess(*FAST_START) as first, ServiceProcess(*FAST_START) as second:
        servers = (first, second)
        target = "ipv4:" + ",".join(s.address for s in servers)
        # The docs' option, verbatim but for the target (a static list here; a headless Service's DNS name there).
        with grpc.insecure_channel(target, options=[("grpc.lb_policy_name", "round_robin")]) as channel:
            call = channel.unary_unary(BUILD_CHUNK_PATH, request_serializer=None, response_deserializer=None)
            request = SMALL_BUILD_CHUNK.SerializeToString()

            def both_connected() -> bool:  # round_robin skips an address until its connection is up
                call(request, timeout=5, wait_for_ready=True)
                return all(served(s) > 0 for s in servers)

            wait_for(both_connected, 10, "a call on each server")
            before = [served(s) for s in servers]
            for _ in range(CALLS):
                call(request, timeout=5)
            after = [served(s) for s in servers]
    shares = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(shares) == CALLS
    assert shares == [CALLS // 2, CALLS // 2], shares  # one call at a time: strictly in turn
