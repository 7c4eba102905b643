"""The data plane in-process, for what a healthy server process cannot show: an unexpected backend failure is
INTERNAL (with a logged traceback) and the server keeps serving; the Triton backend path with strict mode's
launch admission (through Triton's CPU interpreter); compiles after ready counted from Triton's own hook."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from indexer_service.kernels.compile_engine import compile_keys, watch_compiles
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy, chunk_arrays_numpy
from indexer_service.kernels.planner import BatchInputs, build_prefill_batch
from indexer_service.kernels.specialization import CompileKey, warmup_keys
from indexer_service.kernels.triton_launcher import TritonChunkBuilder
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import codec
from indexer_service.service.compute.backends import Backend, make_backend
from indexer_service.service.compute.warmup import Warmup, WarmupState
from indexer_service.service.config import load_config
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.errors import Code, ServiceError
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.overload.limits import launch_admission
from indexer_service.service.transport.grpc_server import HEALTH_NAMES, create_grpc_server
from indexer_service.service.transport.health import HealthServicer
from testkit.batches import BatchShape, random_batch
from testkit.planes import make_plane
from tests.golden import metadata_as_dict

E1 = ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3)


class FlakyBackend:
    """numpy, except that the first call raises ``failure``: what no validation could foresee."""

    def __init__(self, failure: Exception) -> None:
        self.failure = failure
        self.calls = 0

    def __call__(self, hosts, dcp, with_token_to_seq):
        self.calls += 1
        if self.calls == 1:
            raise self.failure
        return [chunk_arrays_numpy(host, dcp, with_token_to_seq) for host in hosts]


@pytest.fixture
def flaky_server(request) -> Iterator[tuple[DataPlane, pb_grpc.PrefillMetadataStub]]:
    """A real gRPC server whose backend's first call raises ``request.param`` (default: a RuntimeError)."""
    failure = getattr(request, "param", RuntimeError("backend exploded"))
    config = load_config({"grpc_host": "127.0.0.1", "grpc_port": "0", "warmup_target": "none"}, env={})
    plane = make_plane(config, backend=Backend("numpy", FlakyBackend(failure)))
    plane.readiness.refresh()
    server = create_grpc_server(config, plane, HealthServicer(HEALTH_NAMES))
    server.server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield plane, pb_grpc.PrefillMetadataStub(channel)
    finally:
        server.stop(None)


def test_unexpected_failure_is_internal_logged_and_the_server_keeps_serving(flaky_server, caplog) -> None:
    plane, stub = flaky_server
    request = codec.chunk_inputs_to_proto(E1)
    with caplog.at_level(logging.ERROR), pytest.raises(grpc.RpcError) as failed:
        stub.BuildChunk(request, timeout=5)
    assert failed.value.code() is grpc.StatusCode.INTERNAL
    assert failed.value.details() == "internal error (RuntimeError); see the server log"
    logged = [r for r in caplog.records if r.exc_info and "internal error method=BuildChunk" in r.getMessage()]
    assert logged and "backend exploded" in str(logged[0].exc_info[1])
    response = stub.BuildChunk(request, timeout=5)
    assert metadata_as_dict(codec.metadata_from_proto(response.metadata)) == metadata_as_dict(
        build_chunk_metadata_numpy(E1)
    )
    registry = plane.metrics.registry
    assert registry.get_sample_value("indexer_request_errors_total", {"method": "BuildChunk", "code": "INTERNAL"}) == 1


@pytest.mark.parametrize("flaky_server", [MemoryError("GPU out of memory for 50000000 tokens")], indirect=True)
def test_out_of_memory_is_resource_exhausted_and_the_next_request_succeeds(flaky_server) -> None:
    plane, stub = flaky_server
    request = codec.chunk_inputs_to_proto(E1)
    with pytest.raises(grpc.RpcError) as failed:
        stub.BuildChunk(request, timeout=5)
    assert failed.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of memory" in failed.value.details()
    assert stub.BuildChunk(request, timeout=5).metadata.total_seq_lens == 3
    labels = {"method": "BuildChunk", "code": "RESOURCE_EXHAUSTED"}
    assert plane.metrics.registry.get_sample_value("indexer_request_errors_total", labels) == 1


@pytest.fixture(scope="module")
def strict_triton(triton_cpu: TritonChunkBuilder) -> tuple[DataPlane, TritonChunkBuilder]:
    """Strict mode over the Triton kernel (interpreted on the CPU), warmed for ratios 4 and 1 (AOT, cuda:90)."""
    config = load_config({"strict": True, "compress_ratios": "4"}, env={})
    metrics = Metrics()
    warmup = Warmup(warmup_keys(config.model), target="cuda:90", enabled=True, workers=1, metrics=metrics)
    builder = TritonChunkBuilder("cpu", kernel=triton_cpu.kernel, admit=launch_admission(warmup))
    plane = make_plane(config, backend=Backend("triton", builder.arrays_many), metrics=metrics, warmup=warmup)
    assert warmup.run() is WarmupState.READY
    plane.readiness.refresh()
    return plane, builder


