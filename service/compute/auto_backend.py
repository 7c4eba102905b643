"""``backend = auto`` on a CUDA machine: each request on the backend that is faster for its size.

The Triton backend pays a fixed round trip (program table, a copy each way, a launch, a wait) that numpy does not,
and wins only once the arrays are large enough that the GPU's speed and numpy's per-element cost dominate. Where
that happens depends on the machine (CPU, GPU, PCIe, load), so the warmup measures it: both backends build the
same synthetic chunks of growing size, and the crossover is the smallest measured size from which Triton was faster
at every larger size. Requests whose answer holds at least that many int32 elements go to Triton, the rest to
numpy (and BuildChunk's compiled fast path keeps serving the numpy side). No measurement (warmup disabled, or the
measurement failed): numpy for everything, which is always correct.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from indexer_service.kernels.inputs import ChunkHostPart, ChunkInputs, DcpConfig, chunk_host_part
from indexer_service.kernels.specialization import CompileKey

log = logging.getLogger(__name__)

B = TypeVar("B")  # a backend as the data plane holds it (name and arrays_many)

# Request counts of the calibration ladder: R requests of about 256 query tokens and 128 * R tokens of context
# each, so the answer grows about 4x per step (R = 256 is bench_kernel's large batch).
LADDER_REQUESTS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
CALIBRATION_REPEATS = 5
NOT_MEASURED = 0  # GetWarmupStatus.auto_crossover_elements: not auto, or no measurement
NUMPY_ALWAYS = -1  # Triton was slower at every measured size


def output_elements(hosts: Sequence[ChunkHostPart], with_token_to_seq: bool) -> int:
    """int32 elements a request's arrays hold: what both backends' cost grows with."""
    rows = sum(host.query_slice[1] - host.query_slice[0] for host in hosts)
    return 2 * rows + (sum(host.total for host in hosts) if with_token_to_seq else 0)


@dataclass(frozen=True)
class CalibrationPoint:
    requests: int
    elements: int
    numpy_us: float
    triton_us: float


def crossover_of(points: Sequence[CalibrationPoint]) -> int:
    """The smallest measured size from which Triton was faster at every larger one; NUMPY_ALWAYS if none."""
    crossover = NUMPY_ALWAYS
    for point in sorted(points, key=lambda p: p.elements, reverse=True):
        if point.triton_us >= point.numpy_us:
            break
        crossover = point.elements
    return crossover


def batch_with_tokens(
    rng: np.random.Generator, num_requests: int, query_tokens: int, context_per_request: int
) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic batch of ``num_requests`` whose query lengths add up to about ``query_tokens``, each request
    with about ``context_per_request`` tokens of context: what the calibration times (the benchmarks' batches
    are made the same way, testkit/batches.py)."""
    weights = rng.random(num_requests) + 0.5
    query_lens = np.maximum(1, np.round(weights / weights.sum() * query_tokens)).astype(np.int64)
    qsl = np.zeros(num_requests + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    context = rng.integers(context_per_request // 2, context_per_request * 3 // 2 + 1, num_requests)
    return qsl, (query_lens + context).astype(np.int32)


def calibration_chunk(requests: int, ratio: int) -> ChunkInputs:
    qsl, seq = batch_with_tokens(np.random.default_rng(requests), requests, 256 * requests, 128 * requests)
    return ChunkInputs(qsl, seq, ratio, 0, requests)


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


class AutoSelector(Generic[B]):
    """Picks numpy or Triton per request from the crossover measured by :meth:`calibrate`."""

    def __init__(
        self,
        numpy_backend: B,
        triton_backend: B,
        numpy_arrays: Callable[..., object],
        triton_arrays: Callable[..., object],
    ) -> None:
        self.numpy = numpy_backend
        self.triton = triton_backend
        self._numpy_arrays = numpy_arrays
        self._triton_arrays = triton_arrays
        self.crossover = NOT_MEASURED
        self.points: tuple[CalibrationPoint, ...] = ()
        self._lock = threading.Lock()

    def choose(self, hosts: Sequence[ChunkHostPart], with_token_to_seq: bool) -> B:
        crossover = self.crossover
        if crossover > 0 and output_elements(hosts, with_token_to_seq) >= crossover:
            return self.triton
        return self.numpy

    def fast_path_bytes(self, limit: int) -> int:
        """The largest answer BuildChunk's numpy fast path may give: larger ones belong to Triton."""
        crossover = self.crossover
        return min(limit, 4 * crossover) if crossover > 0 else limit

    def calibrate(self, keys: Sequence[CompileKey], ladder: Sequence[int] = LADDER_REQUESTS) -> int:
        """Measure both backends on the ladder (one of ``keys``' ratios, 4 where the model has it) and set the
        crossover; returns it. Runs in the warmup, before ready, after the keys compiled and proved."""
        ratios = [key.compress_ratio for key in keys]
        ratio = 4 if 4 in ratios else (ratios[0] if ratios else 1)
        dcp = DcpConfig()
        points = []
        start = time.perf_counter()
        with self._lock:
            for requests in ladder:
                host = chunk_host_part(calibration_chunk(requests, ratio))
                elements = output_elements([host], True)

                def numpy_call(host=host):
                    return self._numpy_arrays([host], dcp, True)

                def triton_call(host=host):
                    return self._triton_arrays([host], dcp, True)

                numpy_call(), triton_call()  # first touches: buffers, streams, caches
                # Alternate, so that a noisy moment hits both; the median of each.
                numpy_times, triton_times = [], []
                for _ in range(CALIBRATION_REPEATS):
                    numpy_times.append(_median_us(numpy_call, 1))
                    triton_times.append(_median_us(triton_call, 1))
                numpy_us, triton_us = float(np.median(numpy_times)), float(np.median(triton_times))
                points.append(CalibrationPoint(requests, elements, numpy_us, triton_us))
            self.points = tuple(points)
            self.crossover = crossover_of(points)
        table = " ".join(f"{p.elements}:{p.numpy_us:.0f}/{p.triton_us:.0f}us" for p in points)
        if self.crossover > 0:
            log.info(
                "auto backend: triton from %d output elements, numpy below (ratio %d, %.3f s; elements:numpy/"
                "triton %s)",
                self.crossover,
                ratio,
                time.perf_counter() - start,
                table,
            )
        else:
            log.info(
                "auto backend: numpy for every size, triton was never faster (ratio %d; elements:numpy/triton %s)",
                ratio,
                table,
            )
        return self.crossover

    def describe(self) -> str:
        if self.crossover > 0:
            return f"triton from {self.crossover} output elements, numpy below"
        return "numpy for every size" + (" (not measured)" if self.crossover == NOT_MEASURED else "")


__all__ = ["NOT_MEASURED", "NUMPY_ALWAYS", "AutoSelector", "CalibrationPoint", "crossover_of", "output_elements"]
