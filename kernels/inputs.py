"""Inputs and outputs of one prefill chunk's metadata build, their validation, and the host-side part
that every backend shares (spec section 1 and section 8).

vLLM trusts its inputs because it built them itself; a service receives them from the network. Every
check here raises :class:`InvalidInputError` naming the field and the index, before anything is
allocated, so a bad request never produces a half-written result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from indexer_service.kernels.formulas import compressed, dcp_local_lens
from indexer_service.kernels.specialization import normalize_compress_ratio

INT32_MAX = 2**31 - 1


class InvalidInputError(ValueError):
    """A request field is invalid. ``field`` and ``index`` say where (index is None for scalars)."""

    def __init__(self, field: str, message: str, index: int | None = None) -> None:
        self.field = field
        self.index = index
        where = field if index is None else f"{field}[{index}]"
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class DcpConfig:
    """Decode-context-parallel sharding of the KV buffer: rank ``rank`` of ``world_size``."""

    rank: int = 0
    world_size: int = 1
    interleave: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class ChunkInputs:
    """One chunk: requests ``[req_start, req_end)`` of a batch, optionally only query rows ``query_slice``."""

    query_start_loc: np.ndarray  # [B+1], absolute, starts at 0
    seq_lens: np.ndarray  # [B], uncompressed
    compress_ratio: int
    req_start: int
    req_end: int
    query_slice: tuple[int, int] | None = None
    skip_kv_gather: bool = False
    dcp: DcpConfig = DcpConfig()


@dataclass
class ChunkMetadata:
    """Everything the indexer's prefill pass needs for one chunk. Arrays are int32."""

    cu_seq_lens: np.ndarray
    token_to_seq: np.ndarray
    cu_seqlen_ks: np.ndarray
    cu_seqlen_ke: np.ndarray
    total_seq_lens: int
    token_start: int
    token_end: int
    num_reqs: int
    skip_kv_gather: bool
    local_cu_seq_lens: np.ndarray
    local_total_seq_lens: int
    max_local_total_seq_lens: int
    req_start: int
    req_end: int
    query_slice: tuple[int, int]


# ChunkMetadata's fields by kind, read from the dataclass: whatever converts or compares metadata iterates these
# instead of naming every field again (``query_slice``, a pair, is the one left to spell out).
METADATA_ARRAY_FIELDS = tuple(f.name for f in fields(ChunkMetadata) if f.type == "np.ndarray")
METADATA_SCALAR_FIELDS = tuple(f.name for f in fields(ChunkMetadata) if f.type in ("int", "bool"))


@dataclass(frozen=True)
class ChunkHostPart:
    """What the host computes before any kernel runs; shared by the numpy and the Triton backends."""

    ratio: int
    query_start: np.ndarray  # [R+1] rebased to 0: q'
    seq_lens: np.ndarray  # [R]
    cu_seq_lens: np.ndarray  # [R+1]
    local_cu_seq_lens: np.ndarray  # [R+1], the same object as cu_seq_lens without DCP
    total: int
    local_total: int
    max_local_total: int
    query_slice: tuple[int, int]
    token_start: int
    token_end: int
    skip_kv_gather: bool


