"""On a CUDA GPU, a real server process on the Triton backend: in-process warmup, answers equal numpy, no compile after
ready for the warmed ratios, an unwarmed ratio counted (or refused in strict mode). Skipped without CUDA."""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest
import torch

from indexer_service.client import IndexerClient
from indexer_service.kernels.inputs import ChunkInputs, DcpConfig, chunk_host_part
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy, chunk_arrays_numpy
from indexer_service.kernels.planner import BatchInputs, build_prefill_batch
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service.compute.auto_backend import LADDER_REQUESTS, calibration_chunk, output_elements
from testkit.batches import BatchShape, batch_with_tokens, random_batch, random_chunk_inputs
from tests.golden import GOLDEN, chunk_inputs, metadata_as_dict
from tests.service.conftest import StartServer, scrape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

UNWARMED = ChunkInputs(np.array([0, 1, 4, 9]), np.array([200, 100, 50]), 7, 1, 3)  # ratio 7: no model has it


def same(got, expected) -> bool:
    return (got is None and expected is None) or metadata_as_dict(got) == metadata_as_dict(expected)


def test_triton_server_answers_like_numpy_and_compiles_nothing_after_ready(start_server: StartServer) -> None:
    server = start_server("--backend", "triton")  # every request on the GPU, in-process warmup
    with IndexerClient(server.address) as client:
        status = client.warmup_status()
        assert (status.backend, status.target, status.state) == ("triton", "in-process", pb.WARMUP_STATE_READY)
        assert status.auto_crossover_elements == 0
        # Compiled in process, or loaded from the session's cache where an earlier GPU server filled it.
        assert {k.state for k in status.keys} <= {pb.KEY_STATE_COMPILED, pb.KEY_STATE_CACHED} and len(status.keys) == 3

        for case in GOLDEN["chunk_metadata"]:
            got = client.build_chunk(chunk_inputs(case))
            assert (None if got is None else metadata_as_dict(got)) == case["expected"], case["name"]
        rng = np.random.default_rng(2027)
        for i in range(300):
            ratio = (0, 1, 4, 128)[i % 4]
            dcp = (DcpConfig(), DcpConfig(1, 2), DcpConfig(3, 4, 2))[i % 3] if ratio <= 1 else DcpConfig()
            # At most 64 x 120 query tokens: under the default max_num_batched_tokens (8192).
            shape = BatchShape(int(rng.integers(1, 65)), int(rng.integers(1, 121)), int(rng.integers(0, 5000)))
            inputs = random_chunk_inputs(rng, shape, ratio, dcp)
            assert same(client.build_chunk(inputs), build_chunk_metadata_numpy(inputs)), i
        for i in range(30):
            qsl, seq = random_batch(rng, BatchShape(int(rng.integers(1, 27)), 300, 5000))  # <= 26 x 300 tokens
            batch = BatchInputs(qsl, seq, (0, 4, 128)[i % 3], int(rng.integers(0, qsl.size)), 2000, 4 * 20_000)
            plan, expected = client.plan_batch(batch), build_prefill_batch(batch, build_chunk_metadata_numpy)
            assert plan.chunks == expected.chunks
            assert all(same(g, e) for g, e in zip(plan.metadata, expected.metadata, strict=True))
        assert client.warmup_status().compiles_after_ready == 0

        # A ratio outside the model's set is answered correctly, and its compile is counted.
        assert same(client.build_chunk(UNWARMED), build_chunk_metadata_numpy(UNWARMED))
        assert client.warmup_status().compiles_after_ready == 1
    metrics = scrape(server)
    assert metrics.value("indexer_compiles_after_ready_total") == 1
    assert metrics.value("indexer_backend_duration_seconds_count", method="BuildChunk", backend="triton") > 300
    assert "compile after ready kernel=" in server.log()


