"""Compile the kernel's variants: in-process JIT warmup on a GPU, ahead-of-time with no GPU.

Both paths go through Triton's own ``JITFunction.warmup``, so a variant is compiled exactly as a live
launch would ask for it: on a GPU that fills the in-process launch cache (later launches of those keys
compile nothing); with no GPU, a stand-in driver that only reports the target lets the same call run the
whole compiler (PTX and cubin for ``cuda:90``, hsaco for ``hip:gfx942``) and fill ``TRITON_CACHE_DIR``.
A cache built that way in the serving image is hit by the serving process (deploy/README.md, and
``scripts/check-prebuilt-cache.sh`` that replays it).

A key that compiled is then *proved* (:func:`prove_key`): one launch of it on a tiny input, every output element
checked against numpy. In process that launch runs on the serving GPU (which also fills the launch cache, whatever
the Triton version); ahead of time, with no GPU to run the cubin, the same kernel source runs through Triton's
interpreter. A variant that compiles and computes garbage (on CUDA a compress ratio of 0 compiles, then writes
16776640 in every ``ke`` row: docs/spec.md, section 10) is a failed key, named by its first wrong element.

The kernel is looked up in :mod:`kernels.triton_kernel` at call time, so a test can swap in a wrong one.

Keys compile in parallel through Triton's ``AsyncCompileMode`` when ``workers > 1``: most of a compile
runs in native code and ``ptxas`` subprocesses, so threads overlap (benchmarks/bench_warmup.py measures
it). That mode, the stand-in driver's swap and the installation hash reach past Triton's public API: each goes
through kernels/triton_adapter.py, which takes the public path where this Triton differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from indexer_service.kernels import specialization, triton_adapter, triton_kernel
from indexer_service.kernels.host_tensor import HostTensor, aligned_empty
from indexer_service.kernels.inputs import ChunkInputs, chunk_host_part
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy
from indexer_service.kernels.specialization import BLOCK_SIZE, POINTER_ALIGNMENT, CompileKey
from indexer_service.kernels.triton_kernel import KERNEL_JIT_OPTIONS, serialise_ast_parse

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class KeyRefusedError(ValueError):
    """A key that must never reach the compiler: unnormalised ratio, or outside the model's warmup set."""


# What the proof of a compiled key came to (CompileOutcome.proof).
PROOF_OK = "ok"  # launched once and every element equal to numpy's
PROOF_SKIPPED = "skipped"  # it could not run here (this Triton's interpreter with this numpy)
PROOF_FAILED = "failed"  # launched, and an element differs from numpy's (the key fails)
PROOF_NONE = "none"  # not asked for, or a variant the service never launches


@dataclass(frozen=True)
class CompileOutcome:
    """One key's compile: ``cached`` when Triton loaded it from its cache instead of compiling it (a Triton without
    a compilation listener reports every key compiled); ``proof`` one of PROOF_OK, PROOF_SKIPPED, PROOF_FAILED
    (the key fails: ``ok`` False), PROOF_NONE."""

    key: CompileKey
    seconds: float
    ok: bool
    error: str | None = None
    cached: bool = False
    proof: str = PROOF_NONE


def parse_target(spec: str) -> GPUTarget:
    """``cuda:90`` or ``hip:gfx942`` as Triton's target (checked by :func:`specialization.parse_target`)."""
    return GPUTarget(*specialization.parse_target(spec))


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
        import torch

        return torch.device("cpu")

    def get_benchmarker(self) -> NoReturn:
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


def warmup_arguments(key: CompileKey, device: torch.device | str | None = None) -> list[object]:
    """Tensors and scalars that make Triton choose exactly ``key``'s variant: torch tensors on ``device``, or with
    none (an ahead-of-time compile, which launches nothing) numpy arrays as :class:`HostTensor`, which Triton
    specializes alike and which need no torch."""
    args: list[object] = []
    for cls in key.pointer_classes:
        # Aligned: at a multiple of 16 bytes (a fresh torch allocation is); one element in, it is not.
        if device is None:
            host = aligned_empty(8)
            host.fill(0)
            args.append(HostTensor(host if cls == POINTER_ALIGNMENT else host[1:]))
            continue
        import torch  # here, not on import: only a compile for a device needs it

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
            _compiling.key = key  # for the cache-hit listener, which Triton calls in this thread
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


class ProofUnavailableError(RuntimeError):
    """This Triton's interpreter cannot run here (see tests/conftest.py's triton_cpu): the proof is skipped."""


# Written into the outputs before a proof launch: an element the kernel leaves unwritten shows up as wrong.
PROOF_SENTINEL = -0x5EED


def proof_inputs(ratio: int) -> ChunkInputs:
    """A tiny chunk with compressed tokens at any ratio: four requests, one without queries, rows over three."""
    query_lens = np.array([1, 3, 0, 5])
    seq_lens = np.array([3, 10, 21, 7]) * ratio + np.array([1, 5, 0, 3])
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    return ChunkInputs(qsl, seq_lens, ratio, 0, query_lens.size)


