"""Fixtures of every layer. Nothing here imports the service (tests/kernels/ runs without its compiled
extension); the service layer's fixtures, real server processes among them, are tests/service/conftest.py's."""

from __future__ import annotations

import pytest


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def triton_cpu():
    """The Triton kernel through Triton's CPU interpreter, behind the service's builder; a skip where this
    Triton's interpreter cannot run it."""
    import numpy as np
    import triton
    from triton.runtime.errors import InterpreterError

    from indexer_service.kernels.inputs import ChunkInputs
    from indexer_service.kernels.triton_kernel import interpreted_kernel
    from indexer_service.kernels.triton_launcher import TritonChunkBuilder

    builder = TritonChunkBuilder("cpu", kernel=interpreted_kernel())
    try:
        builder(ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3))
    except InterpreterError as exc:
        # Triton 3.6's interpreter calls int() on a one-element array for a loop bound loaded from memory,
        # which numpy 2.5 refuses (seen on the H200 image); Triton 3.9's does not. The compiled kernel is
        # unaffected (tests/kernels/test_gpu.py).
        if "only 0-dimensional arrays" not in str(exc):
            raise
        pytest.skip(f"this Triton {triton.__version__} interpreter cannot run with numpy {np.__version__}: {exc}")
    return builder
