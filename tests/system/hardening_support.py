"""Helpers of the hardening and fuzz tests: what the server's own metrics say during and after a test."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from testkit.harness import ServiceProcess, channel, metric_total, scrape
from testkit.payloads import BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK
from testkit.siege import control_run

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


@dataclass(frozen=True)
class Quiet:
    """What a siege's victim and probes see of a server nobody attacks, on this machine, now."""

    victim_ok_ratio: float
    probes_in_time: float


QUIET_SECONDS = 3.0  # ~100 victim calls and ~30 rounds of probes


def quiet_run(server: ServiceProcess, seconds: float = QUIET_SECONDS) -> Quiet:
    """The baseline of an attack test, taken in the same test against the same server just before the attack."""
    siege = control_run(server, seconds)
    return Quiet(siege.victim_ok_ratio(), siege.probes.overall().ratio)


def bar(required: float, quiet: float) -> float:
    """The ratio an attacked run must reach: ``required``, or, where the quiet run itself fell short of
    ``required`` (a shared machine loaded by others), the quiet run's ratio less the same slack (1 - required).
    Never stricter than ``required``; it moves only as far as the machine, measured without the attack, did."""
    return min(required, quiet - (1.0 - required))


def idle_rss(server: ServiceProcess) -> int:
    """RSS of a server that has answered a few small calls (what a first call sets up once is not what an attack
    leaves) and then been idle past its idle trim (``--idle-trim-seconds 1`` in these tests)."""
    with channel(server.address) as chan:
        call = chan.unary_unary(BUILD_CHUNK_PATH)
        for _ in range(20):
            call(SMALL_BUILD_CHUNK.SerializeToString(), timeout=10.0)
    time.sleep(2.0)
    return server.rss_bytes()
