"""Compile the kernel's variants: in-process JIT warmup on a GPU, ahead-of-time with no GPU.

Both paths go through Triton's own ``JITFunction.warmup``, so a variant is compiled exactly as a live
launch would ask for it: on a GPU that fills the in-process launch cache (later launches of those keys
compile nothing); with no GPU, a stand-in driver that only reports the target lets the same call run the
whole compiler (PTX and cubin for ``cuda:90``, hsaco for ``hip:gfx942``) and fill ``TRITON_CACHE_DIR``.
A cache built that way in the serving image is hit by the serving process (see the measured facts).

Keys compile in parallel through Triton's ``AsyncCompileMode`` when ``workers > 1``: most of a compile
runs in native code and ``ptxas`` subprocesses, so threads overlap (benchmarks/bench_warmup.py measures
it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver

from kernels.specialization import POINTER_ALIGNMENT, CompileKey
from kernels.triton_kernel import KERNEL_JIT_OPTIONS, _build_prefill_metadata_kernel, _build_prefill_metadata_kernel_fn

log = logging.getLogger(__name__)

_WARP_SIZE = {"cuda": 32, "hip": 64}


class KeyRefusedError(ValueError):
    """A key that must never reach the compiler: unnormalised ratio, or outside the model's warmup set."""


@dataclass(frozen=True)
class CompileOutcome:
    key: CompileKey
    seconds: float
    ok: bool
    error: str | None = None


def parse_target(spec: str) -> GPUTarget:
    """``cuda:90`` or ``hip:gfx942`` as Triton's target."""
    backend, sep, arch = spec.partition(":")
    if not sep or backend not in _WARP_SIZE or not arch:
        raise ValueError(f"target must look like 'cuda:90' or 'hip:gfx942', got {spec!r}")
    if backend == "cuda":
        if not arch.isdigit():
            raise ValueError(f"cuda target needs a numeric compute capability, got {spec!r}")
        return GPUTarget("cuda", int(arch), _WARP_SIZE[backend])
    return GPUTarget("hip", arch, _WARP_SIZE[backend])


class _StandInDriver(DriverBase):
    """Reports a GPU target and nothing else, so Triton's JIT compiles without a GPU (no launch possible)."""

    def __init__(self, target: GPUTarget) -> None:
        super().__init__()
        self.target = target

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the stand-in driver compiles only; it builds no launcher")

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("the stand-in driver cannot run kernels")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


def check_keys(keys: Sequence[CompileKey], allowed: Sequence[CompileKey]) -> None:
    """Refuse, before any compile, every key that is unnormalised or outside ``allowed``."""
    allowed_set = set(allowed)
    for i, key in enumerate(keys):
        if not isinstance(key, CompileKey):
            raise KeyRefusedError(f"keys[{i}]: not a CompileKey: {key!r}")
        if key.compress_ratio < 1:
            raise KeyRefusedError(
                f"keys[{i}]: compress ratio {key.compress_ratio} is not normalised (0 means uncompressed: 1)"
            )
        if key not in allowed_set:
            raise KeyRefusedError(f"keys[{i}]: {key.label()} is not in the model's warmup set")


def warmup_arguments(key: CompileKey, device: torch.device) -> list[object]:
    """Tensors and scalars that make Triton choose exactly ``key``'s variant."""
    args: list[object] = []
    for cls in key.pointer_classes:
        # A fresh allocation is aligned; one element in, it is not.
        buffer = torch.zeros(8, dtype=torch.int32, device=device)
        args.append(buffer if cls == POINTER_ALIGNMENT else buffer[1:])
    widths = {"i32": 2, "i64": 2**40, "u64": 2**63 + 2}  # representatives of each integer width
    args.extend(widths[width] for width in key.scalar_types)
    return args


class _TimedExecutor(Executor):
    """Records each compile's own seconds and error, keyed by the key being warmed when it was submitted."""

    def __init__(self, pool: Executor) -> None:
        self.pool = pool
        self.current: CompileKey | None = None
        self.futures: dict[Future, CompileKey] = {}
        self.timings: dict[CompileKey, tuple[float, str | None]] = {}
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        key = self.current

        def timed():
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                with self._lock:
                    self.timings[key] = (time.perf_counter() - start, _describe(exc))
                raise
            with self._lock:
                self.timings[key] = (time.perf_counter() - start, None)
            return result

        future = self.pool.submit(timed)
        self.futures[future] = key
        return future


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not text.startswith(type(exc).__name__) else text


@contextlib.contextmanager
def compile_only_driver(target: GPUTarget | None) -> Iterator[None]:
    """Within this block Triton's JIT compiles for ``target`` with no GPU (None: leave the real driver)."""
    if target is None:
        yield
        return
    # Restore whatever was active before, without asking for the default driver: with no GPU, creating
    # it fails ("0 active drivers").
    previous = driver._active
    driver.set_active(_StandInDriver(target))
    try:
        yield
    finally:
        driver.set_active(previous)


