"""Issue 10's attacks at full size, each on a fresh server with default settings (plus the named flags), each
watched by probes, a well-behaved victim and RSS sampling (testkit.siege):

    python -m benchmarks.attack [--out FILE] [--only NAME ...] [--server-pythonpath DIR] [--scale F]
        [--deployed-start] [--check]

Servers start with the numpy backend and no warmup (FAST_START: ready at once, and the smallest idle RSS, so the
memory ratios are the strictest); ``--deployed-start`` starts them as deployed (default backend and warmup).

Prints per attack what was tried, the RSS before and after, the victim's success, the probes answered within
1 s, the same victim's and probes' figures in a quiet run of 5 s on the same server just before the attack
(``control``: the baseline from the same run), what the server's metrics counted, and for each server still
running how long its RSS took to come back within 1.2x of its idle value (``memory_back``, at most 60 s);
``--out`` writes the same as JSON.
``--server-pythonpath`` serves from another source tree, for "before" figures: ``git archive <commit> | tar -x
-C /tmp/before`` (copy the built service/compute/_fastpath*.so too), then ``--server-pythonpath /tmp/before``.

``--check`` holds each row that has targets here (``TARGETS``: rapid-reset, http-big-header, drain-watchers,
shedding) to them, prints every one missed, and exits 1 if any was (or any row failed to run); rows without
targets are checked for running at all.

``--scale`` multiplies the sizes of the stream and connection floods (issue 19's rows: ``reflection-streams``,
``blocked-watchers``, ``idle-connections-grpc``, ``idle-connections-health``, ``tls-half-open``), e.g. 0.1 for a
check that they run on a shared machine.

Loopback only; every loop is bounded in count and time; every server and attacker process is killed at the end.
The bounded versions of the same attacks are tests/system/test_hardening_abuse.py and, for issue 19's floods,
tests/system/test_floods_refusals.py and tests/system/test_floods_streams_connections.py; for the gate's rows
(issue 35: undecodable-health, silent-watches, http-trailers, silent-unary-calls, idle-connections-many-peers),
tests/system/test_floods_gate.py, whose attacks are the same functions (testkit/shapes.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil

from indexer_service.service.reasons import HttpRefusal
from testkit import shapes
from testkit.apart import Apart
from testkit.h2raw import (
    StalledStreams,
    attack_window,
    call_loop_parallel,
    rapid_reset_parallel,
)
from testkit.harness import (
    FAST_START,
    FLOOD_PEER,
    LOOPBACK,
    ServiceProcess,
    channel,
    clean_env,
    closed_loop,
    merged_counts,
    metric_total,
    mib,
    scrape,
)
from testkit.http1raw import IdleConnections, UnreadAnswers, huge_header, open_together
from testkit.observe import Callers, HealthWatch, HttpVictim
from testkit.payloads import (
    AMPLIFIER_PLAN_BATCH,
    BUILD_CHUNK_PATH,
    CLIENT_HELLO_START,
    H2_PREFACE,
    PLAN_BATCH_PATH,
    SMALL_BUILD_CHUNK,
    big_answer_build_chunk,
    one_row_chunks_plan_batch,
)
from testkit.record import write_json
from testkit.siege import BYTES_HELD, Siege, control_run, health_address
from testkit.streams import WATCH_PATH, BlockedWatchers, SilentCalls

DEFAULT_DRAIN_SECONDS = 30.0  # response_drain_seconds' default: stalled answers are held at least this long
DEFAULT_IDLE_SECONDS = 15.0  # http_idle_timeout_seconds' default
BIG_ANSWER = big_answer_build_chunk().SerializeToString()  # 140 bytes in, ~64 MB out
# A heavy call that every limit allows (under max_plan_chunks' default of 1,024).
HEAVY_PLAN = one_row_chunks_plan_batch(1000).SerializeToString()
FLOOD_CONNECTIONS = 10  # issue 19's floods: connections, one call in flight each
FLOOD_SECONDS = 15.0
FLOOD_VICTIM_PAUSE = 0.05  # issue 19's victim: one small call every 50 ms, 1 s deadline
FRESH_CLIENT_INTERVAL = 1.0  # issue 19's stream floods: a fresh health-checking IndexerClient every second
MEMORY_BACK_SECONDS = 60.0  # issue 10: idle RSS back within 1.2x of its value before, within 60 s of the end
DEFAULT_IDLE_CONNECTION_SECONDS = 120.0  # connection_idle_seconds' default
SCALE = {"factor": 1.0}  # --scale: the issue 19 floods' sizes
# Each siege's quiet run on the same server just before its attack: long enough for about 250 victim calls and 50
# probes of each kind.
CONTROL_SECONDS = 5.0
CONTROL_FIGURES = (
    "seconds",
    "victim_ok_ratio",
    "victim_codes",
    "probes_in_time_ratio",
    "probes",
    "fresh_client_ok_ratio",
)


class Bench:
    """Starts servers (from ``pythonpath`` when given) and keeps every one for the final kill. Each starts
    FAST_START (the numpy backend, no warmup: ready in about a second, the smallest idle RSS, so memory ratios are
    the strictest), or as deployed with ``deployed_start`` (the default backend and warmup: the idle RSS a
    replica really has, against which ``memory_back`` then measures)."""

    def __init__(self, pythonpath: str | None, deployed_start: bool = False) -> None:
        self.pythonpath = pythonpath
        self.start_flags = () if deployed_start else FAST_START
        self.servers: list[ServiceProcess] = []
        self.idle_rss: dict[ServiceProcess, int] = {}

    def serve(self, *flags: str) -> ServiceProcess:
        env = clean_env(PYTHONPATH=self.pythonpath) if self.pythonpath else None
        server = ServiceProcess(*self.start_flags, *flags, env=env)
        self.servers.append(server)
        server.__enter__()
        self.idle_rss[server] = server.rss_bytes()
        return server

    def memory_back(self) -> list[dict]:
        """Issue 10's "memory comes back": for each server still running after its attack, how many seconds until
        its RSS was within 1.2x of its idle RSS when it was ready (polled each second, at most 60 s)."""
        figures = []
        for server in self.servers:
            if server.process.poll() is not None:  # the attack ended it (drain-watchers)
                continue
            idle, start = self.idle_rss[server], time.monotonic()
            try:
                while (rss := server.rss_bytes()) > 1.2 * idle and time.monotonic() - start < MEMORY_BACK_SECONDS:
                    time.sleep(1.0)
            except psutil.Error as exc:  # it died while watched: that is the finding
                figures.append({"error": f"{type(exc).__name__}: {exc}", "exit_code": server.process.poll()})
                continue
            waited = time.monotonic() - start
            figures.append(
                {
                    "idle_mib": round(mib(idle), 1),
                    "rss_mib": round(mib(rss), 1),
                    "ratio": round(rss / idle, 2),
                    "seconds": round(waited, 1),
                    "back_within_60s": rss <= 1.2 * idle,
                }
            )
        return figures

    def kill_all(self) -> None:
        for server in self.servers:
            server.kill()
        self.servers, self.idle_rss = [], {}


class ControlledSiege(Siege):
    """A :class:`Siege` preceded by a quiet run of the same siege on the same server (:func:`control_run`,
    ``CONTROL_SECONDS``): its figures carry the quiet run's under ``control``, the baseline from the same run that
    the attacked figures are read against."""

    def __init__(self, server: ServiceProcess, **options: object) -> None:
        self.control = control_run(server, CONTROL_SECONDS, **options)
        super().__init__(server, **options)

    def figures(self) -> dict[str, object]:
        quiet = self.control.figures()
        return super().figures() | {"control": {key: quiet[key] for key in CONTROL_FIGURES if key in quiet}}


def _wait_rss(server: ServiceProcess, seconds: float) -> float:
    time.sleep(seconds)
    return round(mib(server.rss_bytes()), 1)


# --- the attacks --------------------------------------------------------------------------------------------


def stalled_streams(bench: Bench) -> dict:
    """10 BuildChunk streams with ~64 MB answers on 2 connections with flow-control windows of 0, held past
    response_drain_seconds; then 100 window-0 streams on one connection (how many does the server take?)."""
    server = bench.serve()
    hold = DEFAULT_DRAIN_SECONDS + 5.0
    with (
        ControlledSiege(server) as siege,
        StalledStreams(LOOPBACK, server.grpc_port, BUILD_CHUNK_PATH, BIG_ANSWER, 10, 2) as st,
    ):
        time.sleep(hold)
        stalled = st.snapshot()
    figures = siege.figures()
    figures.update(
        tried=f"10 x ~64 MB answers, windows 0, 2 connections, held {hold:.0f} s",
        streams_opened=stalled.opened,
        stream_endings=stalled.statuses(),
        rss_after_close_mib=_wait_rss(server, 5.0),
        response_bytes_held_after_mib=round(mib(metric_total(scrape(server.http_url), BYTES_HELD)), 1),
    )
    small = SMALL_BUILD_CHUNK.SerializeToString()
    with StalledStreams(LOOPBACK, server.grpc_port, BUILD_CHUNK_PATH, small, 100, 1) as many:
        time.sleep(1.0)
        refused = many.snapshot().statuses().get("reset-REFUSED_STREAM", 0)
        figures["streams_taken_of_100_on_one_connection"] = many.report.opened - refused
    return figures


def cpu_amplification(bench: Bench) -> dict:
    """10 callers looping the 22-byte PlanBatch (8,192 one-row chunks) for 30 s: with the default settings
    (max_plan_chunks refuses it), and with max_plan_chunks 8192 (only the heavy lane stands in its way)."""
    amplifier = AMPLIFIER_PLAN_BATCH.SerializeToString()
    figures = {}
    for name, flags in (("default", ()), ("max_plan_chunks_8192", ("--max-plan-chunks", "8192"))):
        server = bench.serve(*flags)
        with (
            ControlledSiege(server) as siege,
            Callers(server.address, PLAN_BATCH_PATH, amplifier, 30.0, 10, 0.0) as amp,
        ):
            time.sleep(30.0)
        figures[name] = siege.figures() | {"attacker_codes": amp.run().codes(), "memory_back": bench.memory_back()}
        server.kill()  # the next configuration gets the CPU to itself
    figures["tried"] = "10 callers x 22-byte PlanBatch for 30 s, default settings and max_plan_chunks 8192"
    return figures


def rapid_reset(bench: Bench) -> dict:
    """4 connections x 5,000 HEADERS + DATA + RST_STREAM, from 4 processes."""
    server = bench.serve()
    small = SMALL_BUILD_CHUNK.SerializeToString()
    with ControlledSiege(server) as siege:
        reports = rapid_reset_parallel(LOOPBACK, server.grpc_port, BUILD_CHUNK_PATH, small, 4, 5000, 120.0)
        time.sleep(1.0)
    figures = siege.figures()
    figures.update(
        tried="4 x 5,000 HEADERS+DATA+RST_STREAM",
        streams_reset=sum(r.streams_reset for r in reports),
        attack_seconds=round(max(r.seconds for r in reports), 1),
        goaways=merged_counts(r.goaways for r in reports),
        connections_used=sum(r.connections_used for r in reports),
        victim_ok_ratio_during_attack=round(siege.victim.ok_ratio(*attack_window(reports, siege.victim.begin_wall)), 4),
    )
    return figures


def _flood(bench: Bench, path: str, message: bytes, grpc_timeout: str | None) -> dict:
    """Issue 19's floods: FLOOD_CONNECTIONS processes, one connection each, each sending ``message`` again as
    soon as the last call ended, for FLOOD_SECONDS; the victim's success counts its calls during the flood."""
    server = bench.serve()
    with ControlledSiege(server, victim_pause=FLOOD_VICTIM_PAUSE) as siege:
        reports = call_loop_parallel(
            LOOPBACK, server.grpc_port, path, message, FLOOD_CONNECTIONS, FLOOD_SECONDS, grpc_timeout
        )
        time.sleep(1.0)
    figures = siege.figures()
    figures.update(
        flood_endings=merged_counts(r.endings for r in reports),
        flood_calls_per_second=round(sum(r.calls for r in reports) / FLOOD_SECONDS),
        goaways=[r.goaway for r in reports if r.goaway],
        victim_ok_ratio_during_attack=round(siege.victim.ok_ratio(*attack_window(reports, siege.victim.begin_wall)), 4),
    )
    return figures


