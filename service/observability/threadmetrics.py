"""Histograms and gauges of the per-call path whose updates take no lock and run no Python frame
(service/observability/metrics.py uses them in a single process; with workers, prometheus_client's own, which write the
multiprocess files).

prometheus_client's Histogram takes a lock twice per observation (its sum, then its bucket) and its Gauge once per
``inc``/``dec``/``set``; a small BuildChunk touches nine of them, a large share of its time in the data plane
(docs/performance.md). Here an observation is appended to the child's queue of amounts not yet counted (``observe``
is the deque's own ``append``: a C call, one step under the GIL), and the amounts are counted into buckets and the
sum, in bulk, by whoever reads the child (a scrape) and by a fold every :data:`FOLD_SECONDS` on a thread of this
module, so the queue holds at most about a second of observations whether anything scrapes or not. A gauge of calls
in progress is the length of a list (:class:`GaugeChild`). The exposition is prometheus_client's: the same samples,
``_created`` included.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import weakref
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

log = logging.getLogger(__name__)

# How often the queued observations of every histogram child are counted when nothing reads them.
FOLD_SECONDS = 1.0


class _Family:
    """What both kinds share: a name, help, label names, children by label values, registered on a registry."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def labels(self, *values: str, **by_name: str) -> object:
        """The child of ``values`` (in the order of the label names) or ``by_name``, as prometheus_client's
        ``labels``; made on first use."""
        if by_name:
            if values or set(by_name) != set(self._labelnames):
                raise ValueError(f"{self._name}: labels {self._labelnames}, by position or by name; got {by_name!r}")
            values = tuple(by_name[name] for name in self._labelnames)
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: {len(self._labelnames)} label values expected, got {values!r}")
        values = tuple(str(v) for v in values)
        with self._lock:
            child = self._children.get(values)
            if child is None:
                child = self._children[values] = self._child()
        return child

    def _child(self) -> object:
        raise NotImplementedError

    def _items(self) -> list[tuple[tuple[str, ...], object]]:
        with self._lock:
            return list(self._children.items())

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class HistogramChild:
    """One label set's histogram. ``observe(amount)`` queues the amount (the deque's ``append``, a C call: four per
    small BuildChunk on the fast path, where a Python frame each would cost more than the observation,
    docs/performance.md); :meth:`totals` counts what is queued, then answers. One counting at a time (the child's
    lock); the amounts are taken off the queue one ``popleft`` each, so an amount appended meanwhile stays queued for
    the next, never lost."""

    __slots__ = ("__weakref__", "_bounds", "_counts", "_lock", "_queued", "_sum", "created", "observe")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        self._queued: deque[float] = deque()
        self.observe: Callable[[float], None] = self._queued.append
        self.created = time.time()
        _FOLDER.add(self)

    def fold(self) -> None:
        """Count the queued amounts into the buckets and the sum."""
        with self._lock:
            take = self._queued.popleft
            amounts = [take() for _ in range(len(self._queued))]
            if amounts:
                # the first bucket whose bound is >= the amount: le
                for bucket, count in Counter(map(functools.partial(bisect_left, self._bounds), amounts)).items():
                    self._counts[bucket] += count
                self._sum += math.fsum(amounts)

    def totals(self) -> tuple[list[int], float]:
        """Each bucket's count (not cumulative) and the sum, what was queued included."""
        self.fold()
        with self._lock:
            return list(self._counts), self._sum


class _Folder:
    """The thread that counts every live histogram child's queued observations each :data:`FOLD_SECONDS`, started
    with the first child; children are held weakly (a registry that is dropped takes its children with it)."""

    def __init__(self) -> None:
        self._children: weakref.WeakSet[HistogramChild] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, child: HistogramChild) -> None:
        with self._lock:
            self._children.add(child)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="metrics-fold", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(FOLD_SECONDS)
            self._fold_all()

    def _fold_all(self) -> None:
        """A function of its own so that no child outlives it in the loop's frame (a dropped registry's children go
        while the thread sleeps). A failed fold is logged and the others still run: the thread must not end."""
        with self._lock:
            children = list(self._children)
        for child in children:
            try:
                child.fold()
            except Exception:
                log.exception("counting a histogram's queued observations failed")


_FOLDER = _Folder()


def bucket_labels(bounds: Sequence[float]) -> tuple[str, ...]:
    """The ``le`` label of each of ``bounds`` (the last one infinite), as prometheus_client's own Histogram writes it:
    read off one, unregistered, through its public ``collect``. With workers that Histogram serves these series, so
    the labels must be the same. Made only where no multiprocess directory is named (service/observability/metrics.py
    ``per_call_histogram``): there a Histogram's values live in this process's memory, not in a file."""
    histogram = Histogram("bounds", "", buckets=bounds, registry=None)
    (family,) = histogram.collect()
    return tuple(sample.labels["le"] for sample in family.samples if sample.name.endswith("_bucket"))


class ThreadHistogram(_Family):
    """A histogram (``labels(...).observe(v)``) whose observations take no lock."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._bounds = (*sorted(float(b) for b in buckets if b != math.inf), math.inf)
        self._le = bucket_labels(self._bounds)
        super().__init__(name, documentation, labelnames, registry)

    def _child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in self._items():
            counts, total = child.totals()
            cumulative, buckets = 0.0, []
            for le, count in zip(self._le, counts, strict=True):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(values), buckets, total)
            family.add_sample(f"{self._name}_created", dict(zip(self._labelnames, values, strict=True)), child.created)
        yield family


class GaugeChild:
    """A count of things in progress (calls in flight): ``inc()`` one more, ``dec()`` one fewer, by one only. The
    count is the length of a list that ``inc`` appends to and ``dec`` pops from: both are the list's own methods,
    C calls without a Python frame (each call of the service moves the gauge twice: docs/performance.md), and each
    is one step under the GIL, so no lock and no per-thread cells."""

    __slots__ = ("_moves", "dec", "inc")

    def __init__(self) -> None:
        self._moves: list[None] = []
        self.inc: Callable[[], None] = functools.partial(self._moves.append, None)
        self.dec: Callable[[], object] = self._moves.pop

    def value(self) -> float:
        return float(len(self._moves))


class ThreadGauge(_Family):
    """An up-down gauge of things in progress (``labels(...).inc()`` / ``.dec()``, by one; no ``set``) whose
    updates take no lock."""

    def _child(self) -> GaugeChild:
        return GaugeChild()

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in self._items():
            family.add_metric(list(values), child.value())
        yield family


class LevelGauge:
    """An unlabelled gauge whose ``set`` takes no lock: the value is one list item, stored whole (its writers are
    ordered by a lock of their own: the response budget's). ``set(value)`` is the list's ``__setitem__`` bound to
    item 0, a C call without a Python frame (the budget sets it twice per call)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._value = [0.0]
        self.set: Callable[[float], None] = functools.partial(self._value.__setitem__, 0)
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, self._documentation, value=float(self._value[0]))