def _async_compile_mode():
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # Triton before 3.5: no parallel compile inside the JIT
        return None
    return AsyncCompileMode


def start_compiler() -> float:
    """Seconds spent hashing the Triton installation, which its cache key covers.

    Triton does it once per process, on the first compile (about 0.8 s here, cache hit or not); doing it
    first keeps it out of the first key's compile seconds.
    """
    start = time.perf_counter()
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # older layouts keep it in the compiler module
        from triton.compiler.compiler import triton_key
    triton_key()
    return time.perf_counter() - start


def compile_keys(
    keys: Sequence[CompileKey],
    allowed: Sequence[CompileKey],
    *,
    target: str | None = None,
    workers: int = 1,
    progress: Callable[[int, int, CompileOutcome], None] | None = None,
) -> list[CompileOutcome]:
    """Compile ``keys`` (each must be in ``allowed``) and return one outcome per key, in key order.

    ``target=None`` warms the kernel that live launches use, on the current CUDA device. A target such
    as ``cuda:90`` compiles ahead of time with no GPU. A failed compile is an outcome with ``ok=False``
    and the compiler's message, never an exception; refused keys raise :class:`KeyRefusedError` before
    anything compiles.
    """
    check_keys(keys, allowed)
    log.debug("Triton compiler start-up took %.3f s", start_compiler())
    if target is None:
        kernel, gpu_target, device = _build_prefill_metadata_kernel, None, torch.device("cuda")
    else:
        # A fresh JITFunction per ahead-of-time run: its per-device caches remember the target.
        kernel = triton.jit(_build_prefill_metadata_kernel_fn, **KERNEL_JIT_OPTIONS)
        gpu_target, device = parse_target(target), torch.device("cpu")
    async_mode = _async_compile_mode() if workers > 1 else None
    if workers > 1 and async_mode is None:
        log.warning("this Triton has no AsyncCompileMode: compiling %d keys one by one", len(keys))

    outcomes: dict[CompileKey, CompileOutcome] = {}
    done = 0

    def finish(outcome: CompileOutcome) -> None:
        nonlocal done
        done += 1
        outcomes[outcome.key] = outcome
        if progress is not None:
            progress(done, len(keys), outcome)

    def warm(key: CompileKey) -> None:
        kernel.warmup(
            *warmup_arguments(key, device),
            grid=(1,),
            BLOCK_SIZE=key.block_size,
            COMPRESS_RATIO=key.compress_ratio,
        )

    with compile_only_driver(gpu_target):
        if async_mode is None:
            for key in keys:
                start = time.perf_counter()
                try:
                    warm(key)
                except Exception as exc:
                    finish(CompileOutcome(key, time.perf_counter() - start, False, _describe(exc)))
                else:
                    finish(CompileOutcome(key, time.perf_counter() - start, True))
            return [outcomes[k] for k in keys]

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
            timed = _TimedExecutor(pool)
            with async_mode(timed, ignore_errors=True):
                for key in keys:
                    timed.current = key
                    start = time.perf_counter()
                    try:
                        warm(key)  # submits the compile, or returns at once for an already-warm key
                    except Exception as exc:  # failed before reaching the compiler (argument binding)
                        finish(CompileOutcome(key, time.perf_counter() - start, False, _describe(exc)))
                        continue
                    if key not in timed.futures.values():
                        finish(CompileOutcome(key, time.perf_counter() - start, True))
                for future in as_completed(list(timed.futures)):
                    key = timed.futures[future]
                    seconds, error = timed.timings[key]
                    finish(CompileOutcome(key, seconds, error is None, error))
    return [outcomes[k] for k in keys]


def watch_compiles(callback: Callable[[str], None]) -> Callable[[], None]:
    """Call ``callback(kernel_name)`` after every compile of the prefill-metadata kernel in this process.

    Chains ``triton.knobs.runtime.jit_post_compile_hook`` (which also fires on a disk-cache load) and
    keeps any hook installed before. Returns a function that uninstalls it.
    """
    previous = triton.knobs.runtime.jit_post_compile_hook
    kernel_name = _build_prefill_metadata_kernel_fn.__name__

    def hook(**kwargs):
        fn = kwargs.get("fn")
        if getattr(fn, "name", "").endswith(kernel_name):
            callback(kernel_name)
        return previous(**kwargs) if previous is not None else None

    triton.knobs.runtime.jit_post_compile_hook = hook

    def uninstall() -> None:
        if triton.knobs.runtime.jit_post_compile_hook is hook:
            triton.knobs.runtime.jit_post_compile_hook = previous

    return uninstall