def refused_flood(bench: Bench) -> dict:
    """10 connections looping the PlanBatch that max_plan_chunks refuses at once (work_limit)."""
    figures = _flood(bench, PLAN_BATCH_PATH, AMPLIFIER_PLAN_BATCH.SerializeToString(), None)
    figures["tried"] = f"{FLOOD_CONNECTIONS} connections x refused PlanBatch, one in flight each, {FLOOD_SECONDS:.0f} s"
    return figures


def expiring_flood(bench: Bench) -> dict:
    """10 connections looping a small BuildChunk sent with ``grpc-timeout: 1u`` (expired on arrival)."""
    figures = _flood(bench, BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK.SerializeToString(), "1u")
    figures["tried"] = (
        f"{FLOOD_CONNECTIONS} connections x calls with grpc-timeout 1u, one in flight each, {FLOOD_SECONDS:.0f} s"
    )
    return figures


def http_big_header(bench: Bench) -> dict:
    """One request with a 64 MiB header, streamed in 64 KiB pieces."""
    server = bench.serve()
    with ControlledSiege(server, probe_interval=0.05) as siege:
        report = huge_header(LOOPBACK, server.http_rpc_port, 64 * 2**20, max_seconds=120.0)
        time.sleep(1.0)
    figures = siege.figures()
    figures.update(
        tried="64 MiB request header",
        header_mib_sent=round(mib(report.header_bytes_sent), 1),
        answer=report.status,
        closed_by_server=report.closed_by_server,
        attack_seconds=round(report.seconds, 2),
    )
    return figures


