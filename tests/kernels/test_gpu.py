"""On a CUDA GPU: the Triton kernel equals numpy, and warmup leaves nothing to compile. Skipped without CUDA.

Run on the H200 with ``python -m pytest -q tests/kernels/test_gpu.py`` (results: benchmarks/history.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from indexer_service.kernels.compile_engine import compile_keys, watch_compiles
from indexer_service.kernels.inputs import ChunkInputs, DcpConfig
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.kernels.specialization import ModelConfig, warmup_compress_ratios, warmup_keys
from indexer_service.kernels.triton_launcher import PinnedPool, TritonChunkBuilder
from testkit.batches import BatchShape, random_chunk_inputs
from tests.golden import metadata_as_dict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FLASH = ModelConfig((0, 0, *([4, 128] * 20), 4, 0))
DCPS = (DcpConfig(), DcpConfig(1, 2), DcpConfig(3, 4, 2), DcpConfig(0, 4))


def random_case(rng: np.random.Generator, i: int, ratios: tuple[int, ...]):
    shape = BatchShape(
        int(rng.integers(1, 65)),
        int(rng.integers(1, 300)),
        int(rng.integers(0, 5000)),
        zero_query_share=float(rng.choice([0.0, 0.1, 0.5])),
    )
    return random_chunk_inputs(rng, shape, ratios[i % len(ratios)], DCPS[i % len(DCPS)])


def test_triton_on_gpu_equals_numpy_on_1000_batches():
    builder = TritonChunkBuilder("cuda")
    rng = np.random.default_rng(2026)
    compared = 0
    for i in range(1000):
        inputs = random_case(rng, i, (1, 4, 128))
        expected, got = build_chunk_metadata_numpy(inputs), builder(inputs)
        assert (expected is None) == (got is None)
        if expected is not None:
            assert metadata_as_dict(got) == metadata_as_dict(expected), f"batch {i}"
            compared += 1
    assert compared > 900


@pytest.mark.parametrize("model", [FLASH, ModelConfig((0, 0, 4, 128, 0), 32)], ids=["flash", "kpool32"])
def test_after_warmup_10k_launches_compile_nothing(model):
    keys = warmup_keys(model)
    outcomes = compile_keys(keys, keys, target=None, workers=4)
    assert all(o.ok for o in outcomes), outcomes
    compiles = []
    uninstall = watch_compiles(compiles.append)
    try:
        builder = TritonChunkBuilder("cuda")
        rng = np.random.default_rng(10_000)
        for i in range(10_000):
            builder(random_case(rng, i, warmup_compress_ratios(model)))
        torch.cuda.synchronize()
    finally:
        uninstall()
    assert compiles == []


def test_gpu_out_of_memory_is_a_memory_error_and_the_next_build_succeeds():
    """With the device full, a build raises MemoryError (the service answers RESOURCE_EXHAUSTED); once memory
    is back, the same build succeeds in the same process."""
    inputs = ChunkInputs(np.array([0, 1]), np.array([50_000_000]), 1, 0, 1)  # 200 MB of token_to_seq
    builder = TritonChunkBuilder("cuda")
    builder(ChunkInputs(np.array([0, 1]), np.array([8]), 1, 0, 1))  # compile and create the context first
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(free - 64 * 2**20, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(MemoryError, match="GPU out of memory"):
            builder(inputs)
    finally:
        del filler
        torch.cuda.empty_cache()
    result = builder(inputs)
    assert result.total_seq_lens == 50_000_000 and int(result.token_to_seq.max()) == 0


@pytest.mark.parametrize("blocking_wait", [False, True], ids=["spin", "block"])
def test_eight_threads_share_one_builder_and_every_answer_equals_numpy(blocking_wait):
    """Per-thread streams, staging and pooled outputs: 8 threads, 150 random batches each, sizes mixed so the
    buffers grow and the pool's classes change; results kept alive across calls must not be overwritten."""
    import threading

    builder = TritonChunkBuilder("cuda", blocking_wait=blocking_wait)
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        kept = []
        for i in range(150):
            inputs = random_case(rng, i, (1, 4, 128))
            got = builder(inputs)
            kept.append((inputs, got))
            if len(kept) > 3:  # an answer's arrays outlive later calls on the same thread
                old_inputs, old = kept.pop(0)
                expected = build_chunk_metadata_numpy(old_inputs)
                if (expected is None) != (old is None) or (
                    expected is not None and metadata_as_dict(old) != metadata_as_dict(expected)
                ):
                    failures.append(f"thread {seed} batch {i}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_pinned_outputs_are_pooled_not_allocated_per_call():
    pool = PinnedPool()
    builder = TritonChunkBuilder("cuda", pool=pool)
    inputs = ChunkInputs(np.array([0, 100, 300]), np.array([50_000, 20_000]), 4, 0, 2)
    for _ in range(5):
        builder(inputs)
    allocations = pool.allocations
    for _ in range(200):
        result = builder(inputs)
        del result
    assert pool.allocations == allocations <= 2
    assert pool.idle_bytes() > 0
    held = builder(inputs)  # while an answer is alive, its buffer is not handed out again
    other = builder(inputs)
    assert held.cu_seqlen_ke.base is not other.cu_seqlen_ke.base
    assert metadata_as_dict(held) == metadata_as_dict(other) == metadata_as_dict(build_chunk_metadata_numpy(inputs))
