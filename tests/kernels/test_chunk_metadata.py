"""The numpy twin and the Triton kernel (through the interpreter) against the golden cases and each other."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer_service.kernels import triton_launcher
from indexer_service.kernels.formulas import dcp_local_lens
from indexer_service.kernels.inputs import ChunkInputs, DcpConfig, chunk_host_part
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy, chunk_arrays_numpy
from indexer_service.kernels.planner import BatchInputs, chunk_inputs_of_plan, plan_prefill_batch
from indexer_service.kernels.triton_launcher import TritonChunkBuilder
from testkit.batches import BatchShape, random_batch, random_chunk_inputs
from tests.golden import ARRAY_FIELDS, GOLDEN, SCALAR_FIELDS, case_id, chunk_inputs, metadata_as_dict

SENTINEL = -0x5EED


@pytest.fixture
def sentinel_outputs(monkeypatch):
    """Output buffers pre-filled with a sentinel: any element the kernel leaves unwritten shows up."""
    monkeypatch.setattr(
        triton_launcher,
        "_alloc_output",
        lambda n: np.full(n, SENTINEL, dtype=np.int32),
    )


def expected_fields(case: dict) -> dict | None:
    expected = case["expected"]
    return None if expected is None else {k: expected[k] for k in (*ARRAY_FIELDS, *SCALAR_FIELDS)}


@pytest.mark.parametrize("case", GOLDEN["chunk_metadata"], ids=case_id)
def test_numpy_matches_golden(case):
    result = build_chunk_metadata_numpy(chunk_inputs(case))
    assert (None if result is None else metadata_as_dict(result)) == expected_fields(case)


@pytest.mark.parametrize("case", GOLDEN["chunk_metadata"], ids=case_id)
def test_triton_interpreter_matches_golden(case, triton_cpu, sentinel_outputs):
    result = triton_cpu(chunk_inputs(case))
    assert (None if result is None else metadata_as_dict(result)) == expected_fields(case)


def test_local_cu_is_cu_without_dcp():
    case = next(c for c in GOLDEN["chunk_metadata"] if c["name"].startswith("E1"))
    result = build_chunk_metadata_numpy(chunk_inputs(case))
    assert result.local_cu_seq_lens is result.cu_seq_lens


# Irregular shapes: odd sizes, zero-length queries, requests that compress away entirely, slices, DCP.
SHAPES = {
    "one-request": BatchShape(1, 37, 300),
    "odd-small": BatchShape(7, 13, 50),
    "zero-heavy": BatchShape(9, 5, 6, zero_query_share=0.6),
    "short-contexts": BatchShape(12, 3, 3),  # many S < ratio: whole requests compress away
    "wide": BatchShape(33, 40, 2000),
    "multi-block": BatchShape(3, 1500, 3000),  # rows and tokens span several BLOCK_SIZE loops
}
DCP_SETTINGS = {
    "nodcp": DcpConfig(),
    "dcp2r1": DcpConfig(rank=1, world_size=2),
    "dcp4r3i2": DcpConfig(rank=3, world_size=4, interleave=2),
    "dcp2r0i2": DcpConfig(rank=0, world_size=2, interleave=2),
}


@pytest.mark.parametrize("ratio", [1, 4, 128], ids=lambda r: f"ratio{r}")
@pytest.mark.parametrize("dcp_name", list(DCP_SETTINGS))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_triton_interpreter_equals_numpy(shape_name, dcp_name, ratio, triton_cpu, sentinel_outputs):
    rng = np.random.default_rng(zlib.crc32(f"{shape_name}-{dcp_name}-{ratio}".encode()))
    for _ in range(2):
        inputs = random_chunk_inputs(rng, SHAPES[shape_name], ratio, DCP_SETTINGS[dcp_name])
        expected = build_chunk_metadata_numpy(inputs)
        got = triton_cpu(inputs)
        if expected is None:
            assert got is None
            continue
        want, have = metadata_as_dict(expected), metadata_as_dict(got)
        assert have == want
        assert SENTINEL not in np.concatenate([got.token_to_seq, got.cu_seqlen_ks, got.cu_seqlen_ke])


def test_outputs_are_int32_and_sized():
    inputs = ChunkInputs(np.array([0, 3, 10]), np.array([9, 40]), 4, 0, 2, query_slice=(2, 9))
    result = build_chunk_metadata_numpy(inputs)
    for name in ARRAY_FIELDS:
        assert getattr(result, name).dtype == np.int32, name
    assert result.token_to_seq.size == result.total_seq_lens == 2 + 10
    assert result.cu_seqlen_ks.size == result.cu_seqlen_ke.size == 7
    assert (result.token_start, result.token_end, result.skip_kv_gather) == (2, 9, True)


@pytest.mark.parametrize("ratio", [1, 4, 128], ids=lambda r: f"ratio{r}")
@pytest.mark.parametrize("dcp_name", ["nodcp", "dcp4r3i2"])
def test_one_launch_builds_every_chunk_of_a_plan(dcp_name, ratio, triton_cpu, sentinel_outputs):
    """A whole prefill plan (many chunks, sub-chunked requests, empty chunks dropped) is one launch."""
    rng = np.random.default_rng(zlib.crc32(f"plan-{dcp_name}-{ratio}".encode()))
    qsl, seq = random_batch(rng, BatchShape(16, 60, 700))
    # Budgets small enough for many chunks and for requests split along their queries at every ratio.
    logits = 2000 if ratio < 128 else 40
    batch = BatchInputs(
        qsl, seq, ratio, num_decodes=3, max_model_len=60, max_logits_bytes=4 * logits, dcp=DCP_SETTINGS[dcp_name]
    )
    hosts = [h for h in map(chunk_host_part, chunk_inputs_of_plan(batch, plan_prefill_batch(batch))) if h]
    assert len(hosts) >= 4 and any(h.query_slice[0] > 0 for h in hosts)
    launches = []
    builder = TritonChunkBuilder("cpu", kernel=triton_cpu.kernel, admit=launches.append)
    built = builder.arrays_many(hosts, batch.dcp)
    assert len(launches) == 1
    for host, arrays in zip(hosts, built, strict=True):
        for got, want in zip(arrays, chunk_arrays_numpy(host, batch.dcp), strict=True):
            assert got.tolist() == want.tolist()


@pytest.mark.parametrize("span", [100, 333], ids=lambda s: f"span{s}")
@pytest.mark.parametrize("dcp_name", ["nodcp", "dcp2r0i2"])
def test_long_requests_split_across_programs(span, dcp_name, triton_cpu, sentinel_outputs, monkeypatch):
    """Requests longer than PROGRAM_SPAN are cut into several programs; the result does not change."""
    monkeypatch.setattr(triton_launcher, "PROGRAM_SPAN", span)
    rng = np.random.default_rng(span)
    for ratio in (1, 4):
        inputs = random_chunk_inputs(rng, SHAPES["multi-block"], ratio, DCP_SETTINGS[dcp_name], with_slice=False)
        host = chunk_host_part(inputs)
        table, _, _ = triton_launcher.program_table([host])
        assert table.shape[0] > host.seq_lens.size  # the split really happened
        assert metadata_as_dict(triton_cpu(inputs)) == metadata_as_dict(build_chunk_metadata_numpy(inputs))


@given(
    lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=20),
    world=st.integers(1, 64),
    interleave=st.integers(1, 64),
)
def test_dcp_shares_partition_every_length_and_rank_zero_holds_the_most(lengths, world, interleave):
    """Why max_local_total_seq_lens is rank 0's total: one pass instead of one per rank."""
    lengths = np.array(lengths)
    shares = np.stack([dcp_local_lens(lengths, r, world, interleave) for r in range(world)])
    assert (shares.sum(axis=0) == lengths).all()
    assert (np.diff(shares, axis=0) <= 0).all()
    inputs = ChunkInputs(
        np.zeros(lengths.size + 1, dtype=np.int64),
        lengths,
        1,
        0,
        lengths.size,
        dcp=DcpConfig(world - 1, world, interleave),
    )
    result = build_chunk_metadata_numpy(inputs)
    if result is not None:
        assert result.max_local_total_seq_lens == int(shares.sum(axis=1).max())


@pytest.mark.parametrize("dcp_name", ["nodcp", "dcp2r1"])
def test_without_token_to_seq_nothing_is_computed_and_the_rest_is_equal(dcp_name, triton_cpu, sentinel_outputs):
    rng = np.random.default_rng(99)
    inputs = random_chunk_inputs(rng, SHAPES["wide"], 1, DCP_SETTINGS[dcp_name])
    host = chunk_host_part(inputs)
    table, kv_bases, _ = triton_launcher.program_table([host], with_token_to_seq=False)
    assert kv_bases == [0, 0] and (table[:, 1] == table[:, 2]).all()  # no program writes a token
    full = chunk_arrays_numpy(host, inputs.dcp)
    for arrays in (chunk_arrays_numpy(host, inputs.dcp, False), triton_cpu.arrays(host, inputs.dcp, False)):
        assert arrays[0].size == 0
        assert arrays[1].tolist() == full[1].tolist() and arrays[2].tolist() == full[2].tolist()
