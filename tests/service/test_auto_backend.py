"""``backend = auto`` without a GPU: the crossover rule, the per-request choice, the fast path's bound, the
metrics label and GetWarmupStatus (a fake "triton" side stands in for the GPU). On a CPU machine auto is numpy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs, chunk_host_part
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy_many
from indexer_service.kernels.specialization import CompileKey
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service.codec import chunk_inputs_to_proto
from indexer_service.service.compute import _fastpath, auto_backend
from indexer_service.service.compute.auto_backend import (
    NOT_MEASURED,
    NUMPY_ALWAYS,
    AutoSelector,
    CalibrationPoint,
    calibration_chunk,
    crossover_of,
    output_elements,
)
from indexer_service.service.compute.backends import FAST_PATH_BACKEND, Backend, below_crossover
from indexer_service.service.compute.devices import resolve_backend
from indexer_service.service.config import load_config
from testkit.planes import make_plane
from tests.conftest import cuda_available


def point(elements: int, numpy_us: float, triton_us: float) -> CalibrationPoint:
    return CalibrationPoint(0, elements, numpy_us, triton_us)


def test_crossover_is_the_smallest_size_from_which_triton_always_won() -> None:
    assert crossover_of([point(10, 1, 5), point(100, 5, 6), point(1000, 50, 20), point(10_000, 500, 90)]) == 1000
    # A win below a loss does not count: only the run of wins up to the largest size.
    assert crossover_of([point(10, 5, 1), point(100, 5, 6), point(1000, 50, 20)]) == 1000
    assert crossover_of([point(10, 1, 5), point(100, 5, 6)]) == NUMPY_ALWAYS
    assert crossover_of([point(10, 9, 5), point(100, 50, 6)]) == 10


def test_output_elements_count_rows_twice_and_tokens_when_wanted() -> None:
    host = chunk_host_part(ChunkInputs(np.array([0, 2, 5]), np.array([40, 30]), 4, 0, 2))
    assert output_elements([host], True) == 2 * 5 + 10 + 7
    assert output_elements([host, host], False) == 2 * 2 * 5


def _selector(crossover: int) -> AutoSelector:
    numpy_backend = Backend("numpy", chunk_arrays_numpy_many)
    triton_backend = Backend("triton", chunk_arrays_numpy_many)  # stands in for the GPU: same answers
    selector = AutoSelector(numpy_backend, triton_backend, numpy_backend.arrays_many, triton_backend.arrays_many)
    selector.crossover = crossover
    return selector


def test_choice_follows_the_crossover_and_bounds_the_fast_path() -> None:
    small = chunk_host_part(ChunkInputs(np.array([0, 2]), np.array([40]), 4, 0, 1))  # 14 elements
    big = chunk_host_part(ChunkInputs(np.array([0, 200]), np.array([40_000]), 4, 0, 1))  # 10,400
    selector = _selector(1000)
    assert selector.choose([small], True).name == "numpy" and selector.choose([big], True).name == "triton"
    assert selector.fast_path_bytes(2**20) == 4000 and selector.fast_path_bytes(100) == 100
    for unmeasured in (NOT_MEASURED, NUMPY_ALWAYS):
        selector.crossover = unmeasured
        assert selector.choose([big], True).name == "numpy" and selector.fast_path_bytes(2**20) == 2**20


LADDER = (2, 4, 8, 16, 32)


class Stopwatch:
    """The clock calibrate reads (auto_backend's time.perf_counter), moved only by the fake backends: each call
    costs what the test's cost table says, so the measured figures, and the crossover, are known in advance."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def calibrated(monkeypatch, costs: dict[int, tuple[float, float]], spike: int | None = None):
    """A selector calibrated on LADDER with fake backends: both build the real numpy arrays; a call on a chunk of
    R requests costs ``costs[R]`` (numpy us, Triton us) on the stopwatch. Each backend's first call of a rung
    (calibrate's untimed first touch) costs a second; with ``spike``, one timed Triton call of that rung costs 100
    times its price (a noisy moment). Returns the selector and the int32 elements each rung's arrays held."""
    clock = Stopwatch()
    monkeypatch.setattr(auto_backend, "time", clock)
    held: dict[int, int] = {}
    calls: dict[tuple[str, int], int] = {}

    def backend(side: int):
        def arrays_many(hosts, dcp, with_token_to_seq):
            (host,) = hosts
            requests = host.seq_lens.size
            answer = chunk_arrays_numpy_many(hosts, dcp, with_token_to_seq)
            held[requests] = sum(array.size for array in answer[0])
            n = calls[side, requests] = calls.get((side, requests), 0) + 1
            cost = 1e6 if n == 1 else costs[requests][side]
            clock.now += cost * (100 if side == 1 and requests == spike and n == 3 else 1) / 1e6
            return answer

        return arrays_many

    numpy_backend, triton_backend = Backend("numpy", backend(0)), Backend("triton", backend(1))
    selector = AutoSelector(numpy_backend, triton_backend, numpy_backend.arrays_many, triton_backend.arrays_many)
    selector.calibrate([CompileKey(1), CompileKey(4)], ladder=LADDER)
    assert all(calls[side, r] == 1 + auto_backend.CALIBRATION_REPEATS for side in (0, 1) for r in LADDER), calls
    return selector, held


def test_calibration_measures_each_rung_of_the_ladder_as_the_backends_ran_it(monkeypatch) -> None:
    """Each point is one rung: its size is the int32 elements the arrays really held, its figures the median of
    the timed calls (the untimed first touch and one noisy call left out), smallest rung first."""
    costs = {2: (10, 400), 4: (20, 300), 8: (40, 30), 16: (80, 35), 32: (160, 40)}
    selector, held = calibrated(monkeypatch, costs, spike=8)
    assert [p.requests for p in selector.points] == list(LADDER)
    assert [p.elements for p in selector.points] == [held[r] for r in LADDER]
    assert held[2] < held[4] < held[8] < held[16] < held[32]
    measured = [us for p in selector.points for us in (p.numpy_us, p.triton_us)]
    assert measured == pytest.approx([us for r in LADDER for us in costs[r]])


@pytest.mark.parametrize(
    ("costs", "first_triton_rung"),
    [
        # Triton's fixed round trip loses on small chunks and is amortised from 8 requests on.
        ({2: (10, 400), 4: (20, 300), 8: (40, 30), 16: (80, 35), 32: (160, 40)}, 8),
        # A win below a loss does not count: only the run of wins up to the largest rung.
        ({2: (10, 5), 4: (20, 300), 8: (40, 30), 16: (80, 35), 32: (160, 40)}, 8),
        # Triton faster everywhere: from the smallest rung.
        ({2: (10, 5), 4: (20, 6), 8: (40, 7), 16: (80, 8), 32: (160, 9)}, 2),
        # A tie is no win: at the largest rung it leaves numpy for every size.
        ({2: (10, 400), 4: (20, 300), 8: (40, 30), 16: (80, 35), 32: (160, 160)}, None),
        # Triton never faster.
        ({2: (10, 400), 4: (20, 300), 8: (40, 300), 16: (80, 300), 32: (160, 300)}, None),
    ],
)
def test_calibration_sends_to_triton_from_the_rung_where_it_won_at_every_larger_one(
    monkeypatch, costs: dict[int, tuple[float, float]], first_triton_rung: int | None
) -> None:
    selector, held = calibrated(monkeypatch, costs)
    rungs = {r: chunk_host_part(calibration_chunk(r, 4)) for r in LADDER}
    if first_triton_rung is None:
        assert selector.crossover == NUMPY_ALWAYS and selector.describe() == "numpy for every size"
        assert all(selector.choose([host], True).name == "numpy" for host in rungs.values())
        assert selector.fast_path_bytes(2**30) == 2**30
        return
    assert selector.crossover == held[first_triton_rung]
    assert selector.describe() == f"triton from {held[first_triton_rung]} output elements, numpy below"
    chosen = {r: selector.choose([host], True).name for r, host in rungs.items()}
    assert chosen == {r: "triton" if r >= first_triton_rung else "numpy" for r in LADDER}
    # The fast path (numpy's side) answers at most the largest answer below the crossover: 4 bytes an element.
    assert selector.fast_path_bytes(2**30) == 4 * held[first_triton_rung]


def test_the_served_backend_is_the_metrics_label_and_the_crossover_is_in_the_status() -> None:
    config = replace(load_config(env={}), backend="auto", native_fast_path=False)
    selector = _selector(1000)
    numpy_backend = selector.numpy
    plane = make_plane(config, backend=Backend("auto", numpy_backend.arrays_many, None, selector), keys=[])
    metrics = plane.metrics
    for queries, seq_len in ((2, 40), (200, 40_000)):
        request = chunk_inputs_to_proto(ChunkInputs(np.array([0, queries]), np.array([seq_len]), 4, 0, 1))
        plane.call("BuildChunk", request.SerializeToString())
    labels = {
        s.labels["backend"]: s.value
        for m in metrics.registry.collect()
        if m.name == "indexer_backend_duration_seconds"
        for s in m.samples
        if s.name.endswith("_count")
    }
    assert labels == {"numpy": 1, "triton": 1}
    status = pb.GetWarmupStatusResponse.FromString(plane.call("GetWarmupStatus", b""))
    assert status.backend == "auto" and status.auto_crossover_elements == 1000


def test_the_fast_path_serves_below_the_crossover_and_steps_aside_above_it() -> None:
    """auto's fast path (service.backends.below_crossover over the compiled one), through a data plane: the
    small answer is the fast path's (``native``), the large one Triton's, both admitted."""
    config = replace(load_config(env={}), backend="auto")
    selector = _selector(1000)
    fast = below_crossover(_fastpath.build_chunk, selector)
    plane = make_plane(config, backend=Backend("auto", selector.numpy.arrays_many, fast, selector), keys=[])
    plane.readiness.refresh()
    for queries, seq_len in ((2, 40), (200, 40_000)):
        inputs = ChunkInputs(np.array([0, queries]), np.array([seq_len]), 4, 0, 1)
        plane.call("BuildChunk", chunk_inputs_to_proto(inputs).SerializeToString())
    served = plane.metrics.registry.get_sample_value
    for backend in (FAST_PATH_BACKEND, "triton"):
        labels = {"method": "BuildChunk", "backend": backend}
        assert served("indexer_backend_duration_seconds_count", labels) == 1, backend
    assert plane.admission.budget.held == 0


def test_on_a_cpu_machine_auto_is_numpy() -> None:
    assert resolve_backend("auto") == ("auto" if cuda_available() else "numpy")
    assert resolve_backend("numpy") == "numpy"