def http_idle(bench: Bench) -> dict:
    """50 HTTP connections that never send, checked after http_idle_timeout_seconds + 5 s."""
    server = bench.serve()
    wait = DEFAULT_IDLE_SECONDS + 5.0
    with ControlledSiege(server) as siege, IdleConnections(LOOPBACK, server.http_rpc_port, 50) as idle:
        time.sleep(wait)
        still_open = idle.still_open()
    figures = siege.figures()
    figures.update(tried=f"50 idle HTTP connections, {wait:.0f} s", still_open=still_open, refused=idle.refused)
    return figures


def http_never_read(bench: Bench) -> dict:
    """10 HTTP clients POST a BuildChunk with a ~64 MB answer and read nothing for response_drain_seconds + 5."""
    server = bench.serve()
    hold = DEFAULT_DRAIN_SECONDS + 5.0
    with (
        ControlledSiege(server) as siege,
        UnreadAnswers(LOOPBACK, server.http_rpc_port, f"{BUILD_CHUNK_PATH}", BIG_ANSWER, 10) as unread,
    ):
        time.sleep(hold)
        answers = unread.collect(timeout=10.0)
    figures = siege.figures()
    statuses: dict[str, int] = {}
    for answer in answers:
        key = f"{answer.status}-{'complete' if answer.complete else 'cut' if answer.cut else 'still-arriving'}"
        statuses[key] = statuses.get(key, 0) + 1
    figures.update(
        tried=f"10 unread ~64 MB HTTP answers, {hold:.0f} s",
        answers=statuses,
        rss_after_close_mib=_wait_rss(server, 5.0),
    )
    return figures


