"""Faults against a real server process: clients that cancel or let their deadline pass mid-call.

Covered elsewhere, not repeated here: SIGTERM mid-load drains and exits 0 with every accepted call answered
(tests/service/test_shutdown.py); an unexpected backend failure is INTERNAL and the next call succeeds, and
out-of-memory is RESOURCE_EXHAUSTED (tests/service/test_dataplane.py, in process); a request that fails deep in
the kernel layer of a real server process leaves it serving (tests/system/test_fuzz_requests.py, the DCP overflow).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from testkit.fuzzing import Limits, call_and_check, judge, stubs_for
from testkit.harness import FAST_START, ServiceProcess, channel, metric_total, scrape
from tests.system.hardening_support import ERRORS, SLOW, SLOW_CHUNKS, SMALL, assert_healthy_after, wait_idle

# The server takes SLOW, a plan of SLOW_CHUNKS chunks, and the oracle knows it.
LIMITS = Limits(
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=2**20,
    max_message_bytes=64 * 2**20,
    max_logits_bytes=512 * 2**20,
    max_plan_chunks=SLOW_CHUNKS,
)
CALLS = 6  # of each kind: more than the server's 8 worker threads together, so some wait in its queue
# SLOW takes the heavy lane. With its default 2 slots and a waiting room of 2, calls beyond 4 may be shed
# (RESOURCE_EXHAUSTED) before their deadline passes, which is right but not what these tests are about
# (tests/service/test_admission.py is): as many slots as worker threads means no call waits for the lane.
ALL_HEAVY_AT_ONCE = ("--heavy-lane-slots", "8", "--grpc-workers", "8")


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START, *LIMITS.flags(), *ALL_HEAVY_AT_ONCE) as process:
        yield process


def abandon_slow_calls(server: ServiceProcess) -> tuple[float, dict[str, float]]:
    """CALLS slow calls whose deadline passes after 50 ms and CALLS cancelled after 100 ms; returns the seconds
    until the server had nothing in flight, and how the server counted those calls (by code)."""
    before = scrape(server.http_url)
    with channel(server.address) as chan:
        plan = stubs_for(chan)["PlanBatch"]
        expired = [plan.future(SLOW, timeout=0.05) for _ in range(CALLS)]
        cancelled = [plan.future(SLOW, timeout=60) for _ in range(CALLS)]
        time.sleep(0.1)
        assert all(f.cancel() for f in cancelled), "a slow call finished before it could be cancelled"
        for f in expired:
            assert f.exception(timeout=30).code() is grpc.StatusCode.DEADLINE_EXCEEDED
        idle_after = wait_idle(server, timeout=60)
    after = scrape(server.http_url)

    def delta(name: str, **labels: str) -> float:
        return metric_total(after, name, **labels) - metric_total(before, name, **labels)

    counted = {code: delta(ERRORS, method="PlanBatch", code=code) for code in ("CANCELLED", "DEADLINE_EXCEEDED")}
    counted["OK"] = delta("indexer_request_duration_seconds_count", method="PlanBatch", code="OK")
    return idle_after, counted


def test_cancelled_and_expired_calls_leave_nothing_in_flight(server: ServiceProcess) -> None:
    _, counted = abandon_slow_calls(server)
    assert counted["OK"] + counted["CANCELLED"] + counted["DEADLINE_EXCEEDED"] <= 2 * CALLS, counted
    # ... and the server answers the next calls, right.
    with channel(server.address) as chan:
        stubs = stubs_for(chan)
        for method, request in (("BuildChunk", SMALL), ("PlanBatch", SLOW)):
            code, problem = call_and_check(stubs, method, request, judge(method, request, LIMITS))
            assert code is grpc.StatusCode.OK and not problem, problem
    assert_healthy_after(server)


def test_calls_whose_client_is_gone_stop_computing(server: ServiceProcess) -> None:
    """What the in-flight gauge cannot show: a call whose client left should stop at its next chunk, not run to
    the end. gRPC itself drops the calls still queued; the ones already in the backend are the service's."""
    idle_after, counted = abandon_slow_calls(server)
    assert counted["OK"] == 0, (
        f"{counted['OK']:.0f} of {2 * CALLS} calls whose client had gone ran to the end (nothing in flight after "
        f"{idle_after:.2f} s): the servicer must stop them at the next chunk with CANCELLED or DEADLINE_EXCEEDED"
    )
    assert_healthy_after(server)
