"""Issue 10 ("survive abuse and overload"), bounded: each attack of testkit/ against a real server process,
asserting the issue's target in a scaled-down form (fewer streams, shorter loops, settings made smaller by
flags so the defence shows within seconds). The full-size attacks are ``python -m benchmarks.attack``.

Outcomes are asserted as counts and ratios; the only timings are the probes' 1 s (the stated target) and the
drain's exit time. The victim's and the probes' ratios are held to the issue's targets against a baseline taken
in the same test: the same siege against the same server, unattacked, just before (hardening_support.bar), so a
machine loaded by others moves the bar only as far as the quiet run shows. These tests run alone under
pytest-xdist (the `exclusive` marker, tests/conftest.py).
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from testkit.h2raw import StalledStreams, attack_window, rapid_reset_parallel
from testkit.harness import (
    LOOPBACK,
    channel,
    closed_loop,
    http_get,
    metric_total,
    mib,
    poll,
    scrape,
)
from testkit.http1raw import IdleConnections, UnreadAnswers, huge_header
from testkit.observe import Callers, HealthWatch
from testkit.payloads import (
    AMPLIFIER_PLAN_BATCH,
    BUILD_CHUNK_PATH,
    PLAN_BATCH_PATH,
    SMALL_BUILD_CHUNK,
    big_answer_build_chunk,
    one_row_chunks_plan_batch,
)
from testkit.siege import BYTES_HELD, ERRORS, SHED, Siege, counter_delta, health_address
from tests.system.hardening_support import bar, idle_rss, quiet_run

pytestmark = pytest.mark.timeout(120)

MiB = 2**20
BUDGET = 128 * MiB  # --response-budget-bytes of the memory tests: two ~64 MB answers
DRAIN_SECONDS = 2.0  # --response-drain-seconds of the memory tests
# Memory flags: a small budget and a short drain, so a stalled answer is cut within the test.
MEMORY_FLAGS = ("--response-budget-bytes", str(BUDGET), "--response-drain-seconds", str(DRAIN_SECONDS))
# RSS a held answer may cost beyond the bytes the budget counts (the answer's encoding copy, allocator slack):
# the target is < 512 MiB of RSS growth for a 256 MiB default budget, i.e. twice the budget.
RSS_ALLOWANCE = 2 * BUDGET + 64 * MiB
BIG_ANSWER = big_answer_build_chunk().SerializeToString()  # 140 bytes in, ~64 MB out
# Heavy, and allowed by every limit (under max_plan_chunks' default of 1,024): fairness, not refusal, must
# protect the light callers from it.
HEAVY_PLAN = one_row_chunks_plan_batch(1000).SerializeToString()
PROBES_IN_TIME = 0.99  # of probes answered within 1 s (the 99.9 %, with slack for a bounded run)


def test_stalled_window_zero_streams_hold_at_most_the_budget(serve) -> None:
    """Issue 10 #1: 5 streams asking for ~64 MB each with flow-control windows of 0 (before the defence:
    +640 MiB held until the sockets close). The server holds at most its budget, cuts what is not read
    within response_drain_seconds, counts it, and keeps serving others; once the attacker is gone its memory comes
    back (the watchdog's thread once kept the last call it cancelled, and gRPC core that call's 64 MB answer)."""
    server = serve(*MEMORY_FLAGS, "--idle-trim-seconds", "1")
    quiet = quiet_run(server)
    idle_before = idle_rss(server)
    with Siege(server) as siege, StalledStreams(LOOPBACK, server.grpc_port, BUILD_CHUNK_PATH, BIG_ANSWER, 5, 2) as st:
        ended = poll(lambda: st.snapshot().still_open == 0, DRAIN_SECONDS + 6.0)
        report = st.snapshot()
    assert report.opened == 5, report
    assert ended, f"streams the server never ended: {report.statuses()}"
    came_back = poll(lambda: server.rss_bytes() <= 1.2 * idle_before, 15.0, interval=0.5)
    assert came_back, f"idle {mib(idle_before):.0f} MiB, now {mib(server.rss_bytes()):.0f} MiB after the attack"
    assert siege.rss_peak_growth < RSS_ALLOWANCE, f"RSS grew {mib(siege.rss_peak_growth):.0f} MiB: {siege.summary()}"
    shed = siege.shed()
    assert sum(shed.get(r, 0) for r in ("unread_response", "connection_share", "memory")) >= 1, siege.summary()
    assert siege.victim_ok_ratio() >= bar(0.95, quiet.victim_ok_ratio), f"{siege.summary()}; quiet: {quiet}"
    assert poll(lambda: metric_total(scrape(server.http_url), BYTES_HELD) == 0, 5.0), "bytes still held"


def test_cpu_amplifier_refused_and_heavy_callers_do_not_starve_light_ones(serve) -> None:
    """Issue 10 #2: the 22-byte PlanBatch (8,192 chunks) is refused before any work, naming the limit; and
    10 callers looping a heavy PlanBatch that every limit allows (1,000 chunks) leave >= 99 % of small calls
    with a 1 s deadline served (97 % in this short run), and the probes answering (before the defence: 16 of 18
    small calls served, 97.7 % of probes in time)."""
    server = serve()
    assert server.health_port, "the server has no health_port in its port file"
    with channel(server.address) as attacker, pytest.raises(grpc.RpcError) as refused:
        attacker.unary_unary(PLAN_BATCH_PATH)(AMPLIFIER_PLAN_BATCH.SerializeToString(), timeout=30.0)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "max_plan_chunks" in refused.value.details(), refused.value.details()
    quiet = quiet_run(server)
    with Siege(server) as siege, Callers(server.address, PLAN_BATCH_PATH, HEAVY_PLAN, 30.0, 10, 0.0) as heavy:
        time.sleep(8.0)
    assert heavy.run().codes().get("OK", 0) >= 1, f"the heavy calls were never served: {heavy.run().codes()}"
    # The 99 % is over a 30 s run (benchmarks/attack.py); this one's ~100 small calls on a shared 2-core
    # machine get three misses of slack (none missed in 4 runs here). Without the defence, 83-89 % were served.
    assert siege.victim_ok_ratio() >= bar(0.97, quiet.victim_ok_ratio), f"{siege.summary()}; quiet: {quiet}"
    assert siege.probes.overall().ratio >= bar(PROBES_IN_TIME, quiet.probes_in_time), (siege.probe_report(), quiet)


def test_rapid_reset_leaves_other_callers_served(serve) -> None:
    """Issue 10 #3: 4 connections x 20,000 HEADERS + DATA + RST_STREAM (the issue's 4 x 5,000 before the defence:
    7 of 67 calls CANCELLED); a well-behaved caller on its own connection keeps >= 95 % of its calls and the
    probes answer."""
    server = serve()
    small = SMALL_BUILD_CHUNK.SerializeToString()
    quiet = quiet_run(server)
    with Siege(server) as siege:
        # 20,000 resets each (the 5,000 last ~1 s here): a window long enough for ~50 victim calls,
        # so that the ratio does not rest on a score of them (15,000 gave 39 once the resets got faster).
        reports = rapid_reset_parallel(LOOPBACK, server.grpc_port, BUILD_CHUNK_PATH, small, 4, 20_000, 30.0)
        time.sleep(0.5)
    assert sum(r.streams_reset for r in reports) >= 4 * 5000, reports  # the attack ran, at least the size
    # The victim's calls while the resets were flowing (the attackers' processes take a while to start).
    victim = siege.victim
    attack = attack_window(reports, victim.begin_wall)
    during = victim.calls_in(*attack)
    # About one victim call every 0.1 s: some 40 in the window, fewer under the whole suite's load.
    assert len(during) >= 30, f"{len(during)} victim calls during the attack {attack}: {siege.summary()}"
    assert victim.ok_ratio(*attack) >= bar(0.95, quiet.victim_ok_ratio), f"during {attack}: {siege.summary()}; {quiet}"
    assert siege.probes.overall().ratio >= bar(PROBES_IN_TIME, quiet.probes_in_time), (siege.probe_report(), quiet)


def test_http_huge_header_refused_early(serve) -> None:
    """Issue 10 #4: a 16 MiB request header (the benchmark sends 64 MiB) is refused with 431 long before it
    ends, counted, and /livez keeps answering (before: the whole header was parsed, then answered 200)."""
    server = serve()
    quiet = quiet_run(server)
    with Siege(server, victim=False, probe_interval=0.05) as siege:
        report = huge_header(LOOPBACK, server.http_rpc_port, 16 * MiB, max_seconds=20.0)
        time.sleep(0.5)
    assert report.status == 431 or (report.status is None and report.closed_by_server), report
    assert report.header_bytes_sent < 4 * MiB, report
    assert siege.probes.summaries()["livez"].ratio >= bar(PROBES_IN_TIME, quiet.probes_in_time), (
        siege.probe_report(),
        quiet,
    )
    assert siege.http_refused().get("header_too_large", 0) >= 1, siege.summary()


def test_http_idle_connections_closed_and_capped(serve) -> None:
    """Issue 10 #4: connections that never send are closed after http_idle_timeout_seconds, and more than
    http_max_connections are refused (before: 24 of 24 still open). No per-peer cap here: one peer filling the
    port would otherwise be held to its share first (tests/system/test_floods_gate.py)."""
    server = serve(
        "--http-idle-timeout-seconds", "1", "--http-max-connections", "16", "--max-connections-per-peer", "0"
    )
    with IdleConnections(LOOPBACK, server.http_rpc_port, 24) as idle:
        capped = poll(lambda: idle.still_open() <= 16, 2.0)
        open_after_cap = idle.still_open()
        closed = poll(lambda: idle.still_open() == 0, 5.0)
        open_at_end = idle.still_open()
    assert capped, f"{open_after_cap} of 24 idle connections open, above http_max_connections 16"
    assert closed, f"{open_at_end} of 24 idle connections still open after the 1 s idle timeout"
    assert http_get(f"{server.http_url}/livez", timeout=2.0)[0] == 200
    samples = scrape(server.http_url)
    refused = {
        reason: metric_total(samples, "indexer_http_refused_total", reason=reason)
        for reason in ("idle_timeout", "too_many_connections")
    }
    assert refused["too_many_connections"] >= 8 and refused["idle_timeout"] >= 1, refused


def test_http_never_read_answers_are_cut(serve) -> None:
    """Issue 10 #1 over HTTP: 8 clients POST a BuildChunk with a ~64 MB answer and never read it (before:
    ~50 MiB of RSS each, held until they close). The server holds at most its budget, closes what is not
    read within response_drain_seconds, and counts it."""
    server = serve(*MEMORY_FLAGS)
    quiet = quiet_run(server)
    unread_answers = UnreadAnswers(LOOPBACK, server.http_rpc_port, BUILD_CHUNK_PATH, BIG_ANSWER, 8)
    with Siege(server) as siege, unread_answers as unread:
        time.sleep(DRAIN_SECONDS)

        def settled() -> bool:  # no call computing or waiting for admission, no answer held unsent
            samples = scrape(server.http_url)
            return metric_total(samples, BYTES_HELD) == 0 and metric_total(samples, "indexer_requests_in_flight") == 0

        assert poll(settled, 30.0, interval=0.2), f"the unread answers are still held: {siege.summary()}"
        answers = unread.collect(timeout=5.0)
    # A refusal (429 before any work) is fine; a 200 must have been cut, not kept for the reader.
    kept = [a for a in answers if a.status == 200 and not a.cut]
    assert not kept, f"{len(kept)} of 8 unread answers were still there to read after the drain time: {kept[:2]}"
    assert siege.rss_peak_growth < RSS_ALLOWANCE, f"RSS grew {mib(siege.rss_peak_growth):.0f} MiB: {siege.summary()}"
    shed = siege.shed()
    assert sum(shed.get(r, 0) for r in ("unread_response", "connection_share", "memory")) >= 1, siege.summary()
    assert siege.victim_ok_ratio() >= bar(0.95, quiet.victim_ok_ratio), f"{siege.summary()}; quiet: {quiet}"


def test_shedding_is_counted_and_logged(serve) -> None:
    """Issue 10 #6: every RESOURCE_EXHAUSTED a caller sees for overload is in indexer_requests_shed_total and
    the log says so; calls whose deadline passes while queued are counted too (before: 288 refusals of 300,
    0 counted, no log line)."""
    server = serve("--max-concurrent-rpcs", "8", "--grpc-workers", "2")
    before = scrape(server.http_url)
    channels = [channel(server.address) for _ in range(4)]
    heavy = [ch.unary_unary(PLAN_BATCH_PATH).future(HEAVY_PLAN, timeout=30.0) for ch in channels * 10]
    # Small calls with a short deadline, sent while the heavy ones fill the server: some expire in its queue.
    small = SMALL_BUILD_CHUNK.SerializeToString()
    hurried = [ch.unary_unary(BUILD_CHUNK_PATH).future(small, timeout=0.3) for ch in channels * 2]
    codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK for f in heavy + hurried]
    for ch in channels:
        ch.close()
    seen = {code.name: codes.count(code) for code in set(codes)}
    # Every refusal is counted: shed for concurrency (even one that reached its caller after the deadline, seen
    # as DEADLINE_EXCEEDED) or for the heavy lane. A call that expired waiting for a thread is counted
    # (queue_deadline) when a thread reaches it, which can be just after the last call returned: let the pool
    # drain. A call that expired before the server's polling thread took it from gRPC core (starved of the GIL by
    # the heavy calls) never reaches the server and cannot be counted (docs/overload.md says so).
    give_up = time.monotonic() + 10.0
    while True:
        after = scrape(server.http_url)
        shed = counter_delta(before, after, SHED, "reason")
        errors = counter_delta(before, after, ERRORS, "code")
        if sum(shed.values()) >= seen.get("RESOURCE_EXHAUSTED", 0) or time.monotonic() > give_up:
            break
        time.sleep(0.2)
    summary = f"callers saw {seen}; the server counted shed {shed}, errors {errors}"
    assert seen.get("RESOURCE_EXHAUSTED", 0) >= 1, f"nothing was shed: {summary}"
    assert sum(shed.values()) >= seen.get("RESOURCE_EXHAUSTED", 0), summary
    late = sum(shed.get(reason, 0) for reason in ("queue_deadline", "deadline_on_arrival")) + errors.get(
        "DEADLINE_EXCEEDED", 0
    )
    assert late <= seen.get("DEADLINE_EXCEEDED", 0), summary  # counted once, never invented
    assert "shed reason=" in server.log(), server.log()[-3000:]


def test_memory_comes_back_after_a_burst(serve) -> None:
    """Issue 10 #7: after a burst of large answers ends, idle RSS returns within 1.2x of its idle value before
    (the issue allows 60 s; idle_trim_seconds 1 makes it seconds here)."""
    server = serve("--idle-trim-seconds", "1", "--heavy-lane-slots", "16", "--grpc-workers", "16")
    idle_before = idle_rss(server)
    request = big_answer_build_chunk(8 * MiB).SerializeToString()
    with channel(server.address) as burst:
        call = burst.unary_unary(BUILD_CHUNK_PATH)

        def one(_: int) -> tuple[grpc.StatusCode, str]:
            call(request, timeout=30.0)
            return grpc.StatusCode.OK, ""

        run = closed_loop(one, in_flight=16, max_calls=400, max_seconds=3.0)
    peak = server.peak_rss_bytes()
    assert run.codes().get("OK", 0) >= 16, run.codes()
    assert peak > idle_before + 64 * MiB, "the burst did not grow RSS: nothing to check"
    came_back = poll(lambda: server.rss_bytes() <= 1.2 * idle_before, 15.0, interval=0.5)
    assert came_back, (
        f"idle {mib(idle_before):.0f} MiB, peak {mib(peak):.0f} MiB, now {mib(server.rss_bytes()):.0f} MiB"
    )


def test_drain_does_not_wait_on_watchers(serve) -> None:
    """Issue 10 #8: with health Watch streams open, SIGTERM gets them NOT_SERVING and then ends them, and the
    process exits in well under the 20 s grace (before: it waited the whole grace)."""
    server = serve("--shutdown-grace-seconds", "20")
    watchers = [HealthWatch(server.address), HealthWatch(health_address(server) or server.address)]
    try:
        assert all(w.wait_status("SERVING") for w in watchers), [w.statuses for w in watchers]
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        exit_code = server.process.wait(30.0)
        exit_seconds = time.monotonic() - start
        for watcher in watchers:
            watcher.wait_end(5.0)
        assert exit_code == 0
        # Well under the grace (the attack benchmark: 0.22 s).
        assert exit_seconds < 2.0, f"exit took {exit_seconds:.1f} s with Watch streams open"
        for watcher in watchers:
            assert watcher.statuses[-1] == "NOT_SERVING", watcher.statuses
            assert watcher.ended_at is not None
    finally:
        for watcher in watchers:
            watcher.close()
