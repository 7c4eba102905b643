"""The lock-free per-call metrics (service/observability/threadmetrics.py) expose what prometheus_client's own would,
for the same observations from many threads, threads that ended included."""

from __future__ import annotations

import gc
import math
import threading
import time
import weakref

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from indexer_service.service.observability.metrics import LATENCY_BUCKETS
from indexer_service.service.observability.threadmetrics import FOLD_SECONDS, LevelGauge, ThreadGauge, ThreadHistogram


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """Every sample of the text exposition, but the ``_created`` timestamps (each family's own creation time)."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def same(ours: CollectorRegistry, theirs: CollectorRegistry) -> bool:
    """The same samples with the same values (sums to rounding: ours adds the queued amounts in batches)."""
    mine, reference = samples(ours), samples(theirs)
    return mine.keys() == reference.keys() and all(math.isclose(mine[k], reference[k]) for k in mine)


def test_thread_histogram_exposes_what_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = ThreadHistogram("x_seconds", "Help.", ["method", "code"], LATENCY_BUCKETS, ours)
    reference = Histogram("x_seconds", "Help.", ["method", "code"], buckets=LATENCY_BUCKETS, registry=theirs)
    values = [0.0, 0.0001, 0.00011, 0.003, 0.1, 9.99, 10.0, 11.0, 1e-9]  # bounds, between, above the last

    def record(n: int) -> None:
        for value in values:
            for method in ("BuildChunk", "PlanBatch"):
                mine.labels(method, "OK").observe(value * n)
                reference.labels(method, "OK").observe(value * n)

    threads = [threading.Thread(target=record, args=(n,)) for n in range(1, 9)]
    for thread in threads[:4]:  # these end before the others start
        thread.start()
        thread.join()
    for thread in threads[4:]:
        thread.start()
    for thread in threads[4:]:
        thread.join()
    record(1)  # and this thread's own
    assert same(ours, theirs)
    assert 'x_seconds_created{code="OK",method="BuildChunk"}' in generate_latest(ours).decode()


def test_thread_gauge_sums_every_threads_moves() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = ThreadGauge("in_flight", "Help.", ["method"], ours)
    reference = Gauge("in_flight", "Help.", ["method"], registry=theirs)
    entered, leave = threading.Barrier(5), threading.Event()

    def call() -> None:  # in, wait while the others are in too, out: as a call in the data plane
        for gauge in (mine, reference):
            gauge.labels("BuildChunk").inc()
        entered.wait(10)
        leave.wait(10)
        for gauge in (mine, reference):
            gauge.labels("BuildChunk").dec()

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    entered.wait(10)
    assert same(ours, theirs)
    assert samples(ours)[("in_flight", (("method", "BuildChunk"),))] == 4
    leave.set()
    for thread in threads:
        thread.join()
    assert samples(ours)[("in_flight", (("method", "BuildChunk"),))] == 0
    assert same(ours, theirs)


def test_children_by_position_or_by_name_are_the_same() -> None:
    histogram = ThreadHistogram("y_seconds", "Help.", ["method", "code"], LATENCY_BUCKETS, CollectorRegistry())
    assert histogram.labels("BuildChunk", "OK") is histogram.labels(code="OK", method="BuildChunk")
    for wrong in ((("BuildChunk",), {}), ((), {"method": "BuildChunk"}), (("BuildChunk",), {"code": "OK"})):
        with pytest.raises(ValueError):
            histogram.labels(*wrong[0], **wrong[1])


def test_level_gauge_exposes_its_last_value_as_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LevelGauge("held_bytes", "Help.", ours)
    reference = Gauge("held_bytes", "Help.", registry=theirs)
    assert same(ours, theirs)
    for value in (5, 1 << 40, 0, 3):
        mine.set(value)
        reference.set(value)
    assert same(ours, theirs)
    assert samples(ours)[("held_bytes", ())] == 3


def test_observations_queued_while_others_are_counted_are_never_lost() -> None:
    histogram = ThreadHistogram("z_seconds", "Help.", ["method"], LATENCY_BUCKETS, CollectorRegistry())
    child, per_thread, stop = histogram.labels("BuildChunk"), 20_000, threading.Event()

    def record() -> None:
        for _ in range(per_thread):
            child.observe(0.003)

    def count() -> None:  # a scrape, over and over, while the observations are made
        while not stop.is_set():
            child.totals()

    counter = threading.Thread(target=count)
    counter.start()
    threads = [threading.Thread(target=record) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    counter.join()
    counts, total = child.totals()
    assert sum(counts) == 4 * per_thread and counts[LATENCY_BUCKETS.index(0.005)] == 4 * per_thread
    assert total == pytest.approx(4 * per_thread * 0.003)


def test_queued_observations_are_counted_without_a_scrape() -> None:
    # The module's fold thread keeps the queue to about a second of observations where nothing scrapes.
    child = ThreadHistogram("w_seconds", "Help.", [], LATENCY_BUCKETS, CollectorRegistry()).labels()
    for _ in range(1000):
        child.observe(0.5)
    deadline = time.monotonic() + 5 * FOLD_SECONDS
    while len(child._queued) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child._queued
    assert sum(child.totals()[0]) == 1000


def test_a_fold_that_fails_is_logged_and_the_others_go_on(caplog) -> None:
    registry = CollectorRegistry()
    broken = ThreadHistogram("v_seconds", "Help.", [], LATENCY_BUCKETS, registry).labels()
    child = ThreadHistogram("u_seconds", "Help.", [], LATENCY_BUCKETS, registry).labels()
    broken.observe("not a number")  # no caller does this; the fold thread must survive it all the same
    child.observe(0.5)
    failed = "queued observations failed"
    deadline = time.monotonic() + 5 * FOLD_SECONDS
    # the queues empty before the failure is logged (the fold takes the amounts, then fails): wait for both
    while (child._queued or failed not in caplog.text) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child._queued and failed in caplog.text
    child.observe(0.5)  # and the thread still folds afterwards
    deadline = time.monotonic() + 5 * FOLD_SECONDS
    while child._queued and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child._queued and sum(child.totals()[0]) == 2


def test_the_fold_thread_keeps_no_dropped_child() -> None:
    child = ThreadHistogram("t_seconds", "Help.", [], LATENCY_BUCKETS, CollectorRegistry()).labels()
    child.observe(0.5)
    deadline = time.monotonic() + 5 * FOLD_SECONDS
    while child._queued and time.monotonic() < deadline:  # a fold has held it
        time.sleep(0.05)
    gone = weakref.ref(child)
    del child
    deadline = time.monotonic() + 5 * FOLD_SECONDS
    while gc.collect() >= 0 and gone() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone() is None
