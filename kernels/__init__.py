"""The kernel layer: Triton kernel, numpy backend, chunk planner, specialization model, compile engine. Import
from the modules themselves (``indexer_service.kernels.inputs`` and so on): this package re-exports nothing."""

import os

# Triton warns on every first compile when this is unset, and it enters the compile cache key: pin it so
# a cache precompiled by `indexer-service precompile` is hit by the serving process.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
