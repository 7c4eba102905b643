"""The spec's formulas over arrays (spec section 1), written once for every Python backend: the numpy backend
(kernels/numpy_backend.py) and the Triton kernel's host code (kernels/triton_launcher.py) both call these. The Triton
kernel's device code and service/compute/fastpath.c write the same arithmetic in their own languages, and are tested
against kernels/reference.py, which is deliberately written apart from this file.
"""

from __future__ import annotations

import numpy as np


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


def dcp_local_lens(lengths: np.ndarray, rank: int, world_size: int, interleave: int) -> np.ndarray:
    """How many of ``lengths`` tokens land on ``rank`` of ``world_size`` when token g lives on rank
    ``(g // interleave) % world_size``. Scalars, not ``kernels.inputs.DcpConfig``: this module is below
    inputs.py, which calls it."""
    base = ((lengths // interleave) // world_size) * interleave
    remainder = lengths - base * world_size
    return base + np.minimum(np.maximum(remainder - rank * interleave, 0), interleave)