def as_int_array(values: object, field: str) -> np.ndarray:
    """A 1-D int64 copy of ``values``; anything else (floats, 2-D) is an error naming the field."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise InvalidInputError(field, f"must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise InvalidInputError(field, f"must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def validate_batch(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Check a whole batch's offsets and lengths; returns them as int64 arrays."""
    qsl = as_int_array(query_start_loc, "query_start_loc")
    seq = as_int_array(seq_lens, "seq_lens")
    if qsl.size == 0:
        raise InvalidInputError("query_start_loc", "must hold at least one element (0)")
    if qsl[0] != 0:
        raise InvalidInputError("query_start_loc", f"must start at 0, got {qsl[0]}", 0)
    if seq.size != qsl.size - 1:
        raise InvalidInputError(
            "seq_lens", f"has {seq.size} elements but query_start_loc implies {qsl.size - 1} requests"
        )
    query_lens = np.diff(qsl)
    if (query_lens < 0).any():
        i = _first(query_lens < 0) + 1
        raise InvalidInputError("query_start_loc", f"must be non-decreasing, got {qsl[i]} after {qsl[i - 1]}", i)
    if qsl[-1] > INT32_MAX:
        raise InvalidInputError("query_start_loc", f"exceeds int32 ({qsl[-1]})", qsl.size - 1)
    if (seq < 0).any():
        i = _first(seq < 0)
        raise InvalidInputError("seq_lens", f"must be >= 0, got {seq[i]}", i)
    if (seq > INT32_MAX).any():
        i = _first(seq > INT32_MAX)
        raise InvalidInputError("seq_lens", f"exceeds int32 ({seq[i]})", i)
    if (seq < query_lens).any():
        i = _first(seq < query_lens)
        raise InvalidInputError("seq_lens", f"must be >= the request's query length {query_lens[i]}, got {seq[i]}", i)
    return qsl, seq


# No deployment shards a KV cache over more ranks than it has GPUs; the bound keeps a typo from being a request.
MAX_DCP_WORLD_SIZE = 65536


def validate_dcp(dcp: DcpConfig) -> None:
    if not 1 <= dcp.world_size <= MAX_DCP_WORLD_SIZE:
        raise InvalidInputError("dcp_world_size", f"must be in [1, {MAX_DCP_WORLD_SIZE}], got {dcp.world_size}")
    if not 0 <= dcp.rank < dcp.world_size:
        raise InvalidInputError("dcp_rank", f"must be in [0, {dcp.world_size}), got {dcp.rank}")
    if dcp.interleave < 1:
        raise InvalidInputError("dcp_interleave", f"must be >= 1, got {dcp.interleave}")
    # The kernels compute rank * interleave (< world_size * interleave) in int32.
    if dcp.world_size * dcp.interleave > INT32_MAX:
        raise InvalidInputError(
            "dcp_interleave", f"dcp_world_size * dcp_interleave must fit int32, got {dcp.world_size * dcp.interleave}"
        )


@dataclass(frozen=True)
class ValidBatch:
    """A request's batch once validated: its offsets and lengths (int64) and its normalised compress ratio. The
    later steps of the request share it, so each check and the ratio's normalisation run once per request."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    ratio: int


def validate_request(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, compress_ratio: object, dcp: DcpConfig
) -> ValidBatch:
    """Check a request's batch, then its DCP settings, then its compress ratio (a malformed array is named
    first), and normalise the ratio: the one place a request's ratio is normalised."""
    qsl, seq = validate_batch(query_start_loc, seq_lens)
    validate_dcp(dcp)
    try:
        ratio = normalize_compress_ratio(compress_ratio)
    except ValueError as exc:
        raise InvalidInputError("compress_ratio", str(exc)) from None
    return ValidBatch(qsl, seq, ratio)


ChunkArrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # token_to_seq, cu_seqlen_ks, cu_seqlen_ke: a backend's part


def chunk_host_part(inputs: ChunkInputs) -> ChunkHostPart | None:
    """Validate one chunk and compute its host-side fields; None when it has no compressed token."""
    return chunk_host_parts([inputs])[0]


def chunk_host_parts(chunks: Sequence[ChunkInputs], valid: ValidBatch | None = None) -> list[ChunkHostPart | None]:
    """:func:`chunk_host_part` of several chunks. Chunks sharing a batch validate it once; ``valid``: every chunk
    is of this batch, which its request has validated already (the service's check), so it is not again."""
    validated: dict[tuple[int, int, object, DcpConfig], ValidBatch] = {}
    parts = []
    for inputs in chunks:
        if valid is None:
            batch = (id(inputs.query_start_loc), id(inputs.seq_lens), inputs.compress_ratio, inputs.dcp)
            if batch not in validated:
                validated[batch] = validate_request(
                    inputs.query_start_loc, inputs.seq_lens, inputs.compress_ratio, inputs.dcp
                )
        parts.append(_chunk_host_part(inputs, valid or validated[batch]))
    return parts


