"""What computes a request's arrays: the numpy backend (with service/compute/fastpath.c for BuildChunk's common case
when it is built), the Triton kernel, or ``auto`` choosing between them per request."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from indexer_service.kernels.inputs import ChunkArrays, ChunkHostPart, DcpConfig
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy_many
from indexer_service.kernels.specialization import CompileKey
from indexer_service.service.compute.auto_backend import AutoSelector
from indexer_service.service.compute.fastpath import BuildChunk, FastPathAnswer, FastPathLimits

log = logging.getLogger(__name__)

# The backend label of calls that service/compute/fastpath.c served whole.
FAST_PATH_BACKEND = "native"

# (host parts, DCP settings, with_token_to_seq) -> each chunk's arrays
ArraysFn = Callable[[Sequence[ChunkHostPart], DcpConfig, bool], list[ChunkArrays]]


def load_fast_path() -> ModuleType | None:
    """The compiled fast path (service/compute/fastpath.c), or None where it was not built: the numpy path then serves
    every request, which is slower but answers the same."""
    try:
        return importlib.import_module("indexer_service.service.compute._fastpath")
    except ImportError:
        return None


@dataclass(frozen=True)
class Backend:
    """What computes the three arrays of a request's chunks once their host parts are known; optionally a
    compiled path that serves BuildChunk's common case whole."""

    name: str
    arrays_many: ArraysFn
    build_chunk_fast: BuildChunk | None = None
    # ``auto`` on CUDA: picks numpy or Triton per request from a crossover measured at warmup
    # (service/compute/auto_backend.py); None for a single backend.
    selector: AutoSelector | None = None

    def for_request(self, hosts: Sequence[ChunkHostPart], with_token_to_seq: bool) -> Backend:
        """The backend that computes this request's arrays (its name is the metrics' ``backend`` label)."""
        return self if self.selector is None else self.selector.choose(hosts, with_token_to_seq)

    @property
    def calibrate(self) -> Callable[[Sequence[CompileKey]], int] | None:
        """What the warmup runs once the keys are ready (auto's crossover measurement), or None."""
        return None if self.selector is None else self.selector.calibrate


def below_crossover(fast_path: BuildChunk, selector: AutoSelector) -> BuildChunk:
    """``auto``'s fast path: answers at or above the crossover step aside to the general path, which gives
    them to Triton."""

    @functools.lru_cache(maxsize=4)
    def capped(limits: FastPathLimits, answer_bytes: int) -> FastPathLimits:
        # The same limits object on every call and a crossover set once by the calibration: built once, not per
        # call (``_replace`` costs more than the compiled call on a small request: docs/performance.md).
        return limits._replace(max_message_bytes=answer_bytes)

    def fast(
        data: bytes,
        limits: FastPathLimits,
        admitted: tuple[int, ...] | None,
        admit: Callable[[int], None] | None = None,
        /,
    ) -> FastPathAnswer | None:
        answer_bytes = selector.fast_path_bytes(limits.max_message_bytes)
        if answer_bytes != limits.max_message_bytes:
            limits = capped(limits, answer_bytes)
        return fast_path(data, limits, admitted, admit)

    return fast


def make_backend(name: str, admit: Callable[[CompileKey], None] | None, native_fast_path: bool = False) -> Backend:
    """The numpy implementation (with service/compute/fastpath.c for BuildChunk's common case when ``native_fast_path``
    and it is built), or the Triton kernel on the current CUDA device (``admit`` sees each launch)."""
    fastpath = load_fast_path() if native_fast_path else None
    if native_fast_path and fastpath is None:
        log.warning("serving without the compiled fast path (service/compute/_fastpath not built)")
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
