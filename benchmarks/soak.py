"""Soak and long fuzz of a real server on 127.0.0.1: is every answer right, does memory stay flat, does the
tail latency stay put.

    python -m benchmarks.soak [--seconds 60] [--in-flight 32] [--fuzz 100000] [--out soak.json] [--plot soak.png]

Soak: ``--in-flight`` clients send, for ``--seconds``, requests drawn from a pool of generated ones (valid and
invalid, see testkit/fuzzing.py) plus the benchmarks' medium batch; the oracle judges every answer.
Baselines from the same run: the server's median RSS over the second third (the first is warm-up) and the p99
latency of the first third. Targets: 0 unexpected answers, median RSS of the last third under 5 % above the
baseline, p99 of the last third at most 2x the first third's.

Fuzz: ``--fuzz`` freshly generated requests (none repeated) on a second server with the fuzz tests' smaller
limits, every answer judged; the server's idle RSS after the first tenth (warm-up) against its idle RSS at the
end. Exit status 1 when any target is missed.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from testkit.fuzzing import (
    FUZZ_LIMITS,
    REQUESTS,
    Limits,
    call_and_check,
    describe,
    judge,
    rng_draw,
    stubs_for,
)
from testkit.harness import (
    FAST_START,
    RssSampler,
    ServiceProcess,
    channel,
    clean_env,
    closed_loop,
    mib,
)
from testkit.record import write_json
from testkit.soak import RSS_GROWTH_LIMIT, SOAK_LIMITS, SoakReport, request_pool, run_soak


@dataclass
class FuzzReport:
    requests: int
    seconds: float
    codes: dict[str, int]
    unexpected: int
    examples: list[str]
    idle_rss_mib: list[tuple[int, float]]  # (requests sent so far, idle RSS) at each checkpoint

    @property
    def rss_warm_mib(self) -> float:
        return self.idle_rss_mib[0][1]

    @property
    def rss_end_mib(self) -> float:
        return self.idle_rss_mib[-1][1]

    @property
    def rss_growth(self) -> float:
        return (self.rss_end_mib - self.rss_warm_mib) / self.rss_warm_mib

    @property
    def targets(self) -> dict[str, bool]:
        return {
            "0 unexpected answers": self.unexpected == 0,
            f"RSS growth < {RSS_GROWTH_LIMIT:.0%}": self.rss_growth < RSS_GROWTH_LIMIT,
        }


# Where the fuzz pauses to read the server's idle RSS, as shares of its requests: the first is the warm-up's
# end and the baseline; the ones between tell a plateau (allocator) from a steady climb (a leak).
FUZZ_CHECKPOINTS = (0.1, 0.4, 0.7, 1.0)


def idle_rss(server: ServiceProcess, settle: float = 1.0) -> float:
    """Median RSS over ``settle`` seconds with no call in flight: what the process kept, not what it is using."""
    with RssSampler(server.pid, interval=0.1) as sampler:
        time.sleep(settle)
    return sampler.median(0.0)


def run_fuzz(
    server: ServiceProcess, count: int, seed: int, limits: Limits, in_flight: int = 4, max_seconds: float = 3600.0
) -> FuzzReport:
    """``count`` fresh generated requests, each judged; the server's idle RSS at each of FUZZ_CHECKPOINTS."""
    # One generator per client thread: numpy generators are not thread-safe.
    draws = [rng_draw(np.random.default_rng([seed, n])) for n in range(in_flight)]

    with channel(server.address) as chan:
        stubs = stubs_for(chan)

        def call(i: int) -> tuple[grpc.StatusCode, str]:
            draw = draws[threading_index()]
            method = "BuildChunk" if i % 2 else "PlanBatch"
            request = REQUESTS[method](draw, limits)
            code, problem = call_and_check(stubs, method, request, judge(method, request, limits))
            return code, f"{method} {describe(request)}: {problem}" if problem else ""

        records, idle, sent, elapsed = [], [], 0, 0.0
        for share in FUZZ_CHECKPOINTS:
            run = closed_loop(call, in_flight, max_calls=round(count * share) - sent, max_seconds=max_seconds)
            records += run.records
            sent, elapsed = len(records), elapsed + run.elapsed
            idle.append((sent, mib(idle_rss(server))))
    problems = [r for r in records if r.problem]
    codes: dict[str, int] = {}
    for r in records:
        codes[r.code.name] = codes.get(r.code.name, 0) + 1
    return FuzzReport(len(records), elapsed, codes, len(problems), [p.problem for p in problems[:5]], idle)


