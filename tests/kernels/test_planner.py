"""Chunk planning (spec section 2) and the builder's prefill loop."""

from __future__ import annotations

import numpy as np
import pytest

from indexer_service.kernels import planner
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.kernels.planner import (
    BatchInputs,
    ChunkSpec,
    PlanTooLargeError,
    build_prefill_batch,
    plan_prefill_batch,
    plan_prefill_chunks,
    prefill_workspace_size,
)
from testkit.batches import BatchShape, random_batch
from tests.golden import GOLDEN, case_id


@pytest.mark.parametrize("case", GOLDEN["chunk_plan"], ids=case_id)
def test_plan_matches_golden(case):
    spec = case["input"]
    plan = plan_prefill_chunks(
        spec["cseq"], spec["qlens"], spec["workspace"], spec["max_logits_bytes"] // 4, spec.get("offset", 0)
    )
    assert [{"requests": [c.req_start, c.req_end], "query_slice": [c.query_start, c.query_stop]} for c in plan] == (
        case["expected"]
    )


def test_spec_e3_plan_then_build():
    batch = BatchInputs(
        np.array([0, 1, 7]), np.array([30, 10]), 1, num_decodes=1, max_model_len=1000, max_logits_bytes=160
    )
    plan = build_prefill_batch(batch, build_chunk_metadata_numpy)
    assert plan.chunks == [ChunkSpec(1, 2, 0, 4), ChunkSpec(1, 2, 4, 6)]
    first, second = plan.metadata
    assert first.cu_seqlen_ke.tolist() == [5, 6, 7, 8] and not first.skip_kv_gather
    assert second.cu_seqlen_ke.tolist() == [9, 10] and second.skip_kv_gather
    assert (second.token_start, second.token_end) == (5, 7)
    assert plan.max_prefill_seq_len == 10


def test_at_scale_default_budget_splits_one_request_in_four():
    workspace = prefill_workspace_size(2**20, 4)
    assert workspace == 10_485_760
    plan = plan_prefill_chunks([65_536], [8_192], workspace, 512 * 2**20 // 4)
    assert [(c.query_start, c.query_stop) for c in plan] == [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8192)]


def test_zero_query_requests_emit_nothing():
    assert plan_prefill_chunks([5, 9], [0, 0], 100, 1000) == []


@pytest.mark.parametrize(
    ("seq", "queries", "workspace", "logits", "max_chunks"),
    [
        ([1, 1], [-3, 5], 1, 1, 4),  # one request per chunk: -3 rows make none, 5 rows five
        ([1, 1], [-3, 5], 1, 1, 5),
        ([1], [-5], 1, 1, 0),
        ([5, 9], [0, 0], 1000, 100, 0),
        ([100], [4096], 1000, 100, 4096),
        ([100], [4096], 1000, 100, 4095),
    ],
    ids=["negative-query-over", "negative-query-at", "negative-only", "no-queries", "at-limit", "one-over-limit"],
)
def test_admit_sees_the_plans_chunk_count_before_any_chunk(seq, queries, workspace, logits, max_chunks, monkeypatch):
    """The count admission sees is the plan's length, and the limit applies to that same count; a plan the
    limit or admission refuses has made no chunk. (The planner itself does not reject negative lengths: the
    service validates a request first.)"""
    made, seen = [], []
    monkeypatch.setattr(planner, "ChunkSpec", lambda *a: made.append(a) or ChunkSpec(*a))
    unlimited = plan_prefill_chunks(seq, queries, workspace, logits)
    made.clear()
    if len(unlimited) > max_chunks:
        with pytest.raises(PlanTooLargeError):
            plan_prefill_chunks(seq, queries, workspace, logits, max_chunks=max_chunks, admit=seen.append)
        assert seen == [] and made == []
    else:
        plan = plan_prefill_chunks(seq, queries, workspace, logits, max_chunks=max_chunks, admit=seen.append)
        assert seen == [len(plan)] and plan == unlimited


def test_oversize_request_is_emitted_alone():
    plan = plan_prefill_chunks([3, 500, 2], [1, 1, 1], 100, 10_000)
    assert [(c.req_start, c.req_end) for c in plan] == [(0, 1), (1, 2), (2, 3)]


def test_chunks_with_no_compressed_token_are_dropped():
    # ratio 4, the first prefill has S = 3 < 4: its chunk has T == 0 and is dropped.
    batch = BatchInputs(
        np.array([0, 3, 7]), np.array([3, 40]), 4, num_decodes=0, max_model_len=100, max_logits_bytes=4 * 12
    )
    plan = build_prefill_batch(batch, build_chunk_metadata_numpy)
    assert plan.chunks[0] == ChunkSpec(0, 1, 0, 3)
    assert all(m.req_start != 0 for m in plan.metadata)
    assert len(plan.metadata) == len(plan.chunks) - 1


@pytest.mark.parametrize("seed", range(20))
def test_plan_covers_every_prefill_row_once_within_budgets(seed):
    rng = np.random.default_rng(seed)
    qsl, seq = random_batch(rng, BatchShape(int(rng.integers(1, 30)), 60, 400))
    num_decodes = int(rng.integers(0, seq.size))
    batch = BatchInputs(qsl, seq, 4, num_decodes, max_model_len=50, max_logits_bytes=int(rng.integers(4, 40_000)))
    chunks = plan_prefill_batch(batch)
    covered = []
    for c in chunks:
        rows = range(qsl[c.req_start] + c.query_start, qsl[c.req_start] + c.query_stop)
        assert c.query_stop <= qsl[c.req_end] - qsl[c.req_start]
        covered.extend(rows)
        kv = int((seq[c.req_start : c.req_end] // 4).sum())
        if c.req_end - c.req_start > 1:  # several requests only ever share a chunk within both budgets
            assert kv <= 2000 and (c.query_stop - c.query_start) * kv <= batch.max_logits_bytes // 4
    assert covered == list(range(qsl[num_decodes], qsl[-1]))
    for meta in build_prefill_batch(batch, build_chunk_metadata_numpy).metadata:
        inputs = ChunkInputs(qsl, seq, 4, meta.req_start, meta.req_end, meta.query_slice, meta.skip_kv_gather)
        assert meta.cu_seqlen_ke.tolist() == build_chunk_metadata_numpy(inputs).cu_seqlen_ke.tolist()
