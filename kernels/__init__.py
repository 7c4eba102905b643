"""The kernel layer: Triton kernel, numpy twin, chunk planner, specialization model, compile engine."""

import os

# Triton warns on every first compile when this is unset, and it enters the compile cache key: pin it so
# a cache precompiled by `indexer-service precompile` is hit by the serving process.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from indexer_service.kernels.inputs import (
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    InvalidInputError,
)
from indexer_service.kernels.naive import build_chunk_metadata_numpy
from indexer_service.kernels.planner import (
    BatchInputs,
    ChunkSpec,
    PrefillPlan,
    build_prefill_batch,
    plan_prefill_batch,
    plan_prefill_chunks,
)
from indexer_service.kernels.specialization import (
    CompileKey,
    ModelConfig,
    key_for_launch,
    normalize_compress_ratio,
    warmup_compress_ratios,
    warmup_keys,
)

__all__ = [
    "BatchInputs",
    "ChunkInputs",
    "ChunkMetadata",
    "ChunkSpec",
    "CompileKey",
    "DcpConfig",
    "InvalidInputError",
    "ModelConfig",
    "PrefillPlan",
    "build_chunk_metadata_numpy",
    "build_prefill_batch",
    "key_for_launch",
    "normalize_compress_ratio",
    "plan_prefill_batch",
    "plan_prefill_chunks",
    "warmup_compress_ratios",
    "warmup_keys",
]