def shedding(bench: Bench) -> dict:
    """max_concurrent_rpcs 8 and 300 heavy PlanBatch calls at once from 10 connections: does every refusal
    the callers see show up in the metrics?"""
    server = bench.serve("--max-concurrent-rpcs", "8")
    channels = [channel(server.address) for _ in range(10)]
    with ControlledSiege(server, victim=False) as siege:
        futures = [channels[n % 10].unary_unary(PLAN_BATCH_PATH).future(HEAVY_PLAN, timeout=60.0) for n in range(300)]
        codes: dict[str, int] = {}
        for future in futures:
            try:
                future.result()
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            codes[code.name] = codes.get(code.name, 0) + 1
    for ch in channels:
        ch.close()
    figures = siege.figures()
    figures.update(
        tried="300 heavy calls at once, max_concurrent_rpcs 8",
        caller_codes=codes,
        shed_log_lines=server.log().count("shed reason="),
    )
    return figures


def burst_rss(bench: Bench) -> dict:
    """Idle RSS, a 15 s burst of 64 callers of ~8 MB answers, then idle RSS 10, 30 and 60 s later."""
    server = bench.serve()
    time.sleep(2.0)
    idle_before = server.rss_bytes()
    request = big_answer_build_chunk(8 * 2**20).SerializeToString()
    burst_channel = channel(server.address)
    call = burst_channel.unary_unary(BUILD_CHUNK_PATH)

    def one(_: int) -> tuple[grpc.StatusCode, str]:
        call(request, timeout=30.0)
        return grpc.StatusCode.OK, ""

    run = closed_loop(one, in_flight=64, max_calls=100_000, max_seconds=15.0)
    burst_channel.close()
    peak = server.peak_rss_bytes()
    after = {}
    waited = 0.0
    for mark in (10.0, 30.0, 60.0):
        after[f"rss_{mark:.0f}s_after_mib"] = _wait_rss(server, mark - waited)
        waited = mark
    return {
        "tried": "64 callers of ~8 MB answers for 15 s, then idle",
        "burst_codes": run.codes(),
        "rss_idle_before_mib": round(mib(idle_before), 1),
        "rss_peak_mib": round(mib(peak), 1),
        **after,
        "ratio_60s_after": round(after["rss_60s_after_mib"] / mib(idle_before), 2),
    }


