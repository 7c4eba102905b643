"""Random valid batches and chunks, and the benchmarks' named batches: shared by the tests, the GPU checks and
the benchmarks (test code, out of the product package)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from indexer_service.kernels.inputs import ChunkInputs, DcpConfig

# The calibration of the auto backend and the benchmarks make their batches the same way.
from indexer_service.service.compute.auto_backend import batch_with_tokens

NO_DCP = DcpConfig()


@dataclass(frozen=True)
class BatchShape:
    """How a random batch looks: request count, query and context lengths, share of zero-length queries."""

    num_requests: int
    max_query: int
    max_context: int
    zero_query_share: float = 0.1


def random_batch(rng: np.random.Generator, shape: BatchShape) -> tuple[np.ndarray, np.ndarray]:
    """``(query_start_loc, seq_lens)`` as int32: every request has ``seq_len >= query_len``."""
    query_lens = rng.integers(1, shape.max_query + 1, shape.num_requests)
    query_lens[rng.random(shape.num_requests) < shape.zero_query_share] = 0
    context = rng.integers(0, shape.max_context + 1, shape.num_requests)
    qsl = np.zeros(shape.num_requests + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    return qsl, (query_lens + context).astype(np.int32)


def random_chunk_inputs(
    rng: np.random.Generator,
    shape: BatchShape,
    ratio: int,
    dcp: DcpConfig = NO_DCP,
    with_slice: bool = True,
) -> ChunkInputs:
    """A chunk over a random request range of a random batch, with a random query slice half the time."""
    qsl, seq_lens = random_batch(rng, shape)
    start = int(rng.integers(0, shape.num_requests))
    end = int(rng.integers(start + 1, shape.num_requests + 1))
    num_queries = int(qsl[end] - qsl[start])
    query_slice = None
    if with_slice and num_queries and rng.random() < 0.5:
        a = int(rng.integers(0, num_queries))
        query_slice = (a, int(rng.integers(a, num_queries + 1)))
    return ChunkInputs(qsl, seq_lens, ratio, start, end, query_slice, dcp=dcp)


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


def request_files(names: list[str], folder: Path) -> dict[str, Path]:
    """Each named batch (:func:`make_inputs`) as a serialized BuildChunkRequest in ``folder``: what the Go load
    generator sends as it is."""
    from indexer_service.service.codec import chunk_inputs_to_proto

    files = {}
    for name in names:
        files[name] = folder / f"{name}.request"
        files[name].write_bytes(chunk_inputs_to_proto(make_inputs(name)).SerializeToString())
    return files