def test_strict_triton_server_refuses_an_unwarmed_variant(start_server: StartServer) -> None:
    server = start_server("--strict")
    with IndexerClient(server.address) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.build_chunk(UNWARMED)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        warmed = ChunkInputs(UNWARMED.query_start_loc, UNWARMED.seq_lens, 4, 1, 3)
        assert same(client.build_chunk(warmed), build_chunk_metadata_numpy(warmed))
        assert client.warmup_status().compiles_after_ready == 0


def test_auto_server_measures_a_crossover_and_serves_each_size_on_its_backend(start_server: StartServer) -> None:
    """The default config on a GPU is auto: the warmup measures the crossover (GetWarmupStatus), requests below it
    are served by numpy (BuildChunk's fast path: label native), requests at or above it by Triton, all equal to
    numpy, and nothing compiles after ready."""
    server = start_server("--max-num-batched-tokens", "131072")
    with IndexerClient(server.address) as client:
        status = client.warmup_status()
        assert (status.backend, status.target, status.state) == ("auto", "in-process", pb.WARMUP_STATE_READY)
        crossover = status.auto_crossover_elements
        small = ChunkInputs(np.array([0, 3]), np.array([40]), 4, 0, 1)
        rng = np.random.default_rng(7)
        qsl, seq = batch_with_tokens(rng, 256, 65_961, 33_148)  # bench_kernel's large batch: 2.2M elements
        large = ChunkInputs(qsl, seq, 4, 0, 256)
        for inputs in (small, large, small, large):
            assert same(client.build_chunk(inputs), build_chunk_metadata_numpy(inputs))
        assert client.warmup_status().compiles_after_ready == 0
    metrics = scrape(server)
    served = {
        backend: metrics.value("indexer_backend_duration_seconds_count", method="BuildChunk", backend=backend)
        for backend in ("native", "numpy", "triton")
    }
    assert served["native"] == 2, served
    # What the measurement model (service/compute/auto_backend.py) implies. The crossover is one of the sizes the
    # warmup measured, the ladder's (their int32 elements counted here from numpy's own arrays), as the log lists
    # them; Triton's fixed round trip (a program table, a copy each way, a launch, a wait: hundreds of us) loses to
    # numpy on the smallest rung (about 1.3 thousand elements: tens of us) and is amortised by the largest (millions
    # of elements), so on a GPU the crossover lies above the smallest rung and at most at the largest: never
    # NUMPY_ALWAYS or NOT_MEASURED. And it is the first size of the run of Triton's wins up to the largest.
    ratio, points = measured_points(server.log())
    ladder = [ladder_elements(requests, ratio) for requests in LADDER_REQUESTS]
    assert [elements for elements, _, _ in points] == ladder, (points, ladder)
    assert ladder[0] < crossover <= ladder[-1] and crossover in ladder, (crossover, points)
    # (The log rounds to whole us: a win may read as a tie, never as a loss.)
    first = ladder.index(crossover)
    assert all(triton_us <= numpy_us for _, numpy_us, triton_us in points[first:]), (crossover, points)
    assert points[first - 1][2] >= points[first - 1][1], (crossover, points)
    large_elements = output_elements([chunk_host_part(large)], with_token_to_seq=True)
    assert served["triton" if crossover <= large_elements else "numpy"] == 2, (crossover, large_elements, served)


def measured_points(log: str) -> tuple[int, list[tuple[int, float, float]]]:
    """The calibration's ratio and (elements, numpy us, Triton us) of each rung, from its log line."""
    line = re.search(r"auto backend: .*\(ratio (\d+).*elements:numpy/triton (.*)\)", log)
    assert line, log
    points = re.findall(r"(\d+):(\d+)/(\d+)us", line.group(2))
    return int(line.group(1)), [(int(e), float(n), float(t)) for e, n, t in points]


def ladder_elements(requests: int, ratio: int) -> int:
    """The int32 elements of the calibration chunk of ``requests`` requests: what numpy's arrays of it hold."""
    host = chunk_host_part(calibration_chunk(requests, ratio))
    return sum(array.size for array in chunk_arrays_numpy(host, DcpConfig(), True))
