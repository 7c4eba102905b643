"""Issue 19 #4 under steady traffic: a flood of idle connections leaves, a caller goes on calling, and the memory
the connections held comes back (the idle trim runs once a flood's connections have left, not only in a quiet
spell). Before: with calls every 50 ms no trim ever ran, and RSS stayed at the flood's peak (90 of 90 MiB after
12 s, against 75 MiB now, idle 64)."""

from __future__ import annotations

import time

import pytest

from testkit.harness import LOOPBACK
from testkit.http1raw import IdleConnections
from testkit.observe import Callers
from testkit.payloads import BUILD_CHUNK_PATH, H2_PREFACE, SMALL_BUILD_CHUNK

pytestmark = pytest.mark.timeout(120)

CONNECTIONS = 1500  # above the trim's FLOOD_CONNECTIONS (256), under grpc_max_connections (2,000)


def test_a_connection_floods_memory_comes_back_while_calls_go_on(serve) -> None:
    server = serve("--idle-trim-seconds", "2", "--max-connections-per-peer", "0")  # one peer's flood, held whole
    call = (BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK.SerializeToString(), 1.0)
    with Callers(server.address, *call, pause=0.05) as caller:
        time.sleep(2.0)
        idle = server.rss_bytes()
        with IdleConnections(LOOPBACK, server.grpc_port, CONNECTIONS, H2_PREFACE) as flood:
            time.sleep(2.0)
            held, peak = flood.still_connected(), server.rss_bytes()
        deadline = time.monotonic() + 30.0
        while server.rss_bytes() - idle > (peak - idle) / 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        after = server.rss_bytes()
    assert held >= CONNECTIONS // 2, f"the flood did not take: {held} held"
    assert peak - idle > 8 * 2**20, f"the flood grew RSS by only {(peak - idle) >> 20} MiB: nothing to give back"
    assert after - idle <= (peak - idle) / 2, f"idle {idle >> 20}, peak {peak >> 20}, after {after >> 20} MiB"
    assert caller.run().codes() == {"OK": len(caller.run().records)}, caller.run().codes()
