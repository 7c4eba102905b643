"""A bounded soak in CI: benchmarks/soak.py's load for 12 s at 16 in flight against a real server. The 60 s,
32-in-flight version and the 100k-request fuzz are ``python -m benchmarks.soak``."""

from __future__ import annotations

from testkit.harness import FAST_START, ServiceProcess
from testkit.soak import SOAK_LIMITS, request_pool, run_soak
from tests.system.hardening_support import assert_healthy_after

SECONDS, IN_FLIGHT, POOL = 12.0, 16, 200


def test_bounded_soak() -> None:
    pool = request_pool(seed=1, size=POOL, limits=SOAK_LIMITS)
    with ServiceProcess(*FAST_START, *SOAK_LIMITS.flags()) as server:
        report = run_soak(server, SECONDS, IN_FLIGHT, pool)
        assert_healthy_after(server)
    summary = (
        f"{report.calls} calls, codes {report.codes}, RSS {report.rss_warm_mib:.1f} -> {report.rss_end_mib:.1f} MiB, "
        f"p99 {report.p99_first_us:.0f} -> {report.p99_last_us:.0f} us"
    )
    # Enough calls that each third's p99 rests on more than a handful of samples.
    assert report.calls >= 1500, summary
    assert report.codes.get("OK", 0) >= report.calls // 4, summary
    assert report.unexpected == 0, f"{summary}; first: {report.examples}"
    missed = [name for name, met in report.targets.items() if not met]
    assert not missed, f"missed {missed}: {summary}"
