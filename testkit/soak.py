"""The soak of a real server, shared by tests/system/test_hardening_load.py (a short one) and
``python -m benchmarks.soak`` (the full one): a pool of generated requests with their verdicts, closed-loop
clients cycling through it, every answer judged, RSS and tail latency over the run."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import numpy as np

from indexer_service.service.codec import chunk_inputs_to_proto
from testkit.batches import make_inputs
from testkit.fuzzing import REQUESTS, Limits, Verdict, call_and_check, describe, judge, rng_draw, stubs_for
from testkit.harness import LoadRun, RssSampler, ServiceProcess, channel, closed_loop, mib, percentile_us

# Room for the benchmarks' medium batch (64 requests, ~8.9k query tokens); small enough to reach in a fuzz.
SOAK_LIMITS = Limits(
    max_num_seqs=256,
    max_num_batched_tokens=16_384,
    max_model_len=200_000,
    max_message_bytes=4 * 2**20,
    max_logits_bytes=2**20,
)
RSS_GROWTH_LIMIT = 0.05
P99_DRIFT_LIMIT = 2.0

Case = tuple[str, object, Verdict]


# A plan of thousands of one-row chunks costs the server seconds (a fuzz case, not a load).
MAX_SOAK_CHUNKS = 64


def request_pool(seed: int, size: int, limits: Limits) -> list[Case]:
    """Generated requests with their verdicts, judged once, each planned into at most MAX_SOAK_CHUNKS chunks;
    the medium batch every tenth entry."""
    rng = np.random.default_rng(seed)
    draw = rng_draw(rng)
    medium = chunk_inputs_to_proto(make_inputs("medium-64"))
    pool: list[Case] = []
    while len(pool) < size:
        if len(pool) % 10 == 0:
            pool.append(("BuildChunk", medium, judge("BuildChunk", medium, limits)))
            continue
        method = "BuildChunk" if rng.random() < 0.5 else "PlanBatch"
        request = REQUESTS[method](draw, limits)
        verdict = judge(method, request, limits)
        if verdict.chunks <= MAX_SOAK_CHUNKS:
            pool.append((method, request, verdict))
    return pool


@dataclass
class SoakReport:
    seconds: float
    in_flight: int
    calls: int
    calls_per_second: float
    codes: dict[str, int]
    unexpected: int
    examples: list[str]
    rss_warm_mib: float
    rss_end_mib: float
    rss_growth: float
    p99_first_us: float
    p99_last_us: float
    p99_drift: float
    rss_trace: list[tuple[float, float]] = field(default_factory=list)
    latency_trace: list[tuple[float, float]] = field(default_factory=list)

    @property
    def targets(self) -> dict[str, bool]:
        return {
            "0 unexpected answers": self.unexpected == 0,
            f"RSS growth < {RSS_GROWTH_LIMIT:.0%}": self.rss_growth < RSS_GROWTH_LIMIT,
            f"p99 last/first third <= {P99_DRIFT_LIMIT}x": self.p99_drift <= P99_DRIFT_LIMIT,
        }


def _report(run: LoadRun, sampler: RssSampler, seconds: float) -> SoakReport:
    third = seconds / 3
    first, last = run.latencies(0, third), run.latencies(2 * third)
    # The first third is the warm-up; the median of the second third is the baseline of the last one's.
    warm, end = sampler.median(third, 2 * third), sampler.median(2 * third)
    p99_first, p99_last = percentile_us(first, 99), percentile_us(last, 99)
    problems = run.problems()
    latencies = run.latencies()
    starts = np.array([r.start for r in run.records if r.code is grpc.StatusCode.OK])
    return SoakReport(
        seconds=run.elapsed,
        in_flight=run.in_flight,
        calls=len(run.records),
        calls_per_second=run.calls_per_second,
        codes=run.codes(),
        unexpected=len(problems),
        examples=[p.problem for p in problems[:5]],
        rss_warm_mib=mib(warm),
        rss_end_mib=mib(end),
        rss_growth=(end - warm) / warm,
        p99_first_us=p99_first,
        p99_last_us=p99_last,
        p99_drift=p99_last / p99_first,
        rss_trace=[(t, mib(r)) for t, r in sampler.samples],
        latency_trace=[(float(s), float(v * 1e6)) for s, v in zip(starts[::50], latencies[::50], strict=True)],
    )


def run_soak(server: ServiceProcess, seconds: float, in_flight: int, pool: list[Case]) -> SoakReport:
    """``in_flight`` clients cycling through ``pool`` for ``seconds``; every answer judged."""
    with channel(server.address) as chan:
        stubs = stubs_for(chan)

        def call(i: int) -> tuple[grpc.StatusCode, str]:
            method, request, verdict = pool[i % len(pool)]
            code, problem = call_and_check(stubs, method, request, verdict)
            return code, f"{method} {describe(request)}: {problem}" if problem else ""

        with RssSampler(server.pid, interval=0.25) as sampler:
            run = closed_loop(call, in_flight, max_calls=10**9, max_seconds=seconds)
    return _report(run, sampler, seconds)