def test_triton_backend_answers_warmed_ratios_like_numpy(strict_triton) -> None:
    plane, _ = strict_triton
    for ratio in (0, 1, 4):
        inputs = ChunkInputs(E1.query_start_loc, E1.seq_lens, ratio, 1, 3, query_slice=(1, 7))
        response = pb.BuildChunkResponse.FromString(plane.call("BuildChunk", codec.chunk_inputs_to_proto(inputs)))
        got = codec.metadata_from_proto(response.metadata)
        assert metadata_as_dict(got) == metadata_as_dict(build_chunk_metadata_numpy(inputs))
    labels = {"method": "BuildChunk", "backend": "triton"}
    assert plane.metrics.registry.get_sample_value("indexer_backend_duration_seconds_count", labels) == 3


def test_strict_mode_refuses_before_the_request_and_at_the_launch(strict_triton) -> None:
    plane, builder = strict_triton
    unwarmed = ChunkInputs(E1.query_start_loc, E1.seq_lens * 100, 128, 1, 3)  # long enough to need a launch
    with pytest.raises(ServiceError) as refused:
        plane.call("BuildChunk", codec.chunk_inputs_to_proto(unwarmed))
    assert refused.value.code is Code.FAILED_PRECONDITION
    assert "r128-b1024-aligned-i32" in refused.value.message
    # The builder's own admission sees the real launch's key (pointers and scalars included) and refuses too.
    with pytest.raises(ServiceError, match="not in the warmed set"):
        builder(unwarmed)


def test_a_whole_plan_is_one_launch_on_the_triton_backend(triton_cpu: TritonChunkBuilder) -> None:
    config = load_config({"warmup_target": "none"}, env={})
    launches: list[CompileKey] = []
    builder = TritonChunkBuilder("cpu", kernel=triton_cpu.kernel, admit=launches.append)
    plane = make_plane(config, backend=Backend("triton", builder.arrays_many))
    plane.readiness.refresh()
    qsl, seq = random_batch(np.random.default_rng(5), BatchShape(12, 40, 400))
    batch = BatchInputs(qsl, seq, 4, num_decodes=2, max_model_len=100, max_logits_bytes=4 * 300)
    plan = codec.plan_from_proto(
        pb.PlanBatchResponse.FromString(plane.call("PlanBatch", codec.batch_inputs_to_proto(batch)))
    )
    expected = build_prefill_batch(batch, build_chunk_metadata_numpy)
    assert len(expected.metadata) >= 3 and plan.chunks == expected.chunks
    assert [metadata_as_dict(m) for m in plan.metadata] == [metadata_as_dict(m) for m in expected.metadata]
    assert len(launches) == 1


def test_compiles_after_ready_come_from_tritons_hook() -> None:
    config = load_config({"compress_ratios": "1"}, env={})
    plane = make_plane(config, backend=make_backend("numpy", None), warmup_on="cuda:90")
    registry = plane.metrics.registry
    uninstall = watch_compiles(plane.readiness.on_kernel_compile)
    try:
        # Compiles before ready, the warmup's own included, do not count; every compile after ready does.
        early = CompileKey(compress_ratio=7)
        assert compile_keys([early], [early], target="cuda:90")[0].ok
        assert plane.warmup.run() is WarmupState.READY
        plane.readiness.refresh()
        assert registry.get_sample_value("indexer_compiles_after_ready_total") == 0
        late = CompileKey(compress_ratio=9)
        assert compile_keys([late], [late], target="cuda:90")[0].ok
    finally:
        uninstall()
    assert registry.get_sample_value("indexer_compiles_after_ready_total") == 1
    status = pb.GetWarmupStatusResponse.FromString(plane.call("GetWarmupStatus", pb.GetWarmupStatusRequest()))
    assert status.compiles_after_ready == 1


def test_dcp_with_compression_is_a_failed_precondition_on_the_triton_backend(strict_triton) -> None:
    plane, _ = strict_triton
    inputs = ChunkInputs(E1.query_start_loc, E1.seq_lens, 4, 1, 3)
    request = codec.chunk_inputs_to_proto(inputs)
    request.dcp_world_size = 2
    with pytest.raises(ServiceError) as refused:
        plane.call("BuildChunk", request)
    assert refused.value.code is Code.FAILED_PRECONDITION
