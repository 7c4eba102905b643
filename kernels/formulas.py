"""The spec's formulas over arrays (spec section 1), written once for every Python backend: the numpy backend
(kernels/numpy_backend.py) and the Triton kernel's host code (kernels/triton_launcher.py) both call these. The Triton
kernel's device code and service/fastpath.c write the same arithmetic in their own languages, and are tested
against kernels/reference.py, which is deliberately written apart from this file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from indexer_service.kernels.inputs import DcpConfig


def compressed(values: np.ndarray, ratio: int) -> np.ndarray:
    """``values // ratio`` for non-negative values (lengths or positions) and a normalised ratio; a shift when
    the ratio is a power of two, which numpy does several times faster than a division."""
    if ratio == 1:
        return values
    if ratio & (ratio - 1) == 0:
        return values >> (ratio.bit_length() - 1)
    return values // ratio


def causal_position(seq_lens: np.ndarray, query_lens: np.ndarray, row_in_request: np.ndarray) -> np.ndarray:
    """The uncompressed causal position seen by query row ``row_in_request`` (counted from the request's first
    query row) of a request of ``seq_lens`` tokens whose last ``query_lens`` are queries: ``S - q + 1 + r``."""
    return seq_lens - query_lens + 1 + row_in_request


def dcp_local_lens(lengths: np.ndarray, dcp: DcpConfig, rank: int | None = None) -> np.ndarray:
    """How many of ``lengths`` tokens land on ``rank`` (default: ``dcp.rank``) when token g lives on rank
    ``(g // I) % W``."""
    interleave, world = dcp.interleave, dcp.world_size
    k = dcp.rank if rank is None else rank
    base = ((lengths // interleave) // world) * interleave
    remainder = lengths - base * world
    return base + np.minimum(np.maximum(remainder - k * interleave, 0), interleave)
