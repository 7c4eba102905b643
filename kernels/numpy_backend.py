"""The numpy backend: one chunk's metadata, vectorised over tokens and rows. The service serves from it on CPU
(and proves Triton variants against it at warmup); it is not the oracle.

The one oracle is ``kernels/reference.py``, written apart from this file: tests hold this backend, the Triton
kernel and ``service/compute/fastpath.c`` equal to it for every valid input.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from indexer_service.kernels.formulas import causal_position, compressed, dcp_local_lens
from indexer_service.kernels.inputs import (
    ChunkArrays,
    ChunkHostPart,
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    assemble,
    chunk_host_part,
)


def chunk_arrays_numpy(host: ChunkHostPart, dcp: DcpConfig, with_token_to_seq: bool = True) -> ChunkArrays:
    """``token_to_seq`` (empty when not wanted), ``cu_seqlen_ks`` and ``cu_seqlen_ke`` of one chunk (int32)."""
    cu = host.cu_seq_lens
    if with_token_to_seq:
        token_to_seq = np.repeat(np.arange(cu.size - 1, dtype=np.int32), np.diff(cu))
    else:
        token_to_seq = np.zeros(0, dtype=np.int32)

    a, b = host.query_slice
    if b == a:
        empty = np.zeros(0, dtype=np.int32)
        return token_to_seq, empty, empty
    starts = host.query_start
    # Only the requests whose rows meet [a, b) contribute, each with its rows inside [a, b): the work is
    # O(b - a), not O(the request's queries), which matters for plans that cut one request into many slices.
    first = int(np.searchsorted(starts, a, side="right")) - 1
    last = int(np.searchsorted(starts, b, side="left"))
    requests = slice(first, last)
    lo, hi = starts[first:last], starts[first + 1 : last + 1]
    rows_inside = np.minimum(hi, b) - np.maximum(lo, a)
    # Chunk row r of request i is its row r - q'_i: the position of chunk row 0, plus r.
    shift = causal_position(host.seq_lens[requests], hi - lo, -lo).astype(np.int32)
    position = np.repeat(shift, rows_inside)
    position += np.arange(a, b, dtype=np.int32)
    visible = compressed(position, host.ratio)
    if dcp.enabled:
        visible = dcp_local_lens(visible, dcp.rank, dcp.world_size, dcp.interleave)
    row_start = np.repeat(host.local_cu_seq_lens[requests].astype(np.int32), rows_inside)
    return token_to_seq, row_start, row_start + visible.astype(np.int32, copy=False)


def chunk_arrays_numpy_many(
    hosts: Sequence[ChunkHostPart], dcp: DcpConfig, with_token_to_seq: bool = True
) -> list[ChunkArrays]:
    """The three arrays of several chunks: the numpy twin of ``TritonChunkBuilder.arrays_many``."""
    return [chunk_arrays_numpy(host, dcp, with_token_to_seq) for host in hosts]


def build_chunk_metadata_numpy(inputs: ChunkInputs) -> ChunkMetadata | None:
    """Spec section 1 on the host. None when the chunk has no compressed token."""
    host = chunk_host_part(inputs)
    if host is None:
        return None
    token_to_seq, ks, ke = chunk_arrays_numpy(host, inputs.dcp)
    return assemble(inputs, host, token_to_seq, ks, ke)
