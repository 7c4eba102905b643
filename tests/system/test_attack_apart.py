"""testkit.apart: an attacker in a process of its own, so that a flood's threads do not hold the probes' GIL."""

from __future__ import annotations

import os

import psutil

from testkit.apart import Apart
from testkit.harness import FAST_START, ServiceProcess, poll
from testkit.streams import SilentCalls


class NamesItsProcess:
    """An attacker that only notes where it ran."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.pid = 0

    def __enter__(self) -> NamesItsProcess:
        self.pid = os.getpid()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.label += " and stopped"


def test_the_attacker_runs_in_another_process_and_brings_back_what_it_keeps() -> None:
    apart = Apart(NamesItsProcess, "ran", keep=("pid", "label"))
    with apart:
        child = apart.pid
        assert psutil.pid_exists(child)
    assert apart.kept == {"pid": child, "label": "ran and stopped"}
    assert child != os.getpid() and not psutil.pid_exists(child)


def test_a_stream_flood_apart_reaches_the_server_and_reports_its_streams() -> None:
    with ServiceProcess(*FAST_START) as server:
        # Two connections of one stream each: a channel connects once its first call is made, so both connections
        # on the server mean both streams were opened (one connection alone left the second stream unopened).
        flood = Apart(SilentCalls, server.address, 2, 1, 0.1, keep=("opened", "ended"))
        with flood:
            connected = poll(lambda: server.connections_on(server.grpc_port) >= 2, 10.0)
            assert connected, "the flood never opened its two connections"
            assert poll(lambda: psutil.Process(flood.pid).is_running(), 1.0)
    assert flood.kept["opened"] >= 2, flood.kept
    assert set(flood.kept["ended"]) <= {"CANCELLED", "RESOURCE_EXHAUSTED", "OK"}, flood.kept