def first_difference(got: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> str | None:
    """``name[i] = got, numpy gives expected (n of m wrong)`` for the first wrong element of the three arrays."""
    for name, g, e in zip(("token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke"), got, expected, strict=True):
        if g.shape != e.shape:
            return f"{name} has {g.size} elements, numpy gives {e.size}"
        wrong = np.flatnonzero(g != e)
        if wrong.size:
            i = int(wrong[0])
            return f"{name}[{i}] = {int(g[i])}, numpy gives {int(e[i])} ({wrong.size} of {e.size} elements wrong)"
    return None


def prove_key(key: CompileKey, *, on_gpu: bool) -> str | None:
    """Launch ``key``'s variant once on :func:`proof_inputs` and compare with numpy: None when every element is
    equal, else why not (the first wrong index). ``on_gpu``: the compiled kernel on the current CUDA device; else
    the kernel's source through Triton's interpreter (raises :class:`ProofUnavailableError` where that cannot
    run). Keys the service cannot launch (another block size or pointer class) are not launched: None."""
    from indexer_service.kernels.triton_launcher import TritonChunkBuilder

    if not launchable(key):
        return None
    inputs = proof_inputs(key.compress_ratio)
    host = chunk_host_part(inputs)
    launched: list[CompileKey] = []
    if on_gpu:
        builder = TritonChunkBuilder(
            "cuda", kernel=triton_kernel._build_prefill_metadata_kernel, admit=launched.append, poison=PROOF_SENTINEL
        )
        import torch

        where = f"cuda:{torch.cuda.current_device()}"
    else:
        builder = TritonChunkBuilder(
            "cpu", kernel=triton_kernel.interpreted_kernel(), admit=launched.append, poison=PROOF_SENTINEL
        )
        where = "Triton's interpreter"
    try:
        got = builder.arrays(host, inputs.dcp)
    except Exception as exc:
        if not on_gpu and "only 0-dimensional arrays" in str(exc):
            raise ProofUnavailableError(f"Triton {triton.__version__}'s interpreter cannot run here: {exc}") from exc
        return f"proof launch on {where} failed: {_describe(exc)}"
    if launched != [key]:
        return f"proof launch on {where} used {[k.label() for k in launched]}, not {key.label()}"
    wrong = first_difference(got, chunk_arrays_numpy(host, inputs.dcp))
    return None if wrong is None else f"proof launch on {where} disagrees with numpy: {wrong}"


def launchable(key: CompileKey) -> bool:
    """Whether the service ever launches ``key``'s variant (the default block size and pointer classes): only those
    are proved."""
    return key == CompileKey(key.compress_ratio) and key.block_size == BLOCK_SIZE


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not text.startswith(type(exc).__name__) else text


@contextlib.contextmanager
def compile_only_driver(target: GPUTarget | None) -> Iterator[None]:
    """Within this block Triton's JIT compiles for ``target`` with no GPU (None: leave the real driver)."""
    if target is None:
        yield
        return
    with triton_adapter.stand_in_active(_StandInDriver(target)):
        yield


# The key whose compile runs in this thread (set around each warm and each pooled compile), so that Triton's
# compilation listener can tell which key it reports on.
_compiling = threading.local()


@contextlib.contextmanager
def cache_hits() -> Iterator[set[CompileKey]]:
    """Within this block, the keys Triton loaded from its cache rather than compiled, through its compilation
    listener (``triton.knobs.compilation.listener``, chained to any listener installed before). A Triton without
    one fills nothing: every key then counts as compiled."""
    hits: set[CompileKey] = set()
    compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        yield hits
        return
    previous = compilation.listener

    def listener(*args, **kwargs):
        key = getattr(_compiling, "key", None)
        if kwargs.get("cache_hit") and key is not None:
            hits.add(key)
        return previous(*args, **kwargs) if previous is not None else None

    compilation.listener = listener
    try:
        yield hits
    finally:
        compilation.listener = previous


def start_compiler() -> float | None:
    """Seconds spent hashing the Triton installation, which its cache key covers; None where this Triton leaves it
    to the first compile (triton_adapter's ``compiler_key``).

    Triton does it once per process, on the first compile, cache hit or not, and it takes far longer than a
    warm-cache key (docs/performance.md); doing it first keeps it out of the first key's compile seconds.
    """
    start = time.perf_counter()
    return time.perf_counter() - start if triton_adapter.hash_installation() else None


def compile_keys(
    keys: Sequence[CompileKey],
    allowed: Sequence[CompileKey],
    *,
    target: str | None = None,
    workers: int = 1,
    progress: Callable[[int, int, CompileOutcome], None] | None = None,
    prove: bool = True,
) -> list[CompileOutcome]:
    """Compile ``keys`` (each must be in ``allowed``) and return one outcome per key, in key order.

    ``target=None`` warms the kernel that live launches use, on the current CUDA device. A target such
    as ``cuda:90`` compiles ahead of time with no GPU. A failed compile is an outcome with ``ok=False``
    and the compiler's message, never an exception; refused keys raise :class:`KeyRefusedError` before
    anything compiles. With ``prove``, each compiled key is then launched once (:func:`prove_key`): a wrong
    answer makes it an outcome with ``ok=False`` naming the first wrong element. ``progress`` sees each key
    once it is compiled and proved.
    """
    check_keys(keys, allowed)
    serialise_ast_parse()  # the compiles below parse the kernel's source, in parallel when workers > 1
    hashed = start_compiler()
    if hashed is not None:
        log.debug("Triton compiler start-up took %.3f s", hashed)
    if target is None:
        import torch  # the warmup's arguments are tensors on the serving GPU

        kernel, gpu_target, device = triton_kernel._build_prefill_metadata_kernel, None, torch.device("cuda")
    else:
        # A fresh JITFunction per ahead-of-time run: its per-device caches remember the target. Nothing launches on
        # a device: the arguments are host arrays, the proof runs in the interpreter, and Triton's binder is set up
        # without torch (seconds of a CPU server's start, which needs nothing else of it).
        kernel = triton.jit(triton_kernel._build_prefill_metadata_kernel_fn, **KERNEL_JIT_OPTIONS)
        gpu_target, device = parse_target(target), None
        triton_adapter.bind_without_torch()
    async_mode = triton_adapter.async_compile_mode() if workers > 1 else None

    outcomes: dict[CompileKey, CompileOutcome] = {}
    compiled: list[CompileOutcome] = []  # in completion order; proved after the compiler's driver is restored
    done = 0

    def finish(outcome: CompileOutcome) -> None:
        if outcome.ok and outcome.key in hits:
            outcome = dataclasses.replace(outcome, cached=True)
        compiled.append(outcome)

    def conclude(outcome: CompileOutcome) -> None:
        nonlocal done
        if prove and outcome.ok:
            outcome = _proved(outcome, on_gpu=target is None)
        done += 1
        outcomes[outcome.key] = outcome
        if progress is not None:
            progress(done, len(keys), outcome)

    def warm(key: CompileKey) -> None:
        _compiling.key = key
        kernel.warmup(
            *warmup_arguments(key, device),
            grid=(1,),
            BLOCK_SIZE=key.block_size,
            COMPRESS_RATIO=key.compress_ratio,
        )

    with compile_only_driver(gpu_target), cache_hits() as hits, contextlib.ExitStack() as parallel:
        # With an async compile mode, warming a key submits its compile to this pool and returns; the outcome
        # comes from the future. Without, warming a key is its compile.
        timed: _TimedExecutor | None = None
        if async_mode is not None:
            pool = parallel.enter_context(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile"))
            timed = _TimedExecutor(pool)
            parallel.enter_context(async_mode(timed, ignore_errors=True))
        for key in keys:
            if timed is not None:
                timed.current = key
            start = time.perf_counter()
            try:
                warm(key)
            except Exception as exc:  # the compile failed (in parallel: argument binding, before the compiler)
                finish(CompileOutcome(key, time.perf_counter() - start, False, _describe(exc)))
            else:
                if timed is None or key not in timed.futures.values():  # compiled now, or already warm
                    finish(CompileOutcome(key, time.perf_counter() - start, True))
            if timed is None and target is None:  # nothing to restore: prove at once, so progress follows each key
                conclude(compiled.pop())
        for future in as_completed(list(timed.futures) if timed is not None else []):
            key = timed.futures[future]
            seconds, error = timed.timings[key]
            finish(CompileOutcome(key, seconds, error is None, error))
    for outcome in compiled:
        conclude(outcome)
    return [outcomes[k] for k in keys]


def _proved(outcome: CompileOutcome, *, on_gpu: bool) -> CompileOutcome:
    """The outcome after :func:`prove_key`: its ``proof`` set, failed with the proof's message when the launch
    disagrees."""
    if not launchable(outcome.key):
        return outcome
    start = time.perf_counter()
    try:
        wrong = prove_key(outcome.key, on_gpu=on_gpu)
    except ProofUnavailableError as exc:
        log.warning("proof skipped key=%s: %s", outcome.key.label(), exc)
        return dataclasses.replace(outcome, proof=PROOF_SKIPPED)
    except Exception as exc:  # the proof must never take the warmup down: a failed key, not a crash
        wrong = f"proof launch raised {_describe(exc)}"
    log.debug("proof key=%s seconds=%.4f ok=%s", outcome.key.label(), time.perf_counter() - start, wrong is None)
    if wrong is None:
        return dataclasses.replace(outcome, proof=PROOF_OK)
    return dataclasses.replace(outcome, ok=False, error=f"compiled, but {wrong}", proof=PROOF_FAILED)


def watch_compiles(callback: Callable[[str], None]) -> Callable[[], None]:
    """Call ``callback(kernel_name)`` after every compile of the prefill-metadata kernel in this process.

    Chains ``triton.knobs.runtime.jit_post_compile_hook`` (which also fires on a disk-cache load) and
    keeps any hook installed before. Returns a function that uninstalls it.
    """
    previous = triton.knobs.runtime.jit_post_compile_hook
    kernel_name = triton_kernel._build_prefill_metadata_kernel_fn.__name__

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
