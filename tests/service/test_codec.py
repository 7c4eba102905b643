"""Responses written as wire bytes straight from the result arrays are byte for byte what protobuf itself
serializes for the same message, on random metadata and plans and on the edges (omitted and empty arrays,
an absent chunk, int64 scalars past int32, arrays of another dtype or layout)."""

from __future__ import annotations

import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs, ChunkMetadata
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.kernels.planner import BatchInputs, ChunkSpec, PrefillPlan, build_prefill_batch
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service.codec import (
    build_chunk_response_bytes,
    encode_int32,
    metadata_from_proto,
    plan_from_proto,
    plan_response_bytes,
)
from testkit.batches import BatchShape, random_batch
from tests.golden import metadata_as_dict


def reference_metadata(meta: ChunkMetadata, omit_token_to_seq: bool, into: pb.ChunkMetadata) -> None:
    """The same message through protobuf's own API: the oracle of the hand-written encoder."""
    into.cu_seq_lens = encode_int32(meta.cu_seq_lens)
    if not omit_token_to_seq:
        into.token_to_seq = encode_int32(meta.token_to_seq)
    into.cu_seqlen_ks = encode_int32(meta.cu_seqlen_ks)
    into.cu_seqlen_ke = encode_int32(meta.cu_seqlen_ke)
    into.local_cu_seq_lens = encode_int32(meta.local_cu_seq_lens)
    for name in (
        "total_seq_lens",
        "token_start",
        "token_end",
        "num_reqs",
        "skip_kv_gather",
        "local_total_seq_lens",
        "max_local_total_seq_lens",
        "req_start",
        "req_end",
    ):
        setattr(into, name, getattr(meta, name))
    into.query_slice.SetInParent()
    into.query_slice.start, into.query_slice.stop = meta.query_slice
    into.token_to_seq_omitted = omit_token_to_seq


def random_chunks(seed: int, count: int) -> list[ChunkInputs]:
    rng = np.random.default_rng(seed)
    chunks = []
    for _ in range(count):
        qsl, seq = random_batch(rng, BatchShape(int(rng.integers(1, 12)), 30, 300))
        n = seq.size
        start = int(rng.integers(0, n))
        end = int(rng.integers(start + 1, n + 1))
        ratio = int(rng.choice([1, 4, 128]))
        chunks.append(ChunkInputs(qsl, seq, ratio, start, end, skip_kv_gather=bool(rng.integers(0, 2))))
    return chunks


@pytest.mark.parametrize("omit_token_to_seq", [False, True], ids=["with-token_to_seq", "omitted"])
def test_build_chunk_bytes_equal_protobufs_serialization(omit_token_to_seq: bool) -> None:
    for inputs in random_chunks(11, 200):
        meta = build_chunk_metadata_numpy(inputs)
        expected = pb.BuildChunkResponse()
        if meta is not None:
            reference_metadata(meta, omit_token_to_seq, expected.metadata)
        wire = build_chunk_response_bytes(meta, omit_token_to_seq)
        assert wire == expected.SerializeToString()
        parsed = pb.BuildChunkResponse.FromString(wire)
        assert parsed.HasField("metadata") == (meta is not None)
        if meta is not None:
            got = metadata_as_dict(metadata_from_proto(parsed.metadata))
            assert got == metadata_as_dict(meta if not omit_token_to_seq else _without_token_to_seq(meta))


def _without_token_to_seq(meta: ChunkMetadata) -> ChunkMetadata:
    return ChunkMetadata(**{**vars(meta), "token_to_seq": None})


def test_edges_int64_scalars_other_dtypes_and_views() -> None:
    arrays = np.arange(12, dtype=np.int64)[::2]  # int64 and strided: converted, checked, equal bytes
    meta = ChunkMetadata(
        cu_seq_lens=arrays,
        token_to_seq=np.array([], dtype=np.int32),
        cu_seqlen_ks=np.zeros(0, np.int32),
        cu_seqlen_ke=np.zeros(0, np.int32),
        total_seq_lens=2**40,
        token_start=0,
        token_end=2**33,
        num_reqs=0,
        skip_kv_gather=False,
        local_cu_seq_lens=np.array([0, 2**31 - 1], dtype=np.int32),
        local_total_seq_lens=2**31 - 1,
        max_local_total_seq_lens=2**35,
        req_start=0,
        req_end=0,
        query_slice=(0, 0),
    )
    expected = pb.BuildChunkResponse()
    reference_metadata(meta, False, expected.metadata)
    assert build_chunk_response_bytes(meta, False) == expected.SerializeToString()
    assert build_chunk_response_bytes(None, False) == b""
    with pytest.raises(ValueError, match="token_to_seq: values must fit int32"):
        build_chunk_response_bytes(ChunkMetadata(**{**vars(meta), "token_to_seq": np.array([2**31])}), False)


@pytest.mark.parametrize("omit_token_to_seq", [False, True], ids=["with-token_to_seq", "omitted"])
def test_plan_bytes_equal_protobufs_serialization(omit_token_to_seq: bool) -> None:
    rng = np.random.default_rng(3)
    for _ in range(30):
        qsl, seq = random_batch(rng, BatchShape(int(rng.integers(1, 16)), 40, 400))
        decodes = int(rng.integers(0, seq.size))
        batch = BatchInputs(
            qsl,
            seq,
            int(rng.choice([1, 4, 128])),
            num_decodes=decodes,
            max_model_len=100,
            max_logits_bytes=4 * int(rng.integers(50, 400)),
        )
        plan = build_prefill_batch(batch, build_chunk_metadata_numpy)
        expected = pb.PlanBatchResponse(max_prefill_seq_len=plan.max_prefill_seq_len)
        for c in plan.chunks:
            expected.chunks.add(
                req_start=c.req_start, req_end=c.req_end, query_start=c.query_start, query_stop=c.query_stop
            )
        for meta in plan.metadata:
            reference_metadata(meta, omit_token_to_seq, expected.metadata.add())
        wire = plan_response_bytes(plan, omit_token_to_seq)
        assert wire == expected.SerializeToString()
        assert plan_from_proto(pb.PlanBatchResponse.FromString(wire)).chunks == plan.chunks
    empty = PrefillPlan([], [], 0)
    assert plan_response_bytes(empty, False) == b""
    one = PrefillPlan([ChunkSpec(0, 1, 0, 0)], [], 7)
    assert (
        plan_response_bytes(one, False)
        == pb.PlanBatchResponse(chunks=[pb.ChunkSpec(req_end=1)], max_prefill_seq_len=7).SerializeToString()
    )


def test_a_field_type_the_encoder_does_not_speak_fails_at_construction() -> None:
    from indexer_service.service.codec import _WireMessage

    with pytest.raises(TypeError, match=r"indexer\.v1\.KeyStatus\.label"):
        _WireMessage(pb.KeyStatus.DESCRIPTOR)  # a string first (compile_seconds, a double, would fail too)
