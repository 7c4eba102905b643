"""A flood of calls to methods the server does not have costs only the connections that send them: each is
answered UNIMPLEMENTED on the refusal pool, counted as method ``unknown``, and never takes an RPC thread or a
place under ``max_concurrent_rpcs`` (where it would get a well-behaved caller's calls shed as ``concurrency``).
"""

from __future__ import annotations

import time

import pytest

from testkit.observe import Callers
from testkit.siege import ERRORS, Siege, counter_delta

pytestmark = pytest.mark.timeout(120)

FLOODERS = 10
FLOOD_SECONDS = 3.0


def test_unknown_methods_take_no_rpc_thread_and_no_place_under_the_concurrency_limit(serve) -> None:
    """Two RPC threads and room for two calls: the victim's one call at a time always fits, unless the unknown
    methods held places too. Before: they ran on the RPC pool, and the victim's calls were shed ``concurrency``
    while 10 connections looped an unknown method."""
    server = serve("--grpc-workers", "2", "--max-concurrent-rpcs", "2")
    with Siege(server) as siege, Callers(server.address, "/no.Such/Method", b"", 10.0, FLOODERS, 0.0) as flood:
        time.sleep(FLOOD_SECONDS)
    refused = flood.run().codes()
    assert refused.get("UNIMPLEMENTED", 0) >= 10 * FLOODERS and set(refused) == {"UNIMPLEMENTED"}, refused
    assert siege.shed().get("concurrency", 0) == 0, siege.figures()
    assert siege.victim_ok_ratio() == 1.0, siege.figures()
    # Every unknown call counted, under method "unknown" (the counter's labels: method, code).
    unknown = counter_delta(siege.metrics_before, siege.metrics_after, ERRORS, "method").get("unknown", 0)
    assert unknown >= refused["UNIMPLEMENTED"], (unknown, refused)
