"""Bad inputs to the public functions raise a ValueError naming the field and the index."""

from __future__ import annotations

import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs, DcpConfig, InvalidInputError
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.kernels.planner import BatchInputs, plan_prefill_batch, plan_prefill_chunks
from indexer_service.kernels.triton_kernel import interpreted_kernel
from indexer_service.kernels.triton_launcher import TritonChunkBuilder

QSL = np.array([0, 2, 5, 9])
SEQ = np.array([4, 10, 6])


def chunk(**changes) -> ChunkInputs:
    fields = dict(query_start_loc=QSL, seq_lens=SEQ, compress_ratio=4, req_start=0, req_end=3)
    fields.update(changes)
    return ChunkInputs(**fields)


BAD_CHUNKS = {
    "qsl-not-monotone": (chunk(query_start_loc=np.array([0, 5, 3, 9])), "query_start_loc", 2),
    "qsl-not-from-zero": (chunk(query_start_loc=np.array([1, 2, 5, 9])), "query_start_loc", 0),
    "qsl-2d": (chunk(query_start_loc=QSL.reshape(2, 2)), "query_start_loc", None),
    "qsl-float": (chunk(query_start_loc=QSL.astype(float)), "query_start_loc", None),
    "qsl-empty": (chunk(query_start_loc=np.array([], dtype=np.int64)), "query_start_loc", None),
    "seq-shorter-than-query": (chunk(seq_lens=np.array([4, 2, 6])), "seq_lens", 1),
    "seq-negative": (chunk(seq_lens=np.array([4, 10, -6])), "seq_lens", 2),
    "seq-length-mismatch": (chunk(seq_lens=np.array([4, 10])), "seq_lens", None),
    "seq-over-int32": (chunk(seq_lens=np.array([4, 2**31, 6])), "seq_lens", 1),
    "ratio-negative": (chunk(compress_ratio=-4), "compress_ratio", None),
    "req-start-out": (chunk(req_start=4), "req_start", None),
    "req-end-before-start": (chunk(req_start=2, req_end=1), "req_end", None),
    "slice-start-out": (chunk(query_slice=(10, 10)), "query_slice", 0),
    "slice-stop-out": (chunk(query_slice=(0, 10)), "query_slice", 1),
    "slice-reversed": (chunk(query_slice=(3, 2)), "query_slice", 1),
    "dcp-rank-ge-world": (chunk(dcp=DcpConfig(rank=2, world_size=2)), "dcp_rank", None),
    "dcp-world-zero": (chunk(dcp=DcpConfig(rank=0, world_size=0)), "dcp_world_size", None),
    "dcp-interleave-zero": (chunk(dcp=DcpConfig(world_size=2, interleave=0)), "dcp_interleave", None),
    "dcp-world-huge": (chunk(dcp=DcpConfig(rank=0, world_size=2**31 - 1)), "dcp_world_size", None),
    "dcp-rank-times-interleave-overflows": (chunk(dcp=DcpConfig(3, 4, 2**30)), "dcp_interleave", None),
}


@pytest.fixture(scope="module")
def builders():
    return {"numpy": build_chunk_metadata_numpy, "triton": TritonChunkBuilder("cpu", kernel=interpreted_kernel())}


@pytest.mark.parametrize("backend", ["numpy", "triton"])
@pytest.mark.parametrize("name", list(BAD_CHUNKS))
def test_bad_chunk_names_field_and_index(name, backend, builders):
    inputs, field, index = BAD_CHUNKS[name]
    with pytest.raises(InvalidInputError) as info:
        builders[backend](inputs)
    assert (info.value.field, info.value.index) == (field, index)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(field if index is None else f"{field}[{index}]")


def batch(**changes) -> BatchInputs:
    fields = dict(query_start_loc=QSL, seq_lens=SEQ, compress_ratio=4, num_decodes=1, max_model_len=100)
    fields.update(changes)
    return BatchInputs(**fields)


@pytest.mark.parametrize(
    ("inputs", "field", "index"),
    [
        (batch(num_decodes=4), "num_decodes", None),
        (batch(max_model_len=0), "max_model_len", None),
        (batch(max_logits_bytes=3), "max_logits_bytes", None),
        (batch(query_start_loc=np.array([0, 2, 1, 9])), "query_start_loc", 2),
        (batch(compress_ratio=-1), "compress_ratio", None),
    ],
    ids=["decodes-too-many", "model-len-zero", "logits-too-small", "qsl-not-monotone", "ratio-negative"],
)
def test_bad_batch_names_field(inputs, field, index):
    with pytest.raises(InvalidInputError) as info:
        plan_prefill_batch(inputs)
    assert (info.value.field, info.value.index) == (field, index)


def test_plan_rejects_mismatched_lengths():
    with pytest.raises(InvalidInputError, match="query_lens"):
        plan_prefill_chunks([1, 2], [1], 10, 10)


def test_ratio_zero_is_uncompressed_not_an_error():
    assert build_chunk_metadata_numpy(chunk(compress_ratio=0)).total_seq_lens == int(SEQ.sum())
