"""vLLM's warmup key space (spec section 4), the baseline's: benchmarks/vllm_baseline.py compiles it, and
tests/kernels/test_specialization.py holds the service's own key space against it."""

from __future__ import annotations

import itertools

from indexer_service.kernels.specialization import ModelConfig, triton_int_specialization_class, warmup_compress_ratios


def vllm_warmup_points(model: ModelConfig, max_num_batched_tokens: int) -> list[tuple[int, int, int, bool]]:
    """One ``(slice_start, slice_stop, ratio, seq_lens aligned)`` per key of vLLM's warmup set (spec section 4):
    the warmup inputs expanded, mapped to Triton's integer classes, deduplicated in first-seen order."""
    tokens = max(1, min(max_num_batched_tokens, 8))
    points: dict[tuple[int, int, int, bool], tuple[int, int, int, bool]] = {}
    for start, stop, ratio, aligned in itertools.product(
        (0, 1, 2), (1, 2 * tokens - 1, 2 * tokens), warmup_compress_ratios(model), (True, False)
    ):
        key = (triton_int_specialization_class(start), triton_int_specialization_class(stop), ratio, aligned)
        points.setdefault(key, (start, stop, ratio, aligned))
    return list(points.values())