def drain_watchers(bench: Bench) -> dict:
    """SIGTERM with two health Watch streams open and one heavy call in flight (default grace 10 s)."""
    server = bench.serve()
    watch_address = health_address(server) or server.address
    watchers = [HealthWatch(server.address), HealthWatch(watch_address)]
    for watcher in watchers:
        watcher.wait_status("SERVING")
    call_channel = channel(server.address)
    in_flight = call_channel.unary_unary(PLAN_BATCH_PATH).future(HEAVY_PLAN, timeout=60.0)
    time.sleep(0.2)
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    exit_code = server.process.wait(60.0)
    exit_seconds = time.monotonic() - start
    try:
        in_flight.result()
        call_code = "OK"
    except grpc.RpcError as exc:
        call_code = exc.code().name
    for watcher in watchers:
        watcher.wait_end(5.0)
    call_channel.close()
    figures = {
        "tried": "SIGTERM with 2 health Watch streams open and one heavy call in flight",
        "exit_code": exit_code,
        "exit_seconds": round(exit_seconds, 2),
        "in_flight_call": call_code,
        "watchers": [
            {
                "statuses": w.statuses,
                "end": w.end_code.name if w.end_code else None,
                "ended_after_s": round(w.ended_at - start, 2) if w.ended_at else None,
            }
            for w in watchers
        ],
    }
    for watcher in watchers:
        watcher.close()
    return figures


def _scaled(n: int) -> int:
    return max(1, round(n * SCALE["factor"]))


def reflection_streams(bench: Bench) -> dict:
    """6 connections x 10 reflection streams that never send a request, each reopened 0.05 s after it ended, 30 s,
    from a process of their own (their 60 threads, reopening hundreds of streams a second, would otherwise hold the
    probes' GIL and make them late)."""
    server = bench.serve()
    connections = _scaled(6)
    flood = Apart(SilentCalls, server.address, connections, 10, 0.05, keep=("opened", "ended"))
    with ControlledSiege(server, fresh_client_interval=FRESH_CLIENT_INTERVAL) as siege, flood:
        time.sleep(30.0)
    figures = siege.figures()
    figures.update(tried=f"{connections} connections x 10 idle reflection streams, 30 s", **flood.kept)
    return figures


def silent_unary_calls(bench: Bench) -> dict:
    """BuildChunk calls whose request never comes, from another peer than the victim: twice grpc_workers of them on
    one connection for 15 s (each held an RPC thread once, and 8 stopped every other caller), then 3 connections x
    100 (once past max_concurrent_rpcs: they held all its places, the victim refused)."""
    figures = {}
    for name, connections, each in (("one_connection_16", 1, 16), ("three_connections_300", 3, 100)):
        server = bench.serve()
        flood = shapes.silent_unary_calls(server, connections, each)
        with ControlledSiege(server) as siege:
            with flood:
                time.sleep(15.0)
            endings = flood.close()
        figures[name] = siege.figures() | {"endings": endings}
        server.kill()
    figures["tried"] = "BuildChunk calls that never send their request: 1 x 16 and 3 x 100 connections x calls, 15 s"
    return figures


def undecodable_health(bench: Bench) -> dict:
    """Health Watch and Check calls whose request does not parse (3 bytes 0xff), 4 connections of each on the
    health port and 2 of each on the RPC port, looping for 30 s (grpcio's own path for Watch kept ~20 KiB a call
    for good, and logged a traceback per call)."""
    server = bench.serve()
    flood_seconds = 30.0
    idle = server.rss_bytes()
    with ControlledSiege(server) as siege:
        ports = {server.health_port: _scaled(4), server.grpc_port: _scaled(2)}
        reports = shapes.undecodable_calls(ports, (WATCH_PATH, shapes.HEALTH_CHECK_PATH), flood_seconds / 2)
    endings = merged_counts(r.endings for r in reports)
    figures = siege.figures()
    figures.update(
        tried=f"undecodable Watch and Check calls, 2 x {flood_seconds / 2:g} s per port, {len(reports)} connections",
        endings=endings,
        rss_growth_mib=round(mib(server.rss_bytes() - idle), 1),
        log_lines=len(server.log().splitlines()),
    )
    return figures


def silent_watches(bench: Bench) -> dict:
    """Four health Watch calls that never send their request, on one connection to the health port, and as many
    on the RPC port, from another peer than the victim, 15 s, with fresh health-checking clients; then SIGTERM with
    them open (they once held all four health threads, new Watches got no status, and the drain waited out its
    whole grace)."""
    server = bench.serve()
    flood = shapes.silent_watches(server)
    with flood[0], flood[1]:
        with ControlledSiege(server, fresh_client_interval=FRESH_CLIENT_INTERVAL) as siege:
            time.sleep(15.0)
        start = time.monotonic()
        code = server.terminate()
        drain_seconds = round(time.monotonic() - start, 2)
    figures = siege.figures()
    figures.update(
        tried="1 connection x 4 silent Watch calls on each gRPC port, 15 s, then SIGTERM",
        exit_code=code,
        sigterm_to_exit_s=drain_seconds,
    )
    return figures