def _chunk_host_part(inputs: ChunkInputs, valid: ValidBatch) -> ChunkHostPart | None:
    qsl, seq, ratio = valid.query_start_loc, valid.seq_lens, valid.ratio
    num_requests = seq.size
    s, e = inputs.req_start, inputs.req_end
    if not 0 <= s <= num_requests:
        raise InvalidInputError("req_start", f"must be in [0, {num_requests}], got {s}")
    if not s <= e <= num_requests:
        raise InvalidInputError("req_end", f"must be in [{s}, {num_requests}], got {e}")

    chunk_seq = seq[s:e]
    compressed_seq = compressed(chunk_seq, ratio)
    cu = np.zeros(e - s + 1, dtype=np.int64)
    np.cumsum(compressed_seq, out=cu[1:])
    total = int(cu[-1])
    if total > INT32_MAX:
        raise InvalidInputError("seq_lens", f"total compressed length {total} exceeds int32")

    num_queries = int(qsl[e] - qsl[s])
    a, b = inputs.query_slice if inputs.query_slice is not None else (0, num_queries)
    if not 0 <= a <= num_queries:
        raise InvalidInputError("query_slice", f"start must be in [0, {num_queries}], got {a}", 0)
    if not a <= b <= num_queries:
        raise InvalidInputError("query_slice", f"stop must be in [{a}, {num_queries}], got {b}", 1)
    if total == 0:
        return None

    if inputs.dcp.enabled:
        dcp = inputs.dcp
        local = dcp_local_lens(compressed_seq, dcp.rank, dcp.world_size, dcp.interleave)
        local_cu = np.zeros_like(cu)
        np.cumsum(local, out=local_cu[1:])
        # Rank 0 holds the largest share of every length (a rank's share never grows with its index), so the
        # largest per-rank total is rank 0's: one pass, whatever the world size.
        local_total = int(local_cu[-1])
        max_local_total = int(dcp_local_lens(compressed_seq, 0, dcp.world_size, dcp.interleave).sum())
    else:
        local_cu, local_total, max_local_total = cu, total, total

    base = int(qsl[s])
    return ChunkHostPart(
        ratio=ratio,
        query_start=qsl[s : e + 1] - base,
        seq_lens=chunk_seq,
        cu_seq_lens=cu,
        local_cu_seq_lens=local_cu,
        total=total,
        local_total=local_total,
        max_local_total=max_local_total,
        query_slice=(a, b),
        token_start=base + a,
        token_end=base + b,
        skip_kv_gather=bool(inputs.skip_kv_gather or (inputs.query_slice is not None and a > 0)),
    )


def assemble(
    inputs: ChunkInputs,
    host: ChunkHostPart,
    token_to_seq: np.ndarray,
    ks: np.ndarray,
    ke: np.ndarray,
) -> ChunkMetadata:
    """The chunk's metadata from the host part and the three arrays a backend computed."""
    cu32 = host.cu_seq_lens.astype(np.int32)
    local32 = cu32 if host.local_cu_seq_lens is host.cu_seq_lens else host.local_cu_seq_lens.astype(np.int32)
    return ChunkMetadata(
        cu_seq_lens=cu32,
        token_to_seq=token_to_seq,
        cu_seqlen_ks=ks,
        cu_seqlen_ke=ke,
        total_seq_lens=host.total,
        token_start=host.token_start,
        token_end=host.token_end,
        num_reqs=inputs.req_end - inputs.req_start,
        skip_kv_gather=host.skip_kv_gather,
        local_cu_seq_lens=local32,
        local_total_seq_lens=host.local_total,
        max_local_total_seq_lens=host.max_local_total,
        req_start=inputs.req_start,
        req_end=inputs.req_end,
        query_slice=host.query_slice,
    )
