"""Chunk planning of a prefill batch (spec section 2) and the builder's prefill loop.

A chunk is bounded by two budgets: the compressed tokens it gathers must fit the KV workspace, and the
logits of its queries against those tokens (``sum(q) * sum(C)`` fp32 values) must fit the logits budget.
A single request too large for the logits budget is split along its queries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from indexer_service.kernels.formulas import compressed
from indexer_service.kernels.inputs import (
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    InvalidInputError,
    ValidBatch,
    validate_request,
)

DEFAULT_MAX_LOGITS_BYTES = 512 * 2**20  # VLLM_SPARSE_INDEXER_MAX_LOGITS_MB default
WORKSPACE_TOKENS_PER_MODEL_LEN = 40


class PlanTooLargeError(Exception):
    """A plan would have more chunks than the caller allows; raised before the plan is built."""

    def __init__(self, max_chunks: int) -> None:
        super().__init__(f"the plan has more than {max_chunks} chunks")
        self.max_chunks = max_chunks


@dataclass(frozen=True, slots=True)  # slots: a plan can hold thousands (max_plan_chunks), each without a dict
class ChunkSpec:
    """Requests ``[req_start, req_end)`` (absolute) and chunk-local query rows ``[query_start, query_stop)``."""

    req_start: int
    req_end: int
    query_start: int
    query_stop: int


def prefill_workspace_size(max_model_len: int, ratio: int) -> int:
    """Compressed KV tokens one chunk may gather (vLLM's ``get_max_prefill_buffer_size``); ``ratio`` is
    normalised (:func:`~kernels.inputs.validate_request`)."""
    return (max_model_len * WORKSPACE_TOKENS_PER_MODEL_LEN) // ratio


def plan_prefill_chunks(
    compressed_seq_lens: Sequence[int] | np.ndarray,
    query_lens: Sequence[int] | np.ndarray,
    workspace_size: int,
    max_logits_elems: int,
    request_offset: int = 0,
    max_chunks: int | None = None,
    admit: Callable[[int], None] | None = None,
) -> list[ChunkSpec]:
    """Greedy plan over contiguous requests (spec section 2); ``request_offset`` is added to request indices.

    The chunk count is known before any chunk is made: with ``max_chunks``, a plan that would pass it raises
    :class:`PlanTooLargeError`; then ``admit(count)`` is called, and may raise to refuse the plan (the service
    admits the work there). Either way a refused plan has made no chunk: each costs fixed time downstream, and
    thousands of small objects made and dropped per refused call fragment the allocator's arenas.
    """
    seq = [int(x) for x in compressed_seq_lens]
    queries = [int(x) for x in query_lens]
    if len(seq) != len(queries):
        raise InvalidInputError("query_lens", f"has {len(queries)} elements, compressed_seq_lens has {len(seq)}")
    if workspace_size < 0:
        raise InvalidInputError("workspace_size", f"must be >= 0, got {workspace_size}")
    if max_logits_elems < 1:
        raise InvalidInputError("max_logits_elems", f"must be >= 1, got {max_logits_elems}")

    groups: list[tuple[int, int, int, int]] = []  # requests [start, end) planned together, their rows, rows a chunk
    chunks = 0
    start, count = 0, len(seq)
    while start < count:
        total_q, total_kv = 0, 0
        end = start
        while end < count:
            next_q, next_kv = total_q + queries[end], total_kv + seq[end]
            fits = next_kv <= workspace_size and next_q * next_kv <= max_logits_elems
            if not fits and end > start:
                break
            total_q, total_kv = next_q, next_kv
            end += 1
            if not fits:  # the first request of a chunk is taken alone even when it does not fit
                break
        max_q = max(1, max_logits_elems // total_kv) if total_kv > 0 else max(1, total_q)
        chunks += len(range(0, total_q, max_q))  # the chunks made below (none for total_q <= 0)
        if max_chunks is not None and chunks > max_chunks:
            raise PlanTooLargeError(max_chunks)
        groups.append((start + request_offset, end + request_offset, total_q, max_q))
        start = end
    if admit is not None:
        admit(chunks)
    return [
        ChunkSpec(first, end, offset, min(offset + max_q, total_q))
        for first, end, total_q, max_q in groups
        for offset in range(0, total_q, max_q)
    ]


@dataclass(frozen=True)
class BatchInputs:
    """A whole batch: the first ``num_decodes`` requests are decodes and are not planned."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    compress_ratio: int
    num_decodes: int
    max_model_len: int
    max_logits_bytes: int = DEFAULT_MAX_LOGITS_BYTES
    dcp: DcpConfig = DcpConfig()


@dataclass
class PrefillPlan:
    chunks: list[ChunkSpec]
    metadata: list[ChunkMetadata]  # one per non-empty chunk, in plan order
    max_prefill_seq_len: int


ChunkBuilder = Callable[[ChunkInputs], "ChunkMetadata | None"]


def plan_prefill_batch(
    batch: BatchInputs,
    max_chunks: int | None = None,
    valid: ValidBatch | None = None,
    admit: Callable[[int], None] | None = None,
) -> list[ChunkSpec]:
    """Validate a batch (unless ``valid``: its request has been, see :func:`~kernels.inputs.validate_request`)
    and plan its prefill requests into chunks (at most ``max_chunks``; ``admit`` sees the chunk count before
    any chunk is made, see :func:`plan_prefill_chunks`)."""
    if valid is None:
        valid = validate_request(batch.query_start_loc, batch.seq_lens, batch.compress_ratio, batch.dcp)
    qsl, seq, ratio = valid.query_start_loc, valid.seq_lens, valid.ratio
    if not 0 <= batch.num_decodes <= seq.size:
        raise InvalidInputError("num_decodes", f"must be in [0, {seq.size}], got {batch.num_decodes}")
    if batch.max_model_len < 1:
        raise InvalidInputError("max_model_len", f"must be >= 1, got {batch.max_model_len}")
    if batch.max_logits_bytes < 4:
        raise InvalidInputError("max_logits_bytes", f"must be >= 4, got {batch.max_logits_bytes}")
    nd = batch.num_decodes
    return plan_prefill_chunks(
        compressed(seq[nd:], ratio),
        np.diff(qsl[nd:]),
        prefill_workspace_size(batch.max_model_len, ratio),
        batch.max_logits_bytes // 4,
        request_offset=nd,
        max_chunks=max_chunks,
        admit=admit,
    )


def chunk_inputs_of_plan(batch: BatchInputs, chunks: Sequence[ChunkSpec]) -> list[ChunkInputs]:
    """What the builder passes to the per-chunk build for each planned chunk."""
    return [
        ChunkInputs(
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            compress_ratio=batch.compress_ratio,
            req_start=spec.req_start,
            req_end=spec.req_end,
            query_slice=(spec.query_start, spec.query_stop),
            skip_kv_gather=spec.query_start > 0,
            dcp=batch.dcp,
        )
        for spec in chunks
    ]


def max_prefill_seq_len(batch: BatchInputs) -> int:
    prefill_seq = np.asarray(batch.seq_lens)[batch.num_decodes :]
    return int(prefill_seq.max()) if prefill_seq.size else 0


def build_prefill_batch(batch: BatchInputs, build_chunk: ChunkBuilder) -> PrefillPlan:
    """The builder's prefill part: plan, build every chunk, drop the chunks with no compressed token."""
    chunks = plan_prefill_batch(batch)
    built = (build_chunk(inputs) for inputs in chunk_inputs_of_plan(batch, chunks))
    return PrefillPlan(chunks, [meta for meta in built if meta is not None], max_prefill_seq_len(batch))
