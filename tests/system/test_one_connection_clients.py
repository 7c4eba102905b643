"""The deployed shape reaches every CPU with the client settings docs/clients.md gives ("Load balancing"): pods
of one worker, and a grpcio channel with one connection per address and round_robin (Go's equivalent is in
tests/system/test_loadgen.py). The counter-case, a replica of several workers where one connection reaches one
worker, is measured by benchmarks/bench_shapes.py."""

from __future__ import annotations

import itertools

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
            counts = [[served(s) for s in servers]]
            for _ in range(CALLS):
                call(request, timeout=5)
                counts.append([served(s) for s in servers])
    # Each call served exactly once: the server whose counter it moved.
    steps = [[a - b for a, b in zip(now, then, strict=True)] for then, now in itertools.pairwise(counts)]
    assert all(sorted(step) == [0, 1] for step in steps), steps
    answered_by = [step.index(1) for step in steps]
    shares = [answered_by.count(k) for k in range(len(servers))]
    # The property: one call at a time, round_robin hands the calls to the two ready connections in turn. Its
    # picker starts at a random connection only when it is rebuilt, on a connection's state change (none is
    # expected: both were up before the first counted call; one is allowed), which repeats one server once. So no
    # server takes three calls in a row, and each takes half the calls, give or take the one a rebuild moves.
    runs = [len(list(run)) for _, run in itertools.groupby(answered_by)]
    assert max(runs) <= 2 and runs.count(2) <= 1, answered_by
    assert all(abs(share - CALLS / 2) <= 1 for share in shares), shares
