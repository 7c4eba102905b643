"""Histograms and gauges of the per-call path whose updates take no lock (service/metrics.py uses them
in a single process; with workers, prometheus_client's own, which write the multiprocess files).

prometheus_client's Histogram takes a lock twice per observation (its sum, then its bucket) and its Gauge once per
``inc``/``dec``/``set``: a small BuildChunk touched nine of them before these, 9-10 us of its ~20 us in the data plane
measured in process (benchmarks/RESULTS.md, "issue 20 item 1"). Here a gauge of calls in progress is the length of a
list (:class:`GaugeChild`), and each thread that records into a histogram's child owns its cells (a list nobody else
writes), found through a ``threading.local``; a scrape sums every thread's cells. A lock is taken only when a thread
records into a child for the first time, which also folds the cells of threads that have ended into the child's base (so
the cells stay as many as the live threads, however often a pool replaces its threads), and by a scrape. The exposition
is prometheus_client's: the same samples, ``_created`` included.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class _Cells:
    """One child's cells: each recording thread's list (only it writes), and the base that ended threads' were
    folded into."""

    __slots__ = ("_base", "_local", "_lock", "_size", "_threads")

    def __init__(self, size: int) -> None:
        self._size = size
        self._local = threading.local()
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, list[float]]] = []
        self._base = [0.0] * size

    def mine(self) -> list[float]:
        """The calling thread's cells."""
        try:
            return self._local.cells
        except AttributeError:
            cells = self._local.cells = [0.0] * self._size
            with self._lock:
                self._fold_ended()
                self._threads.append((threading.current_thread(), cells))
            return cells

    def totals(self) -> list[float]:
        """Every thread's cells summed (a scrape; a thread may add to its cells meanwhile, as with any
        unlocked read: each cell is read once, whole)."""
        with self._lock:
            self._fold_ended()
            rows = [self._base, *(cells for _, cells in self._threads)]
        return [math.fsum(column) for column in zip(*rows, strict=True)]

    def _fold_ended(self) -> None:
        """Under the lock: the cells of threads that have ended (no writer left) added into the base."""
        ended = [cells for thread, cells in self._threads if not thread.is_alive()]
        if ended:
            self._threads = [(thread, cells) for thread, cells in self._threads if thread.is_alive()]
            for cells in ended:
                for i, value in enumerate(cells):
                    self._base[i] += value


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
    __slots__ = ("_bounds", "_cells", "_local", "created", "observe")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._cells = _Cells(len(bounds) + 1)  # a count per bucket (not cumulative), then the sum
        self._local = self._cells._local
        self.created = time.time()
        # ``observe(amount)``: the one way an observation is recorded, a group of this child alone.
        self.observe: Callable[[float], None] = ObservationGroup((self,)).observe

    def totals(self) -> tuple[list[float], float]:
        """Each bucket's count (not cumulative) and the sum."""
        cells = self._cells.totals()
        return cells[:-1], cells[-1]


class ObservationGroup:
    """Histogram children a call records into together: ``observe(*amounts)``, one amount per child in order, in
    one Python frame (~1 us of server CPU each under load: a small BuildChunk on the fast path records four). Each
    child's cells are the thread's, read here rather than through _Cells.mine() but on a thread's first record."""

    __slots__ = ("_children",)

    def __init__(self, children: Sequence[HistogramChild]) -> None:
        self._children = tuple(children)

    def observe(self, *amounts: float) -> None:
        for child, amount in zip(self._children, amounts, strict=True):
            try:
                cells = child._local.cells
            except AttributeError:
                cells = child._cells.mine()
            cells[bisect_left(child._bounds, amount)] += 1  # the first bucket whose bound is >= amount: le
            cells[-1] += amount


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
            for bound, count in zip(self._bounds, counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric(list(values), buckets, total)
            family.add_sample(f"{self._name}_created", dict(zip(self._labelnames, values, strict=True)), child.created)
        yield family


class GaugeChild:
    """A count of things in progress (calls in flight): ``inc()`` one more, ``dec()`` one fewer, by one only. The
    count is the length of a list that ``inc`` appends to and ``dec`` pops from: both are the list's own methods,
    C calls without a Python frame (each call of the service moves the gauge twice; a frame is ~1 us of server CPU
    under load, benchmarks/RESULTS.md, issue 20), and each is one step under the GIL, so no lock and no per-thread
    cells."""

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