def http_trailers(bench: Bench) -> dict:
    """A BuildChunk over HTTP whose chunked body ends in a 64 MiB trailer field, on one connection, then waves of 48
    connections at once from one peer for 15 s (when trailers were outside http_max_header_bytes, 48 such
    connections took RSS from 64 to 725 MiB and an HTTP victim to 2.4 %)."""
    server = bench.serve()
    body = SMALL_BUILD_CHUNK.SerializeToString()
    with ControlledSiege(server) as siege, HttpVictim(server.http_rpc_url, BUILD_CHUNK_PATH, body) as victim:
        flood = shapes.trailer_waves(server.http_rpc_port, 48, 15.0)
    figures = siege.figures()
    figures.update(
        tried=f"one connection, then {flood.waves} waves of 48 at once for 15 s, each a 64 MiB trailer after a body",
        one=_trailer_figures([flood.one]),
        many=_trailer_figures(flood.many),
        http_victim=victim.figures(),
    )
    return figures


def _trailer_figures(reports: list) -> dict:
    """What the server let the trailers send before it answered or closed, at most, and what it answered."""
    return {
        "sent_mib_max": round(mib(max(r.header_bytes_sent for r in reports)), 2),
        "seconds_max": round(max(r.seconds for r in reports), 2),
        "answers": sorted({str(r.status) for r in reports}),
    }


