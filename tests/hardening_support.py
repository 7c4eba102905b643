"""Helpers of the hardening and fuzz tests: what the server's own metrics say during and after a test."""

from __future__ import annotations

import time

import pytest

from benchmarks.harness import ServiceProcess, metric_total, scrape

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
