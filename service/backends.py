"""What computes a request's arrays: the numpy backend (with service/fastpath.c for BuildChunk's common case
when it is built), the Triton kernel, or ``auto`` choosing between them per request."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from indexer_service.kernels.inputs import ChunkArrays, ChunkHostPart, DcpConfig
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy_many
from indexer_service.kernels.specialization import CompileKey
from indexer_service.service.auto_backend import AutoSelector
from indexer_service.service.config import ConfigError

log = logging.getLogger(__name__)

# The backend label of calls that service/fastpath.c served whole.
FAST_PATH_BACKEND = "native"

# (host parts, DCP settings, with_token_to_seq) -> each chunk's arrays
ArraysFn = Callable[[Sequence[ChunkHostPart], DcpConfig, bool], list[ChunkArrays]]
# (request bytes, limits, admitted ratios) -> (response bytes, requests, query tokens, seconds), or None: see
# service/fastpath.c
# build_chunk(request, limits, admitted_ratios, admit): see service/fastpath.c.
FastPathFn = Callable[
    [bytes, tuple[int, ...], tuple[int, ...] | None, Callable[[int], None]], tuple[bytes, int, int, float] | None
]


def load_fast_path() -> ModuleType | None:
    """The compiled fast path (service/fastpath.c), or None where it was not built: the numpy path then serves
    every request, which is slower but answers the same."""
    try:
        return importlib.import_module("indexer_service.service._fastpath")
    except ImportError:
        return None


@dataclass(frozen=True)
class Backend:
    """What computes the three arrays of a request's chunks once their host parts are known; optionally a
    compiled path that serves BuildChunk's common case whole."""

    name: str
    arrays_many: ArraysFn
    build_chunk_fast: FastPathFn | None = None
    # ``auto`` on CUDA: picks numpy or Triton per request from a crossover measured at warmup
    # (service/auto_backend.py); None for a single backend.
    selector: AutoSelector | None = None

    def for_request(self, hosts: Sequence[ChunkHostPart], with_token_to_seq: bool) -> Backend:
        """The backend that computes this request's arrays (its name is the metrics' ``backend`` label)."""
        return self if self.selector is None else self.selector.choose(hosts, with_token_to_seq)

    @property
    def calibrate(self) -> Callable[[Sequence[CompileKey]], int] | None:
        """What the warmup runs once the keys are ready (auto's crossover measurement), or None."""
        return None if self.selector is None else self.selector.calibrate


# Device nodes through which a process reaches a GPU (NVIDIA's driver; AMD's for ROCm builds of torch): a
# container is given its GPUs as these, so without any of them torch.cuda.is_available() cannot be true.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def gpu_device_nodes() -> list[str]:
    """The GPU device nodes this process can see."""
    return [node for node in GPU_DEVICE_NODES if os.path.exists(node)]


def resolve_backend(choice: str) -> str:
    """``auto`` stays ``auto`` on a CUDA machine (numpy or Triton per request) and becomes ``numpy`` elsewhere;
    ``triton`` needs CUDA."""
    if choice == "numpy":
        return "numpy"
    if choice == "auto" and not gpu_device_nodes():
        return "numpy"  # no GPU is visible to this process: no need to pay seconds importing torch to be told so
    import torch  # only when a GPU may be visible: importing torch costs seconds

    if torch.cuda.is_available():
        return choice
    if choice == "triton":
        raise ConfigError("backend", "triton needs a CUDA GPU, and torch sees none")
    return "numpy"


def below_crossover(fast_path: FastPathFn, selector: AutoSelector) -> FastPathFn:
    """``auto``'s fast path: answers at or above the crossover step aside to the general path, which gives
    them to Triton."""

    def fast(
        data: bytes, limits: tuple[int, ...], admitted: tuple[int, ...] | None, admit: Callable[[int], None]
    ) -> tuple[bytes, int, int, float] | None:
        bounded = (*limits[:4], selector.fast_path_bytes(limits[4]), *limits[5:])
        return fast_path(data, bounded, admitted, admit)

    return fast


def make_backend(name: str, admit: Callable[[CompileKey], None] | None, native_fast_path: bool = False) -> Backend:
    """The numpy implementation (with service/fastpath.c for BuildChunk's common case when
    ``native_fast_path`` and it is built), or the Triton kernel on the current CUDA device (``admit`` sees each
    launch)."""
    fastpath = load_fast_path() if native_fast_path else None
    if native_fast_path and fastpath is None:
        log.warning("serving without the compiled fast path (service/_fastpath not built)")
    numpy_backend = Backend("numpy", chunk_arrays_numpy_many, fastpath.build_chunk if fastpath else None)
    if name == "numpy":
        return numpy_backend
    from indexer_service.kernels.triton_launcher import TritonChunkBuilder

    # One launch for all the chunks of a request (a whole prefill plan): one copy in, one copy out. No fast
    # path: this backend's point is computing on the GPU.
    triton_backend = Backend("triton", TritonChunkBuilder("cuda", admit=admit).arrays_many)
    if name == "triton":
        return triton_backend
    selector = AutoSelector(numpy_backend, triton_backend, numpy_backend.arrays_many, triton_backend.arrays_many)
    fast = None if fastpath is None else below_crossover(fastpath.build_chunk, selector)
    return Backend("auto", numpy_backend.arrays_many, fast, selector)
