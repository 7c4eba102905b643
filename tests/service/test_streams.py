"""StreamSlots (service/transport/streams.py): the per-connection and total caps of long-lived streams, and the one
bounded wait for a connection whose last stream the server has not yet released."""

from __future__ import annotations

import threading

from indexer_service.service.transport.streams import StreamSlots
from testkit.harness import wait_for

BOUND = 10.0  # seconds any wait below may take at most; none should come near it


def _take_on_thread(slots: StreamSlots, peer: str) -> tuple[threading.Thread, list[str | None]]:
    result: list[str | None] = []
    thread = threading.Thread(target=lambda: result.append(slots.take(peer)))
    thread.start()
    return thread, result


def test_without_a_lag_a_stream_over_its_connections_cap_is_refused_at_once() -> None:
    slots = StreamSlots("health Watch streams", 1)
    assert slots.take("a") is None
    assert slots.take("a") == "health Watch streams: this connection already has 1 open; close one first"
    assert slots.take("b") is None  # another connection's own cap
    assert slots.open == 2


def test_a_stream_over_its_cap_gets_the_slot_its_connection_releases_meanwhile() -> None:
    slots = StreamSlots("reflection streams", 1, total=4, lag_seconds=BOUND)
    assert slots.take("a") is None
    waiter, result = _take_on_thread(slots, "a")
    wait_for(lambda: slots._waiting, BOUND, "the second stream of a to wait")
    assert slots.take("b") is None  # other connections are not held up by the wait
    assert slots.take("a") is not None  # one wait at a time: a second stream over a cap is refused at once
    slots.give_back("a")  # the lagging release
    waiter.join(BOUND)
    assert not waiter.is_alive() and result == [None]
    assert slots.open == 2 and not slots._waiting


def test_a_stream_over_its_cap_is_refused_when_nothing_is_released_within_the_lag() -> None:
    slots = StreamSlots("reflection streams", 1, lag_seconds=0.05)
    assert slots.take("a") is None
    assert slots.take("a") == "reflection streams: this connection already has 1 open; close one first"
    assert slots.open == 1 and not slots._waiting
    slots.give_back("a")
    assert slots.take("a") is None


def test_the_total_is_refused_at_once_even_with_a_lag() -> None:
    slots = StreamSlots("reflection streams", 2, total=1, lag_seconds=BOUND)
    assert slots.take("a") is None
    assert slots.take("b") == "reflection streams: 1 streams open on this server; retry later"
