"""The numpy implementation of one chunk's metadata: the service's CPU backend and the tests' oracle.

Vectorised over tokens and rows; its outputs equal the Triton kernel's for every valid input.
"""

from __future__ import annotations

import numpy as np

from kernels.inputs import (
    ChunkHostPart,
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    assemble,
    chunk_host_part,
    dcp_local_lens,
)


def chunk_arrays_numpy(host: ChunkHostPart, dcp: DcpConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``token_to_seq``, ``cu_seqlen_ks`` and ``cu_seqlen_ke`` of one chunk (int32)."""
    cu = host.cu_seq_lens
    num_requests = cu.size - 1
    token_to_seq = np.repeat(np.arange(num_requests, dtype=np.int32), np.diff(cu))

    a, b = host.query_slice
    rows = np.arange(a, b, dtype=np.int64)
    # Request of each chunk row: the last request whose first row is <= the row.
    request = np.searchsorted(host.query_start, rows, side="right") - 1
    query_lens = np.diff(host.query_start)
    first_position = host.seq_lens - query_lens  # p0: validated >= 0
    position = first_position[request] + 1 + (rows - host.query_start[request])
    visible = position // host.ratio
    if dcp.enabled:
        visible = dcp_local_lens(visible, dcp)
    row_start = host.local_cu_seq_lens[request]
    return token_to_seq, row_start.astype(np.int32), (row_start + visible).astype(np.int32)


def build_chunk_metadata_numpy(inputs: ChunkInputs) -> ChunkMetadata | None:
    """Spec section 1 on the host. None when the chunk has no compressed token."""
    host = chunk_host_part(inputs)
    if host is None:
        return None
    token_to_seq, ks, ke = chunk_arrays_numpy(host, inputs.dcp)
    return assemble(inputs, host, token_to_seq, ks, ke)