def threading_index() -> int:
    """The load thread's number (threads are named load-<n> by ``closed_loop``)."""
    return int(threading.current_thread().name.rsplit("-", 1)[1])


def _print_targets(targets: dict[str, bool]) -> bool:
    for name, met in targets.items():
        print(f"  target {name}: {'met' if met else 'MISSED'}")
    return all(targets.values())


def _plot(report: SoakReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t, rss = zip(*report.rss_trace, strict=True)
    top.plot(t, rss)
    top.set_ylabel("server RSS (MiB)")
    top.axvline(report.seconds / 3, color="grey", linestyle=":")
    s, lat = zip(*report.latency_trace, strict=True)
    bottom.plot(s, np.array(lat) / 1e3, ".", markersize=2)
    bottom.set_ylabel("latency of OK calls (ms)")
    bottom.set_xlabel("seconds")
    bottom.set_yscale("log")
    fig.suptitle(f"soak: {report.in_flight} in flight, {report.calls:,} calls, {report.unexpected} unexpected")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def soak_phase(args: argparse.Namespace, env: dict[str, str], results: dict[str, object]) -> bool:
    pool = request_pool(args.seed, args.pool, SOAK_LIMITS)
    with ServiceProcess(*FAST_START, *SOAK_LIMITS.flags(), env=env) as server:
        soak = run_soak(server, args.seconds, args.in_flight, pool)
        alive = server.process.poll() is None
    print(
        f"soak: {soak.calls:,} calls in {soak.seconds:.1f} s at {soak.in_flight} in flight "
        f"({soak.calls_per_second:,.0f}/s), codes {soak.codes}"
    )
    print(f"  unexpected answers: {soak.unexpected}")
    for example in soak.examples:
        print(f"    {example[:300]}")
    print(
        f"  median RSS second third {soak.rss_warm_mib:.1f} MiB, last third {soak.rss_end_mib:.1f} MiB: "
        f"growth {soak.rss_growth:+.2%}"
    )
    print(
        f"  p99 first third {soak.p99_first_us:,.0f} us, last third {soak.p99_last_us:,.0f} us: "
        f"{soak.p99_drift:.2f}x the baseline"
    )
    print(f"  server alive at the end: {alive}")
    results["soak"] = asdict(soak) | {"targets": soak.targets, "alive": alive}
    if args.plot:
        _plot(soak, args.plot)
    return _print_targets(soak.targets | {"server alive": alive})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the soak (0: none)")
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--pool", type=int, default=400, help="distinct requests the soak cycles through")
    parser.add_argument("--fuzz", type=int, default=100_000, help="fresh requests of the fuzz (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--plot", type=Path, help="write RSS and latency over time as a PNG here")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment of the servers, e.g. MALLOC_ARENA_MAX=2 (repeatable)",
    )
    args = parser.parse_args()

    env = clean_env(**dict(item.split("=", 1) for item in args.server_env))
    results: dict[str, object] = {"limits": asdict(SOAK_LIMITS), "server_env": args.server_env}
    ok = True
    if args.seconds > 0:
        ok &= soak_phase(args, env, results)
    if args.fuzz:
        with ServiceProcess(*FAST_START, *FUZZ_LIMITS.flags(), env=env) as server:
            fuzz = run_fuzz(server, args.fuzz, args.seed, FUZZ_LIMITS)
            alive = server.process.poll() is None
        print(f"fuzz: {fuzz.requests:,} fresh requests in {fuzz.seconds:.1f} s, codes {fuzz.codes}")
        print(f"  unexpected answers: {fuzz.unexpected}")
        for example in fuzz.examples:
            print(f"    {example[:300]}")
        trace = ", ".join(f"{n:,}: {rss:.1f}" for n, rss in fuzz.idle_rss_mib)
        print(f"  idle RSS (MiB) after requests {trace}; growth after the first tenth {fuzz.rss_growth:+.2%}")
        print(f"  server alive at the end: {alive}")
        ok &= _print_targets(fuzz.targets | {"server alive": alive})
        results["fuzz"] = asdict(fuzz) | {"rss_growth": fuzz.rss_growth, "targets": fuzz.targets, "alive": alive}
    write_json(args.out, results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