def idle_connections_many_peers(bench: Bench) -> dict:
    """Idle connections from 79 peers (127.0.0.2 to 127.0.0.80), each under its per-peer cap (200 a peer and port),
    on the RPC, health and both HTTP ports at once, held 30 s: the room every port has for new connections."""
    server = bench.serve()
    peers = shapes.many_peers(_scaled(79))
    floods = shapes.idle_connections_of_many_peers(server, peers, _scaled(200) // 4)
    with ControlledSiege(server) as siege:
        open_together(floods)
        try:
            time.sleep(30.0)
            held = sum(flood.still_connected() for flood in floods)
        finally:
            for flood in floods:
                flood.close()
    figures = siege.figures()
    figures.update(
        tried=f"{len(peers)} peers x 4 ports x {_scaled(200) // 4} idle connections, 30 s",
        opened=sum(flood.count for flood in floods),
        refused_at_connect=sum(flood.refused for flood in floods),
        unanswered_at_connect=sum(flood.unanswered for flood in floods),
        held_after_30s=held,
    )
    return figures


def blocked_watchers(bench: Bench) -> dict:
    """8 new connections a second, each with 2 health Watch streams whose flow-control window stays 0, 30 s."""
    server = bench.serve()
    flood = BlockedWatchers(LOOPBACK, server.grpc_port, rate=8.0 * SCALE["factor"], max_connections=_scaled(240))
    with ControlledSiege(server, fresh_client_interval=FRESH_CLIENT_INTERVAL) as siege, flood:
        time.sleep(30.0)
    figures = siege.figures()
    figures.update(
        tried="8 connections a second x 2 Watch streams with windows 0, 30 s",
        watch_streams=flood.streams,
        ended_by_server=flood.ended_by_server(),
    )
    return figures


def _idle_connections(
    server: ServiceProcess,
    port: int,
    count: int,
    greeting: bytes,
    hold: float,
    credentials: grpc.ChannelCredentials | None = None,
) -> dict:
    """``count`` connections sending ``greeting`` then nothing, from another peer than the probes and the victim
    (``FLOOD_PEER``: another tenant's pod), watched for ``hold`` seconds (the server's own timeout plus 30 s): how
    many it held, for how long, what RSS each cost, and the probes meanwhile (the RPC port's over TLS with
    ``credentials``)."""
    idle = server.rss_bytes()
    with (
        ControlledSiege(server, victim=greeting == H2_PREFACE, grpc_credentials=credentials) as siege,
        IdleConnections(LOOPBACK, port, count, greeting, source=FLOOD_PEER) as flood,
    ):
        time.sleep(1.0)
        held, peak = flood.still_connected(), server.rss_bytes()
        start = time.monotonic()
        while flood.still_connected() and time.monotonic() - start < hold:
            time.sleep(1.0)
        left = flood.still_connected()
        all_closed_after = round(time.monotonic() - start + 1.0, 1) if not left else None
    figures = siege.figures()
    figures.update(
        connections=count,
        refused_at_connect=flood.refused,
        unanswered_at_connect=flood.unanswered,
        held_after_1s=held,
        all_closed_after_s=all_closed_after,
        still_open_at_end=left,
        rss_peak_mib=round(mib(peak), 1),
        rss_per_held_kib=round((peak - idle) / max(held, 1) / 1024, 1),
    )
    return figures


def _idle_preface_connections(bench: Bench, port_of: Callable[[ServiceProcess], int], where: str) -> dict:
    """15,000 connections to one of the server's gRPC ports that send the HTTP/2 preface and nothing else."""
    server = bench.serve()
    count = _scaled(15_000)
    figures = _idle_connections(server, port_of(server), count, H2_PREFACE, DEFAULT_IDLE_CONNECTION_SECONDS + 30.0)
    figures["tried"] = f"{count} idle gRPC connections (preface only) on the {where}"
    return figures


def idle_connections_grpc(bench: Bench) -> dict:
    """15,000 idle connections (preface only) on the RPC port."""
    return _idle_preface_connections(bench, lambda server: server.grpc_port, "RPC port")


def idle_connections_health(bench: Bench) -> dict:
    """15,000 idle connections (preface only) on the health port."""
    return _idle_preface_connections(bench, lambda server: server.health_port, "health port")


def tls_half_open(bench: Bench) -> dict:
    """15,000 connections to a TLS RPC port that send 11 bytes of a ClientHello and stall."""
    import tempfile

    import trustme

    with tempfile.TemporaryDirectory(prefix="attack-pki-") as folder:
        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        server = bench.serve("--tls-cert-file", str(cert), "--tls-key-file", str(key))
    count = _scaled(15_000)
    probe_credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
    figures = _idle_connections(server, server.grpc_port, count, CLIENT_HELLO_START, 150.0, probe_credentials)
    figures["tried"] = f"{count} TLS handshakes that stall after 11 bytes"
    return figures


ATTACKS: dict[str, Callable[[Bench], dict]] = {
    "stalled-streams": stalled_streams,
    "cpu-amplification": cpu_amplification,
    "rapid-reset": rapid_reset,
    "refused-flood": refused_flood,
    "expiring-flood": expiring_flood,
    "http-big-header": http_big_header,
    "http-idle": http_idle,
    "http-never-read": http_never_read,
    "shedding": shedding,
    "burst-rss": burst_rss,
    "drain-watchers": drain_watchers,
    "reflection-streams": reflection_streams,
    "blocked-watchers": blocked_watchers,
    "silent-unary-calls": silent_unary_calls,
    "undecodable-health": undecodable_health,
    "silent-watches": silent_watches,
    "http-trailers": http_trailers,
    "idle-connections-many-peers": idle_connections_many_peers,
    "idle-connections-grpc": idle_connections_grpc,
    "idle-connections-health": idle_connections_health,
    "tls-half-open": tls_half_open,
}


# --- the targets (--check) ------------------------------------------------------------------------------------

# docs/reliability.md's attack rows: every probe answered within 1 s (the issue's 99.9 %; 99 % for a row of a few
# seconds, as the bounded tests allow), the victim's small calls served (the issue's 99 % is over 30 s runs; a
# row's 50-130 calls on a shared 2-core machine get three misses of slack, as tests/system/test_hardening_abuse.py
# gives), RSS back within 1.2x of idle within 60 s, and no call answered INTERNAL or UNKNOWN.
PROBES_IN_TIME = 0.99
VICTIM_OK = 0.97
RAPID_RESET_VICTIM_OK = 0.95  # during the resets themselves (tests/system/test_hardening_abuse.py's bar)
HEADER_REFUSED_BEFORE_MIB = 4.0  # a 64 MiB header is refused within its first few MiB


def _siege_misses(figures: dict, victim: bool = True) -> list[str]:
    """What a siege's figures (testkit.siege) missed of the targets every attack shares."""
    misses = []
    if figures["probes_in_time_ratio"] < PROBES_IN_TIME:
        misses.append(f"probes in time {figures['probes_in_time_ratio']} < {PROBES_IN_TIME}: {figures['probes']}")
    if victim and figures["victim_ok_ratio"] < VICTIM_OK:
        misses.append(f"victim ok {figures['victim_ok_ratio']} < {VICTIM_OK}: {figures['victim_codes']}")
    faults = {code: n for code, n in figures["errors"].items() if code in ("INTERNAL", "UNKNOWN")}
    if faults:
        misses.append(f"calls answered {faults}")
    misses += [
        f"RSS not back within 60 s: {back}"
        for back in figures.get("memory_back", ())
        if not back.get("back_within_60s")
    ]
    return misses


def _rapid_reset_misses(figures: dict) -> list[str]:
    misses = _siege_misses(figures, victim=False)
    if figures["streams_reset"] < 4 * 5000:
        misses.append(f"only {figures['streams_reset']} streams reset: the attack did not run at size")
    if figures["victim_ok_ratio_during_attack"] < RAPID_RESET_VICTIM_OK:
        misses.append(
            f"victim ok during the resets {figures['victim_ok_ratio_during_attack']} < {RAPID_RESET_VICTIM_OK}"
        )
    return misses


def _big_header_misses(figures: dict) -> list[str]:
    misses = _siege_misses(figures)
    if not (figures["answer"] == 431 or (figures["answer"] is None and figures["closed_by_server"])):
        misses.append(f"answered {figures['answer']}, not 431 (closed by the server: {figures['closed_by_server']})")
    if figures["header_mib_sent"] >= HEADER_REFUSED_BEFORE_MIB:
        misses.append(f"{figures['header_mib_sent']} MiB of the header taken before the refusal")
    if not figures["http_refused"].get(HttpRefusal.HEADER_TOO_LARGE):
        misses.append(f"the refusal was not counted: {figures['http_refused']}")
    return misses


def _drain_misses(figures: dict) -> list[str]:
    misses = []
    if figures["exit_code"] != 0 or figures["exit_seconds"] > 15.0:  # shutdown_grace_seconds 10, and the exit
        misses.append(f"exit {figures['exit_code']} after {figures['exit_seconds']} s (want 0 within the grace)")
    if figures["in_flight_call"] != "OK":
        misses.append(f"the call in flight ended {figures['in_flight_call']}")
    for watcher in figures["watchers"]:
        if "NOT_SERVING" not in watcher["statuses"] or watcher["end"] is None:
            misses.append(f"a health Watch was not told NOT_SERVING and ended: {watcher}")
    return misses


def _shedding_misses(figures: dict) -> list[str]:
    misses = _siege_misses(figures, victim=False)
    codes = figures["caller_codes"]
    refused = sum(n for code, n in codes.items() if code != "OK")
    if set(codes) - {"OK", "RESOURCE_EXHAUSTED"}:
        misses.append(f"callers got {codes}: only OK and RESOURCE_EXHAUSTED expected")
    if not refused or sum(figures["shed"].values()) < refused:
        misses.append(f"{refused} refusals seen by the callers, {figures['shed']} counted as shed")
    return misses


TARGETS: dict[str, Callable[[dict], list[str]]] = {
    "rapid-reset": _rapid_reset_misses,
    "http-big-header": _big_header_misses,
    "drain-watchers": _drain_misses,
    "shedding": _shedding_misses,
}


def misses(name: str, figures: dict) -> list[str]:
    """The targets row ``name`` missed: its error if it failed to run, else what TARGETS says (none for a row
    without targets)."""
    if "error" in figures:
        return [f"failed to run: {figures['error']}"]
    try:
        return TARGETS[name](figures) if name in TARGETS else []
    except KeyError as exc:  # a figure the targets read is gone: the row changed under them
        return [f"figure {exc} missing"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    parser.add_argument("--only", action="append", choices=sorted(ATTACKS), help="run only this attack (repeatable)")
    parser.add_argument("--server-pythonpath", help="serve from this source tree (for 'before' figures)")
    parser.add_argument("--scale", type=float, default=1.0, help="size of the stream and connection floods")
    parser.add_argument(
        "--deployed-start",
        action="store_true",
        help="start each server with the default backend and warmup (its deployed idle RSS), not FAST_START",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a row missed its targets (TARGETS)")
    args = parser.parse_args(argv)
    SCALE["factor"] = args.scale
    bench = Bench(args.server_pythonpath, args.deployed_start)
    results: dict[str, dict] = {}
    try:
        for name in args.only or ATTACKS:
            print(f"== {name}", flush=True)
            try:
                results[name] = ATTACKS[name](bench)
                back = bench.memory_back()
                if back:  # empty where the attack ended its servers itself (it records its own)
                    results[name]["memory_back"] = back
            except Exception as exc:  # one attack's failure (a server that died) must not hide the others'
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            finally:
                bench.kill_all()
            print(json.dumps(results[name], default=str), flush=True)
    finally:
        bench.kill_all()
    write_json(args.out, {"server": args.server_pythonpath or os.getcwd(), "attacks": results})
    if not args.check:
        return 0
    missed = {name: m for name, figures in results.items() if (m := misses(name, figures))}
    for name in results:
        verdict = "met its targets" if name in TARGETS else "ran (no targets)"
        print(f"{name}: {'; '.join(missed[name]) if name in missed else verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
