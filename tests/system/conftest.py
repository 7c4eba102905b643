"""Fixtures of the system tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.harness import FAST_START, ServiceProcess


@pytest.fixture
def serve() -> Iterator:
    """``serve(*flags)``: a ready FAST_START server with these flags, killed after the test."""
    started: list[ServiceProcess] = []

    def start(*flags: str) -> ServiceProcess:
        server = ServiceProcess(*FAST_START, *flags)
        started.append(server)
        return server.__enter__()

    yield start
    for server in started:
        server.kill()
