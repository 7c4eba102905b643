"""Helpers of the hardening and fuzz tests: what the server's own metrics say during and after a test."""

from __future__ import annotations

import time

import numpy as np
import pytest

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from testkit.harness import ServiceProcess, metric_total, scrape

SMALL = pb.BuildChunkRequest(
    query_start_loc=np.array([0, 1, 4, 9], "<i4").tobytes(),
    seq_lens=np.array([20, 10, 5], "<i4").tobytes(),
    compress_ratio=4,
    req_start=1,
    req_end=3,
)
# A plan of SLOW_CHUNKS one-row chunks (a logits budget of one element): about 0.35 s of server work on this
# machine that no shortcut skips, since each chunk is answered; long enough for calls to overlap.
SLOW_CHUNKS = 4096
# A server that is to take SLOW at all allows plans of its size (the default max_plan_chunks is 1,024).
SLOW_FLAGS = ("--max-plan-chunks", str(SLOW_CHUNKS))
SLOW = pb.PlanBatchRequest(
    query_start_loc=np.array([0, SLOW_CHUNKS], "<i4").tobytes(),
    seq_lens=np.array([100_000], "<i4").tobytes(),
    compress_ratio=1,
    max_logits_bytes=4,
    omit_token_to_seq=True,
)
IN_FLIGHT = "indexer_requests_in_flight"
ERRORS = "indexer_request_errors_total"


def in_flight(server: ServiceProcess) -> float:
    return metric_total(scrape(server.http_url), IN_FLIGHT)


def wait_idle(server: ServiceProcess, timeout: float) -> float:
    """Seconds until the server's in-flight gauge reads 0; fails the test after ``timeout``."""
    start = time.monotonic()
    while (busy := in_flight(server)) != 0:
        if time.monotonic() - start > timeout:
            pytest.fail(f"{busy:.0f} calls still in flight after {timeout} s:\n{server.log()[-3000:]}")
        time.sleep(0.05)
    return time.monotonic() - start


def assert_healthy_after(server: ServiceProcess) -> None:
    """The process runs, nothing is in flight, and its metrics count no INTERNAL or UNKNOWN answer."""
    assert server.process is not None and server.process.poll() is None, f"server died:\n{server.log()[-3000:]}"
    samples = scrape(server.http_url)
    faults = {code: metric_total(samples, ERRORS, code=code) for code in ("INTERNAL", "UNKNOWN")}
    assert not any(faults.values()), f"server counted {faults}:\n{server.log()[-3000:]}"
    assert metric_total(samples, IN_FLIGHT) == 0
