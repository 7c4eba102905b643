"""Batches shared by the tests and the benchmarks: the measured-facts batches of the benchmarks, by name."""

from __future__ import annotations

import numpy as np

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.testing import batch_with_tokens

# (requests, query tokens, uncompressed context per request): the measured-facts batches, ratio 4.
BATCHES = {
    "small-8": (8, 351, 505),
    "medium-64": (64, 8_885, 4_185),
    "large-256": (256, 65_961, 33_148),
    "one-long": (1, 86_252, 43_564),
}
RATIO = 4


def make_inputs(name: str) -> ChunkInputs:
    requests, tokens, context = BATCHES[name]
    qsl, seq = batch_with_tokens(np.random.default_rng(len(name)), requests, tokens, context)
    return ChunkInputs(qsl, seq, RATIO, 0, requests)
