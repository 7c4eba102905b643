"""The RPCs over real gRPC (and HTTP) against a real server process: results equal the numpy implementation
and the golden cases, every bad request gets its status code and a message naming the field and index, and
the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from indexer_service.client import IndexerClient
from indexer_service.kernels.inputs import ChunkInputs, ChunkMetadata, DcpConfig
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.kernels.planner import BatchInputs, ChunkSpec, build_prefill_batch
from indexer_service.kernels.specialization import ModelConfig, warmup_keys
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service.codec import SERVICE_NAME, encode_int32
from indexer_service.service.config import load_config
from testkit.batches import BatchShape, random_batch, random_chunk_inputs
from testkit.harness import ServiceProcess
from tests.golden import ARRAY_FIELDS, GOLDEN, SCALAR_FIELDS, case_id, chunk_inputs, metadata_as_dict
from tests.service.conftest import StartServer, default_backend_and_target, scrape

# A key warmed: compiled by the warmup, or loaded from the Triton cache.
WARMED = (pb.KEY_STATE_COMPILED, pb.KEY_STATE_CACHED)
MAX_MODEL_LEN = 1 << 20  # the embedded default
E1_QSL, E1_SEQ = np.array([0, 1, 4, 9]), np.array([20, 10, 5])


@pytest.fixture(scope="module")
def client(live_server: ServiceProcess) -> Iterator[IndexerClient]:
    with IndexerClient(live_server.address) as c:
        yield c


@pytest.fixture(scope="module")
def stub(live_server: ServiceProcess) -> Iterator[pb_grpc.PrefillMetadataStub]:
    with grpc.insecure_channel(live_server.address) as channel:
        yield pb_grpc.PrefillMetadataStub(channel)


def assert_same_metadata(got: ChunkMetadata | None, expected: ChunkMetadata | None) -> None:
    assert (got is None) == (expected is None)
    if expected is not None:
        assert metadata_as_dict(got) == metadata_as_dict(expected)
        assert (got.req_start, got.req_end, got.query_slice) == (
            expected.req_start,
            expected.req_end,
            expected.query_slice,
        )


# --- results ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GOLDEN["chunk_metadata"], ids=case_id)
def test_build_chunk_equals_golden(client: IndexerClient, case: dict) -> None:
    got = client.build_chunk(chunk_inputs(case))
    assert (None if got is None else metadata_as_dict(got)) == case["expected"]


def test_build_chunk_equals_numpy_on_random_chunks(client: IndexerClient) -> None:
    rng = np.random.default_rng(3)
    ratios, dcps = (0, 1, 4, 128), (DcpConfig(), DcpConfig(1, 2), DcpConfig(3, 4, 2))
    for i in range(150):
        shape = BatchShape(int(rng.integers(1, 40)), int(rng.integers(1, 200)), int(rng.integers(0, 3000)))
        ratio = ratios[i % len(ratios)]
        dcp = dcps[i % len(dcps)] if ratio <= 1 else DcpConfig()  # DCP only at ratio 1 (FAILED_PRECONDITION else)
        inputs = random_chunk_inputs(rng, shape, ratio, dcp)
        assert_same_metadata(client.build_chunk(inputs), build_chunk_metadata_numpy(inputs))


def test_omit_token_to_seq_leaves_out_only_that_field(client: IndexerClient) -> None:
    inputs = ChunkInputs(E1_QSL, E1_SEQ, 4, 1, 3)
    full, slim = client.build_chunk(inputs), client.build_chunk(inputs, omit_token_to_seq=True)
    assert slim.token_to_seq is None and full.token_to_seq.tolist() == [0, 0, 1]
    slim.token_to_seq = full.token_to_seq
    assert_same_metadata(slim, full)


def golden_plan_batch(case: dict) -> BatchInputs:
    """A batch whose planner inputs are exactly the golden case's (compressed lengths, query lengths, workspace,
    logits budget, decode offset): ratio and max_model_len chosen so that max_model_len * 40 // ratio hits the
    workspace, seq lens so that seq // ratio hits the compressed lengths with seq >= query."""
    spec = case["input"]
    offset, workspace = spec.get("offset", 0), spec["workspace"]
    for ratio in range(1, 65):
        max_model_len = -(-workspace * ratio // 40)
        seq = [
            c * ratio + min(ratio - 1, max(0, q - c * ratio)) for c, q in zip(spec["cseq"], spec["qlens"], strict=True)
        ]
        if max_model_len * 40 // ratio == workspace and all(s >= q for s, q in zip(seq, spec["qlens"], strict=True)):
            break
    qlens = [1] * offset + spec["qlens"]
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    seq_lens = np.array([ratio] * offset + seq)
    return BatchInputs(qsl, seq_lens, ratio, offset, max_model_len, spec["max_logits_bytes"])


@pytest.mark.parametrize("case", GOLDEN["chunk_plan"], ids=case_id)
def test_plan_batch_equals_golden_plans(client: IndexerClient, case: dict) -> None:
    batch = golden_plan_batch(case)
    plan = client.plan_batch(batch)
    assert [
        {"requests": [c.req_start, c.req_end], "query_slice": [c.query_start, c.query_stop]} for c in plan.chunks
    ] == case["expected"]
    expected = build_prefill_batch(batch, build_chunk_metadata_numpy)
    assert len(plan.metadata) == len(expected.metadata)
    for got, want in zip(plan.metadata, expected.metadata, strict=True):
        assert_same_metadata(got, want)
    assert plan.max_prefill_seq_len == expected.max_prefill_seq_len


MAX_PLAN_CHUNKS = load_config(env={}).max_plan_chunks


def test_plan_batch_equals_numpy_on_random_batches(client: IndexerClient) -> None:
    rng = np.random.default_rng(11)
    for i in range(40):
        num_requests = int(rng.integers(1, 30))
        qsl, seq_lens = random_batch(rng, BatchShape(num_requests, int(rng.integers(1, 300)), 5000))
        batch = BatchInputs(
            qsl,
            seq_lens,
            (0, 1, 4, 128)[i % 4],
            int(rng.integers(0, num_requests + 1)),
            max_model_len=int(rng.integers(100, 20_000)),
            max_logits_bytes=int(rng.integers(4, 400_000)),
        )
        expected = build_prefill_batch(batch, build_chunk_metadata_numpy)
        if len(expected.chunks) > MAX_PLAN_CHUNKS:  # the server's work limit speaks first
            with pytest.raises(grpc.RpcError) as refused:
                client.plan_batch(batch)
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.details().startswith("max_logits_bytes:")
            continue
        plan = client.plan_batch(batch)
        assert plan.chunks == expected.chunks
        assert plan.max_prefill_seq_len == expected.max_prefill_seq_len
        for got, want in zip(plan.metadata, expected.metadata, strict=True):
            assert_same_metadata(got, want)


def test_plan_batch_defaults_come_from_the_server_config(stub: pb_grpc.PrefillMetadataStub) -> None:
    qsl, seq_lens = np.array([0, 8192]), np.array([65536])
    response = stub.PlanBatch(
        pb.PlanBatchRequest(
            query_start_loc=encode_int32(qsl), seq_lens=encode_int32(seq_lens), compress_ratio=1, omit_token_to_seq=True
        ),
        timeout=30,
    )
    # The spec's "at scale" example: 512 MiB of logits over 65,536 tokens allows 2,048 queries a chunk.
    assert [(c.query_start, c.query_stop) for c in response.chunks] == [(o, o + 2048) for o in range(0, 8192, 2048)]
    assert all(m.token_to_seq_omitted and not m.token_to_seq for m in response.metadata)


# --- bad requests -------------------------------------------------------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def chunk(qsl=(0, 1, 4, 9), seq=(20, 10, 5), ratio=4, start=1, end=3, **fields) -> tuple[str, pb.BuildChunkRequest]:
    request = pb.BuildChunkRequest(
        query_start_loc=encode_int32(np.array(qsl)),
        seq_lens=encode_int32(np.array(seq)),
        compress_ratio=ratio,
        req_start=start,
        req_end=end,
        **fields,
    )
    return "BuildChunk", request


def batch(qsl=(0, 1, 4, 9), seq=(20, 10, 5), ratio=4, decodes=1, **fields) -> tuple[str, pb.PlanBatchRequest]:
    request = pb.PlanBatchRequest(
        query_start_loc=encode_int32(np.array(qsl)),
        seq_lens=encode_int32(np.array(seq)),
        compress_ratio=ratio,
        num_decodes=decodes,
        **fields,
    )
    return "PlanBatch", request


def raw(method: str, request, **changes: bytes):
    for name, value in changes.items():
        setattr(request, name, value)
    return method, request


BIG = 1 << 20  # max_model_len: the longest sequence the default config allows
# A table, one case a row (kept by hand: the formatter would spread each longer row over six lines).
BAD_REQUESTS: list[tuple[str, tuple, grpc.StatusCode, tuple[str, ...]]] = [
    ("qsl-bytes-not-int32", raw(*chunk(), query_start_loc=b"\0" * 7), INVALID, ("query_start_loc", "multiple of 4")),
    ("seq-bytes-not-int32", raw(*batch(), seq_lens=b"\0" * 5), INVALID, ("seq_lens", "byte length 5")),
    ("qsl-empty", raw(*chunk(), query_start_loc=b""), INVALID, ("query_start_loc", "at least one")),
    ("qsl-not-from-0", chunk(qsl=(1, 2, 4, 9)), INVALID, ("query_start_loc[0]", "start at 0")),
    ("qsl-decreasing", chunk(qsl=(0, 5, 4, 9)), INVALID, ("query_start_loc[2]", "non-decreasing")),
    ("seq-shorter-than-query", chunk(seq=(20, 2, 5)), INVALID, ("seq_lens[1]", "query length 3")),
    ("seq-negative", batch(seq=(-1, 10, 5)), INVALID, ("seq_lens[0]", ">= 0")),
    ("seq-count-mismatch", chunk(seq=(20, 10)), INVALID, ("seq_lens", "3 requests")),
    ("ratio-negative", chunk(ratio=-4), INVALID, ("compress_ratio", ">= 0")),
    ("req-end-past-batch", chunk(end=4), INVALID, ("req_end", "[1, 3]")),
    ("req-start-after-end", chunk(start=3, end=2), INVALID, ("req_end", "[3, 3]")),
    ("slice-reversed", chunk(query_slice=pb.QuerySlice(start=5, stop=3)), INVALID, ("query_slice[1]", "[5, 8]")),
    ("slice-past-rows", chunk(query_slice=pb.QuerySlice(start=0, stop=9)), INVALID, ("query_slice[1]", "got 9")),
    ("slice-negative", chunk(query_slice=pb.QuerySlice(start=-1, stop=2)), INVALID, ("query_slice[0]", "got -1")),
    ("dcp-rank-ge-world", chunk(ratio=1, dcp_rank=2, dcp_world_size=2), INVALID, ("dcp_rank", "[0, 2)")),
    ("dcp-world-zero", chunk(ratio=1, dcp_world_size=0), INVALID, ("dcp_world_size", "must be in [1, 65536]")),
    ("dcp-world-huge", chunk(ratio=1, dcp_world_size=2**31 - 1), INVALID, ("dcp_world_size", "got 2147483647")),
    ("dcp-interleave-overflow", chunk(ratio=1, dcp_rank=3, dcp_world_size=4, dcp_interleave=2**30), INVALID,
     ("dcp_interleave", "must fit int32")),
    ("dcp-interleave-zero", chunk(ratio=1, dcp_world_size=2, dcp_interleave=0), INVALID, ("dcp_interleave", ">= 1")),
    ("decodes-past-batch", batch(decodes=4), INVALID, ("num_decodes", "[0, 3]")),
    ("logits-budget-tiny", batch(max_logits_bytes=3), INVALID, ("max_logits_bytes", ">= 4")),
    ("model-len-zero", batch(max_model_len=0), INVALID, ("max_model_len", ">= 1")),
    ("too-many-tokens", chunk(qsl=(0, 1, 9000, 9001), seq=(1, 9000, 1)), EXHAUSTED,
     ("query_start_loc[2]", "max_num_batched_tokens 8192")),
    ("seq-above-max-model-len", batch(seq=(20, BIG + 1, 5)), EXHAUSTED, ("seq_lens[1]", "max_model_len 1048576")),
    ("too-many-sequences", chunk(qsl=range(1026), seq=(1,) * 1025, start=0, end=1), EXHAUSTED,
     ("seq_lens", "1025 sequences", "max_num_seqs 1024")),
    ("chunk-above-kv-workspace", chunk(qsl=range(65), seq=(BIG,) * 64, ratio=1, start=0, end=64), EXHAUSTED,
     ("seq_lens[40]", "KV workspace of 41943040")),
    ("response-above-message-size", chunk(qsl=range(21), seq=(BIG,) * 20, ratio=1, start=0, end=20), EXHAUSTED,
     ("response", "max_message_bytes 67108864", "omit_token_to_seq")),
    ("plan-model-len-above-server", batch(max_model_len=BIG * 2), EXHAUSTED, ("max_model_len", "1048576")),
    ("dcp-with-compression", chunk(ratio=4, dcp_world_size=2), PRECONDITION, ("dcp_world_size", "compress ratio 4")),
    ("dcp-with-compression-plan", batch(ratio=128, dcp_world_size=4, dcp_rank=1), PRECONDITION,
     ("dcp_world_size", "compress ratio 128")),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "code", "fragments"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_its_code_and_names_the_field(
    stub: pb_grpc.PrefillMetadataStub, name: str, call: tuple, code: grpc.StatusCode, fragments: tuple[str, ...]
) -> None:
    method, request = call
    with pytest.raises(grpc.RpcError) as raised:
        getattr(stub, method)(request, timeout=30)
    assert raised.value.code() is code, raised.value.details()
    for fragment in fragments:
        assert fragment in raised.value.details()
    # ... and the server still serves.
    assert stub.BuildChunk(chunk()[1], timeout=5).metadata.total_seq_lens == 3


def test_dcp_at_ratio_zero_or_one_is_supported(client: IndexerClient) -> None:
    for ratio in (0, 1):
        inputs = ChunkInputs(np.array([0, 8]), np.array([8]), ratio, 0, 1, dcp=DcpConfig(0, 4, 2))
        assert client.build_chunk(inputs).cu_seqlen_ke.tolist() == [1, 2, 2, 2, 2, 2, 2, 2]


# --- the other surfaces -------------------------------------------------------------------------------------


def http_post(url: str, body: bytes) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["content-type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["content-type"], exc.read()


def test_http_protobuf_endpoint_shares_the_data_plane(live_server: ServiceProcess, stub) -> None:
    _, request = chunk()
    url = f"{live_server.http_rpc_url}/{SERVICE_NAME}/BuildChunk"
    status, content_type, body = http_post(url, request.SerializeToString())
    assert (status, content_type) == (200, "application/x-protobuf")
    assert pb.BuildChunkResponse.FromString(body) == stub.BuildChunk(request, timeout=5)

    _, bad = chunk(qsl=(0, 5, 4, 9))
    status, content_type, body = http_post(url, bad.SerializeToString())
    assert (status, content_type) == (400, "application/json")
    error = json.loads(body)
    assert error["code"] == "INVALID_ARGUMENT" and "query_start_loc[2]" in error["message"]
    assert http_post(url, b"\xff\xff")[0] == 400
    status, _, body = http_post(f"{live_server.http_rpc_url}/{SERVICE_NAME}/Nope", b"")
    assert status == 501 and json.loads(body)["code"] == "UNIMPLEMENTED"  # counted as method "unknown"


def test_reflection_lists_the_service(live_server: ServiceProcess) -> None:
    with grpc.insecure_channel(live_server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= set(database.get_services())
        from google.protobuf.descriptor_pool import DescriptorPool

        service = DescriptorPool(database).FindServiceByName(SERVICE_NAME)
        assert {m.name for m in service.methods} == {"BuildChunk", "PlanBatch", "GetWarmupStatus"}


def test_health_check_overall_and_per_service(live_server: ServiceProcess) -> None:
    with grpc.insecure_channel(live_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == (
                health_pb2.HealthCheckResponse.SERVING
            )
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def test_warmup_status_reports_every_key(client: IndexerClient, live_server: ServiceProcess) -> None:
    status = client.warmup_status()
    keys = warmup_keys(ModelConfig((0, 0, *([4, 128] * 20), 4, 0)))
    assert status.state == pb.WARMUP_STATE_READY and status.ready
    # The default config: ahead of time for cuda:90 with numpy, in-process where a CUDA GPU picks Triton.
    assert (status.backend, status.target, status.strict) == (*default_backend_and_target(), False)
    assert [(k.label, k.key_json) for k in status.keys] == [(k.label(), k.to_json()) for k in keys]
    # Compiled by this warmup, or loaded from the session's Triton cache (a state of its own), as the metric counts.
    assert all(k.state in WARMED and k.compile_seconds > 0 and not k.error for k in status.keys)
    metrics = scrape(live_server)
    for state, name in ((pb.KEY_STATE_COMPILED, "compiled"), (pb.KEY_STATE_CACHED, "cached")):
        assert sum(k.state == state for k in status.keys) == metrics.value("indexer_warmup_keys", state=name)
    # Keys compile in parallel (warmup_workers): the whole warmup outlasts its slowest key, not their sum.
    assert status.warmup_seconds >= max(k.compile_seconds for k in status.keys)
    # numpy never compiles. A non-strict Triton server serves a ratio outside the model's set by compiling it
    # (earlier tests here send some): every such compile is counted, in the status and in the metric alike.
    if status.backend == "numpy":
        assert status.compiles_after_ready == 0
    assert status.compiles_after_ready == scrape(live_server).value("indexer_compiles_after_ready_total")


# --- strict mode --------------------------------------------------------------------------------------------


def test_strict_mode_refuses_variants_outside_the_warmed_set(start_server: StartServer) -> None:
    # compress_ratios (4,) and no kpool: the warmed ratios are 4 and 1 (absent kpool means 1).
    server = start_server("--strict", "--compress-ratios", "4")
    with IndexerClient(server.address) as client:
        assert [k.label for k in client.warmup_status().keys] == ["r4-b1024-aligned-i32", "r1-b1024-aligned-i32"]
        for ratio in (0, 1, 4):  # 0 normalises to 1, which is warmed
            inputs = ChunkInputs(E1_QSL, E1_SEQ, ratio, 1, 3)
            assert_same_metadata(client.build_chunk(inputs), build_chunk_metadata_numpy(inputs))
        attempts: list[Callable[[], object]] = [
            lambda: client.build_chunk(ChunkInputs(E1_QSL, E1_SEQ, 128, 1, 3)),
            lambda: client.plan_batch(BatchInputs(E1_QSL, E1_SEQ, 128, 1, MAX_MODEL_LEN)),
        ]
        for attempt in attempts:
            with pytest.raises(grpc.RpcError) as refused:
                attempt()
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "r128-b1024-aligned-i32" in refused.value.details() and "strict" in refused.value.details()
        assert client.warmup_status().strict
    # Each refusal is a warmup miss too, counted by the variant a GPU replica would have compiled
    assert scrape(server).value("indexer_warmup_misses_total", variant="r128-b1024-aligned-i32") == 2


def test_a_ratio_outside_the_warmup_set_is_a_warmup_miss_on_every_backend(start_server: StartServer) -> None:
    # numpy never compiles, so compiles_after_ready cannot show that the model config and the traffic disagree:
    # the miss is counted and logged, served as any request (through the general path: the fast path serves the
    # warmup set's ratios).
    server = start_server("--backend", "numpy", "--warmup-target", "none", "--compress-ratios", "4")
    with IndexerClient(server.address) as client:
        for ratio in (4, 8, 8, 16, 64):
            inputs = ChunkInputs(E1_QSL, E1_SEQ, ratio, 1, 3)
            assert_same_metadata(client.build_chunk(inputs), build_chunk_metadata_numpy(inputs))
    metrics = scrape(server)
    misses = {
        key: metrics.value("indexer_warmup_misses_total", variant=f"r{key}-b1024-aligned-i32") for key in (8, 16, 64)
    }
    assert misses == {8: 2, 16: 1, 64: 1}
    assert metrics.value("indexer_warmup_misses_total", variant="r4-b1024-aligned-i32") is None
    assert metrics.value("indexer_compiles_after_ready_total") == 0
    assert "warmup_miss reason=r8-b1024-aligned-i32" in server.log()


def test_chunk_spec_round_trip_keeps_order(client: IndexerClient) -> None:
    qsl, seq = np.array([0, 1, 2, 3, 13]), np.array([5, 5, 5, 80])
    plan = client.plan_batch(BatchInputs(qsl, seq, 2, 3, 5, 400))
    assert plan.chunks == [ChunkSpec(3, 4, o, o + 2) for o in range(0, 10, 2)]
    assert [m.query_slice for m in plan.metadata] == [(o, o + 2) for o in range(0, 10, 2)]
    assert all(m.skip_kv_gather == (m.query_slice[0] > 0) for m in plan.metadata)


def test_fields_compared_cover_the_golden_expectations() -> None:
    assert set(ARRAY_FIELDS) | set(SCALAR_FIELDS) == set(GOLDEN["chunk_metadata"][0]["expected"])
