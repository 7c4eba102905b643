"""Issue 19 items 1 and 5, bounded: floods of calls that are cheap to refuse or already expired, or that never send
their request, must cost only the connections that send them. Each flood runs against a real server with a
well-behaved victim on a connection of its own and the probes, measured against a control taken on the same server
just before.
The full-size floods are rows of ``python -m benchmarks.attack`` (refused-flood, expiring-flood).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from testkit.h2raw import attack_window, call_loop_parallel
from testkit.harness import LOOPBACK, channel, merged_counts, poll, scrape
from testkit.observe import Callers
from testkit.payloads import AMPLIFIER_PLAN_BATCH, BUILD_CHUNK_PATH, PLAN_BATCH_PATH, SMALL_BUILD_CHUNK
from testkit.siege import ERRORS, SHED, Siege, control_run, counter_delta
from testkit.streams import sends_nothing

pytestmark = pytest.mark.timeout(120)

FLOODERS = 10  # connections, as in the issue
FLOOD_SECONDS = 4.0
CONTROL_SECONDS = 2.0
PROBES_IN_TIME = 0.99  # the 99.9 %, with slack for a few seconds on a shared 2-core machine
# The victim may miss at most this share more than in its control (the target is 99 % OK).
VICTIM_SLACK = 0.01


@pytest.mark.parametrize(
    "flags",
    [(), ("--max-streams-per-connection", "16")],
    ids=["default", "16-streams-per-connection"],
)
def test_refused_flood_stays_on_the_flooders_connections(serve, flags: tuple[str, ...]) -> None:
    """Issue 19 #1: 10 connections looping a PlanBatch refused at once (work_limit). Before: the victim 52-57 %
    OK, the rest UNAVAILABLE (REFUSED_STREAM), because testkit's callers and victim shared one HTTP/2 connection
    (gRPC's global subchannel pool) and gRPC core's per-connection stream limit refused all of its streams. On
    connections of their own, the refusals reach only the flooders, and every one is counted. With 16 streams
    per connection the shared connection failed the victim within a second (4.5 % OK)."""
    server = serve(*flags)
    before = control_run(server, CONTROL_SECONDS)
    amplifier = AMPLIFIER_PLAN_BATCH.SerializeToString()
    with Siege(server) as siege, Callers(server.address, PLAN_BATCH_PATH, amplifier, 30.0, FLOODERS, 0.0) as flood:
        time.sleep(1.0)
        connections = server.connections_on(server.grpc_port)
        time.sleep(FLOOD_SECONDS - 1.0)
    seen = flood.run().codes()
    # Each flooder, the victim and the probes on connections of their own (the victim's is the one past them).
    assert connections > FLOODERS, f"{connections} connections for {FLOODERS} flooders and a victim"
    assert seen.get("RESOURCE_EXHAUSTED", 0) >= 10 * FLOODERS, f"the flood did not run: {seen}"
    assert seen.get("UNAVAILABLE", 0) == 0, f"streams refused to callers with one call in flight: {seen}"
    assert siege.shed().get("work_limit", 0) == seen["RESOURCE_EXHAUSTED"], siege.summary()
    assert siege.victim_ok_ratio() >= before.victim_ok_ratio() - VICTIM_SLACK, (
        f"control: {before.summary()}; flood: {siege.summary()}"
    )
    assert siege.probes.overall().ratio >= PROBES_IN_TIME, siege.summary()


def test_expiring_flood_leaves_other_callers_served(serve) -> None:
    """Issue 19 #5: 10 connections sending calls with ``grpc-timeout: 1u`` (expired on arrival), one in flight
    each. The victim and the probes keep their control's success; every call the server took up is counted
    (shed deadline_on_arrival, its caller's doing, or queue_deadline where it expired while it waited in the
    server, or an error DEADLINE_EXCEEDED when it expired mid-work); gRPC core ends the others with
    RST_STREAM before the server sees them."""
    server = serve()
    before = control_run(server, CONTROL_SECONDS)
    small = SMALL_BUILD_CHUNK.SerializeToString()
    with Siege(server) as siege:
        reports = call_loop_parallel(LOOPBACK, server.grpc_port, BUILD_CHUNK_PATH, small, FLOODERS, FLOOD_SECONDS, "1u")
        time.sleep(0.5)
    endings = merged_counts(r.endings for r in reports)
    assert sum(endings.values()) >= 100 * FLOODERS, f"the flood did not run: {endings}"
    window = attack_window(reports, siege.victim.begin_wall)
    in_window = len(siege.victim.calls_in(*window))
    assert in_window >= 20, f"victim calls during the flood {window}: {siege.summary()}"
    # The window holds a few dozen victim calls: the slack is at least one of them, one late call on a loaded
    # 2-CPU machine being a step of 3 % there (a full-size row of benchmarks.attack holds the 99 %).
    assert siege.victim.ok_ratio(*window) >= before.victim_ok_ratio() - max(VICTIM_SLACK, 1 / in_window), (
        f"control: {before.summary()}; flood {endings}: {siege.summary()}"
    )
    assert siege.probes.overall().ratio >= PROBES_IN_TIME, siege.summary()

    # Every call that ended DEADLINE_EXCEEDED (status 4) is counted once the server has taken it up: a call that
    # expired while queued for a thread is counted when a thread reaches it, which can be after the flood.
    def counted() -> float:
        after = scrape(server.http_url)
        shed = counter_delta(siege.metrics_before, after, SHED, "reason")
        shed = sum(shed.get(reason, 0) for reason in ("queue_deadline", "deadline_on_arrival", "caller_cancelled"))
        return shed + counter_delta(siege.metrics_before, after, ERRORS, "code").get("DEADLINE_EXCEEDED", 0)

    assert poll(lambda: counted() >= endings.get("grpc-4", 0), 10.0, interval=0.2), (
        f"counted {counted()} of the flood's {endings}: {siege.summary()}"
    )


def test_calls_that_never_send_their_request_leave_other_callers_served(serve) -> None:
    """Twice ``grpc_workers`` BuildChunk calls opened on one connection, no deadline, whose request never comes.
    Before, each held an RPC thread while it waited for its message, and 8 of them stopped every other caller's
    calls (DEADLINE_EXCEEDED) until they left; now a call takes a thread only once its request is in. The victim
    and the probes keep their control's success; the stalled calls end as gRPC ends such calls once their caller
    closes: UNIMPLEMENTED."""
    server = serve("--grpc-workers", "4")
    before = control_run(server, CONTROL_SECONDS)
    leave = threading.Event()

    with channel(server.address) as stalled_connection:
        stalled = stalled_connection.stream_unary(BUILD_CHUNK_PATH, _registered_method=True)
        with Siege(server) as siege:
            calls = [stalled.future(sends_nothing(leave)) for _ in range(8)]
            time.sleep(FLOOD_SECONDS)
            leave.set()
            endings = [call.exception(10) for call in calls]
    assert all(e is not None and e.code() == grpc.StatusCode.UNIMPLEMENTED for e in endings), endings
    assert siege.victim_ok_ratio() >= before.victim_ok_ratio() - VICTIM_SLACK, (
        f"control: {before.summary()}; stalled calls: {siege.summary()}"
    )
    assert siege.probes.overall().ratio >= PROBES_IN_TIME, siege.summary()
