"""Which backend this machine can run: the GPU probe that both the configuration's check (service/config/validation.py)
and the server's start (service/process/server.py) ask. Below both, so that neither imports the other for it.
"""

from __future__ import annotations

import os

# Device nodes through which a process reaches a GPU (NVIDIA's driver; AMD's for ROCm builds of torch): a
# container is given its GPUs as these, so without any of them torch.cuda.is_available() cannot be true.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


class BackendUnavailableError(ValueError):
    """The configured backend cannot run on this machine (the configuration names it as ``backend``'s error)."""


def gpu_device_nodes() -> list[str]:
    """The GPU device nodes this process can see."""
    return [node for node in GPU_DEVICE_NODES if os.path.exists(node)]


def resolve_backend(choice: str) -> str:
    """``auto`` stays ``auto`` on a CUDA machine (numpy or Triton per request) and becomes ``numpy`` elsewhere;
    ``triton`` needs CUDA (:class:`BackendUnavailableError` otherwise)."""
    if choice == "numpy":
        return "numpy"
    if choice == "auto" and not gpu_device_nodes():
        return "numpy"  # no GPU is visible to this process: no need to pay seconds importing torch to be told so
    import torch  # only when a GPU may be visible: importing torch costs seconds

    if torch.cuda.is_available():
        return choice
    if choice == "triton":
        raise BackendUnavailableError("triton needs a CUDA GPU, and torch sees none")
    return "numpy"


def uses_triton(backend: str, warmup_enabled: bool) -> bool:
    """Whether a serving process with ``backend`` (as configured, or as resolved) imports Triton: a warmup compiles
    with it (in process on the GPU, or ahead of time for a target), and a GPU backend launches with it. ``auto``
    with no GPU visible serves with numpy, as :func:`resolve_backend` decides without importing torch."""
    return warmup_enabled or backend == "triton" or (backend == "auto" and bool(gpu_device_nodes()))
