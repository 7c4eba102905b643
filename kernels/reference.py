"""A slow, literal reference of docs/spec.md: one chunk's metadata (section 1), the chunk plan (section 2) and the
model's ratio set (section 3), written as the spec states them, one request and one row at a time.

The one oracle: served by nothing, only tests import it (``tests/kernels/test_reference.py`` checks that no module of
``service/`` or ``kernels/`` does). Every backend is held to it: the numpy backend (``kernels/numpy_backend.py``, which
serves), the compiled fast path (``service/compute/fastpath.c``) and the Triton kernel (``kernels/triton_kernel.py``).
In the manner of flash-linear-attention's ``fla/ops/*/naive.py``: plain Python loops, no vectorisation, no shared
helper. It calls none of the code it checks (not ``kernels/numpy_backend.py``, not the computations of
``kernels/inputs.py``, not the planner, not ``normalize_compress_ratio``); it takes only their dataclasses, so that a
mistake in them cannot hide in both. Nothing here is fast, and nothing needs to be: keep the inputs small.

Inputs outside the spec's domain (section 5's refusals, section 8's checks) raise :class:`ValueError`; the
reference does not reproduce the service's error messages, only that such inputs have no answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from indexer_service.kernels.inputs import ChunkInputs, ChunkMetadata, DcpConfig
from indexer_service.kernels.planner import BatchInputs, ChunkSpec, PrefillPlan

INT32_MAX = 2**31 - 1

# Spec section 2: the KV workspace is (max_model_len * 40) // r compressed tokens.
WORKSPACE_TOKENS_PER_MODEL_LEN = 40
# Spec section 2: a logit is fp32, 4 bytes.
LOGIT_BYTES = 4


def reference_ratio(compress_ratio: int) -> int:
    """Spec section 3: ``0`` means uncompressed, i.e. ``1``; negative is invalid."""
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int | np.integer):
        raise ValueError(f"compress ratio must be an integer, got {compress_ratio!r}")
    if compress_ratio < 0:
        raise ValueError(f"compress ratio must be >= 0, got {compress_ratio}")
    if compress_ratio == 0:
        return 1
    return int(compress_ratio)


def reference_local(length: int, rank: int, world_size: int, interleave: int) -> int:
    """Spec section 1, DCP sharding: how many of a length-``L`` prefix's tokens live on rank ``k``."""
    L, k, W, I = length, rank, world_size, interleave  # noqa: E741 (the spec's names)
    base = ((L // I) // W) * I
    rest = L - base * W
    return base + min(max(rest - k * I, 0), I)


def reference_local_by_dealing(length: int, rank: int, world_size: int, interleave: int) -> int:
    """Spec section 1, DCP sharding, by its definition rather than its formula: deal the prefix's tokens one by
    one, token ``g`` to rank ``(g // I) mod W``, and count rank ``k``'s. Checks :func:`reference_local`."""
    count = 0
    for g in range(length):
        if (g // interleave) % world_size == rank:
            count += 1
    return count


def _check_batch(qsl: list[int], seq: list[int]) -> None:
    """Spec sections 5 and 8: the batch inputs the formulas are defined on."""
    if len(qsl) < 1 or qsl[0] != 0:
        raise ValueError("query_start_loc must start at 0")
    if len(seq) != len(qsl) - 1:
        raise ValueError("seq_lens must have one element per request")
    for b in range(len(seq)):
        query_len = qsl[b + 1] - qsl[b]
        if query_len < 0:
            raise ValueError(f"query_start_loc decreases at {b + 1}")
        if seq[b] < 0:
            raise ValueError(f"seq_lens[{b}] is negative")
        if seq[b] > INT32_MAX:
            raise ValueError(f"seq_lens[{b}] exceeds int32")
        if seq[b] < query_len:
            raise ValueError(f"seq_lens[{b}] is below its query length")
    if qsl[-1] > INT32_MAX:
        raise ValueError("query_start_loc exceeds int32")


def _check_dcp(dcp: DcpConfig) -> None:
    """Spec section 8: ``0 <= dcp_rank < dcp_world_size <= 65536``, ``dcp_interleave >= 1``,
    ``dcp_world_size * dcp_interleave < 2^31``."""
    if not 0 <= dcp.rank < dcp.world_size <= 65536:
        raise ValueError(f"DCP rank {dcp.rank} of world {dcp.world_size} is out of range")
    if dcp.interleave < 1:
        raise ValueError(f"DCP interleave {dcp.interleave} must be >= 1")
    if dcp.world_size * dcp.interleave > INT32_MAX:
        raise ValueError("dcp_world_size * dcp_interleave must fit int32")


def reference_chunk_metadata(inputs: ChunkInputs) -> ChunkMetadata | None:
    """Spec section 1: one chunk's metadata, or None when the chunk has no compressed token (``T == 0``)."""
    qsl = [int(x) for x in inputs.query_start_loc]
    S = [int(x) for x in inputs.seq_lens]
    _check_batch(qsl, S)
    r = reference_ratio(inputs.compress_ratio)
    _check_dcp(inputs.dcp)
    k, W, I = inputs.dcp.rank, inputs.dcp.world_size, inputs.dcp.interleave  # noqa: E741 (the spec's names)
    with_dcp = W > 1  # spec section 1: "With world size W > 1"
    s, e = inputs.req_start, inputs.req_end
    B = len(S)
    # Spec section 5: a request range outside [0, B] is refused.
    if not 0 <= s <= e <= B:
        raise ValueError(f"request range [{s}, {e}) is outside [0, {B}]")
    R = e - s

    # Spec section 1, derived values: C[b] = S[b] // r.
    C = [0] * B
    for b in range(B):
        C[b] = S[b] // r
    # T = C[s] + ... + C[e-1].
    T = 0
    for b in range(s, e):
        T += C[b]
    # Spec section 5: totals beyond int32 are refused.
    if T > INT32_MAX:
        raise ValueError(f"total compressed length {T} exceeds int32")
    # Q = qsl[e] - qsl[s].
    Q = qsl[e] - qsl[s]
    # query_slice [a, b): absent means all Q rows of the chunk. (`b` is the request index above; the slice's
    # stop is `a_stop` here to keep both.)
    if inputs.query_slice is None:
        a, a_stop = 0, Q
        slice_given = False
    else:
        a, a_stop = int(inputs.query_slice[0]), int(inputs.query_slice[1])
        slice_given = True
    # Spec section 5: a slice outside [0, Q) is refused.
    if not 0 <= a <= a_stop <= Q:
        raise ValueError(f"query slice [{a}, {a_stop}) is outside [0, {Q}]")
    # Spec section 1: "If T == 0 there is no chunk."
    if T == 0:
        return None

    # q'[i] = qsl[s+i] - qsl[s] for i = 0..R.
    q_prime = [0] * (R + 1)
    for i in range(R + 1):
        q_prime[i] = qsl[s + i] - qsl[s]
    # q[i] = q'[i+1] - q'[i].
    q = [0] * R
    for i in range(R):
        q[i] = q_prime[i + 1] - q_prime[i]
    # p0[i] = S[s+i] - q[i]: request i's first new position (its context length).
    p0 = [0] * R
    for i in range(R):
        p0[i] = S[s + i] - q[i]

    # Outputs. cu_seq_lens [R+1] = cumsum0(C[s..e-1]).
    cu_seq_lens = [0] * (R + 1)
    for i in range(R):
        cu_seq_lens[i + 1] = cu_seq_lens[i] + C[s + i]

    # token_to_seq [T]: for t in [cu[i], cu[i+1]): i.
    token_to_seq = [0] * T
    for i in range(R):
        for t in range(cu_seq_lens[i], cu_seq_lens[i + 1]):
            token_to_seq[t] = i

    # local_cu_seq_lens [R+1]: without DCP, cu_seq_lens; with DCP, cumsum0(local(C[b])) for this rank.
    local_cu_seq_lens = [0] * (R + 1)
    for i in range(R):
        share = reference_local(C[s + i], k, W, I) if with_dcp else C[s + i]
        local_cu_seq_lens[i + 1] = local_cu_seq_lens[i] + share
    # local_total_seq_lens: T, or local_cu_seq_lens[R] with DCP.
    local_total_seq_lens = local_cu_seq_lens[R] if with_dcp else T
    # max_local_total_seq_lens: T, or the largest per-rank total over all ranks with DCP. Literally over every
    # rank (the spec's remark that it is always rank 0's is what the fast paths rely on; this does not).
    if with_dcp:
        max_local_total_seq_lens = 0
        for rank in range(W):
            rank_total = 0
            for i in range(R):
                rank_total += reference_local(C[s + i], rank, W, I)
            max_local_total_seq_lens = max(max_local_total_seq_lens, rank_total)
    else:
        max_local_total_seq_lens = T

    # rowstart[i]: cu_seq_lens[i] without DCP, local_cu_seq_lens[i] with it.
    rowstart = local_cu_seq_lens if with_dcp else cu_seq_lens

    # cu_seqlen_ks / cu_seqlen_ke [b-a]: one entry per chunk row in [a, b).
    cu_seqlen_ks = [0] * (a_stop - a)
    cu_seqlen_ke = [0] * (a_stop - a)
    for row in range(a, a_stop):
        # The request i the row belongs to: q'[i] <= row < q'[i+1] (a request with q = 0 owns no row).
        owner = -1
        for i in range(R):
            if q_prime[i] <= row < q_prime[i + 1]:
                owner = i
        if owner < 0:
            raise AssertionError(f"row {row} belongs to no request")  # cannot happen: [a, b) is inside [0, Q)
        i = owner
        # Query j = row - q'[i] sees the causal prefix of p0[i] + 1 + j uncompressed tokens: L = (...) // r.
        j = row - q_prime[i]
        L = (p0[i] + 1 + j) // r
        # With DCP, L -> local(L) for this rank.
        if with_dcp:
            L = reference_local(L, k, W, I)
        cu_seqlen_ks[row - a] = rowstart[i]
        cu_seqlen_ke[row - a] = rowstart[i] + L

    # token_start, token_end: qsl[s] + a, qsl[s] + b.
    token_start = qsl[s] + a
    token_end = qsl[s] + a_stop
    # skip_kv_gather: the request's flag OR (a slice was given AND a > 0).
    skip_kv_gather = bool(inputs.skip_kv_gather) or (slice_given and a > 0)

    return ChunkMetadata(
        cu_seq_lens=np.array(cu_seq_lens, dtype=np.int32),
        token_to_seq=np.array(token_to_seq, dtype=np.int32),
        cu_seqlen_ks=np.array(cu_seqlen_ks, dtype=np.int32),
        cu_seqlen_ke=np.array(cu_seqlen_ke, dtype=np.int32),
        total_seq_lens=T,
        token_start=token_start,
        token_end=token_end,
        num_reqs=R,
        skip_kv_gather=skip_kv_gather,
        # Spec section 8: an equal array, not the same object, when DCP is off.
        local_cu_seq_lens=np.array(local_cu_seq_lens, dtype=np.int32),
        local_total_seq_lens=local_total_seq_lens,
        max_local_total_seq_lens=max_local_total_seq_lens,
        # req_start, req_end, query_slice: the chunk itself, echoed.
        req_start=s,
        req_end=e,
        query_slice=(a, a_stop),
    )


def reference_workspace(max_model_len: int, compress_ratio: int) -> int:
    """Spec section 2: ``workspace = (max_model_len * 40) // r`` compressed tokens."""
    return (max_model_len * WORKSPACE_TOKENS_PER_MODEL_LEN) // reference_ratio(compress_ratio)


def reference_plan(
    seq: Sequence[int], q: Sequence[int], workspace: int, E: int, request_offset: int = 0
) -> list[ChunkSpec]:
    """Spec section 2, the greedy plan over contiguous requests. ``seq``: compressed lengths, ``q``: query counts,
    ``E``: the logits budget in fp32 elements; ``request_offset`` (``nd``) is added to the request indices."""
    seq = [int(x) for x in seq]
    q = [int(x) for x in q]
    if len(seq) != len(q):
        raise ValueError("seq and q must have one element per request")
    plan: list[ChunkSpec] = []
    n = len(seq)
    start = 0  # the first unplanned request
    while start < n:
        # Rule 2: a chunk's first request is taken even when it alone breaks a budget.
        M, N = q[start], seq[start]
        end = start + 1
        # Rule 1: keep adding the next request while the running totals M = Σq and N = Σseq satisfy
        # N <= workspace and M * N <= E.
        while end < n:
            next_M, next_N = M + q[end], N + seq[end]
            if not (next_N <= workspace and next_M * next_N <= E):
                break
            M, N = next_M, next_N
            end += 1
        # Rule 3: max_q = max(1, E // N) when N > 0, else max(1, M).
        max_q = max(1, E // N) if N > 0 else max(1, M)
        # Emit (requests [start+nd, end+nd), rows [o, min(o+max_q, M))) for o = 0, max_q, ...; M = 0 emits nothing.
        o = 0
        while o < M:
            plan.append(ChunkSpec(start + request_offset, end + request_offset, o, min(o + max_q, M)))
            o += max_q
        start = end
    return plan


def reference_prefill_batch(batch: BatchInputs) -> PrefillPlan:
    """Spec section 2, ``PlanBatch``: the plan of the prefill requests ``[nd, B)``, each chunk built as in section 1
    with its slice and ``skip_kv_gather = (o > 0)``, the chunks with ``T = 0`` left without metadata."""
    qsl = [int(x) for x in batch.query_start_loc]
    S = [int(x) for x in batch.seq_lens]
    _check_batch(qsl, S)
    r = reference_ratio(batch.compress_ratio)
    B = len(S)
    nd = batch.num_decodes
    if not 0 <= nd <= B:
        raise ValueError(f"num_decodes {nd} is outside [0, {B}]")
    if batch.max_model_len < 1:
        raise ValueError("max_model_len must be >= 1")
    if batch.max_logits_bytes < LOGIT_BYTES:
        raise ValueError(f"max_logits_bytes must be >= {LOGIT_BYTES}")
    # seq = C[nd:] (compressed), q = diff(qsl[nd:]) (query counts).
    seq = [S[b] // r for b in range(nd, B)]
    q = [qsl[b + 1] - qsl[b] for b in range(nd, B)]
    workspace = reference_workspace(batch.max_model_len, batch.compress_ratio)
    E = batch.max_logits_bytes // LOGIT_BYTES
    chunks = reference_plan(seq, q, workspace, E, request_offset=nd)
    metadata: list[ChunkMetadata] = []
    for chunk in chunks:
        meta = reference_chunk_metadata(
            ChunkInputs(
                query_start_loc=batch.query_start_loc,
                seq_lens=batch.seq_lens,
                compress_ratio=batch.compress_ratio,
                req_start=chunk.req_start,
                req_end=chunk.req_end,
                query_slice=(chunk.query_start, chunk.query_stop),
                skip_kv_gather=chunk.query_start > 0,
                dcp=batch.dcp,
            )
        )
        if meta is not None:
            metadata.append(meta)
    # max_prefill_seq_len = max(S[nd:]), 0 without prefill requests.
    max_prefill_seq_len = 0
    for b in range(nd, B):
        max_prefill_seq_len = max(max_prefill_seq_len, S[b])
    return PrefillPlan(chunks=chunks, metadata=metadata, max_prefill_seq_len=max_prefill_seq_len)


def reference_warmup_compress_ratios(compress_ratios: Sequence[int] | None, index_kpool: int | None) -> tuple[int, ...]:
    """Spec section 3, the model's ratio set: every value of ``compress_ratios`` (or ``[1]`` when absent or empty),
    then ``index_kpool`` (absent or 0: 1), each normalised, duplicates dropped, first-seen order."""
    ratios = list(compress_ratios) if compress_ratios else [1]
    ratios.append(index_kpool if index_kpool else 1)
    seen: list[int] = []
    for ratio in ratios:
        normalised = reference_ratio(ratio)
        if normalised not in seen:
            seen.append(normalised)
    return tuple(seen)
