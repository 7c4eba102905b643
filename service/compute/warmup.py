"""The start-up warmup: compile every key of the model's warmup set, prove it, track each key, fail closed.

On the Triton and auto backends the keys compile in-process on the serving GPU (what later launches hit); on the
numpy backend (no GPU) they compile ahead of time for the configured target, which proves the toolchain works and
fills the Triton cache. Each compiled key is then launched once on a tiny input and checked against numpy (on the
GPU in process, through Triton's interpreter ahead of time: ``kernels.compile_engine.prove_key``); a wrong answer
fails the key, naming the first wrong element, and the server stays not ready. ``precompile`` uses the same
:func:`compile_and_log` without a server. With every key ready, ``calibrate`` (auto's crossover) runs last.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from indexer_service.kernels.specialization import CompileKey, ModelConfig, warmup_keys

if TYPE_CHECKING:  # the compile engine imports Triton: loaded only when something compiles
    from indexer_service.kernels.compile_engine import CompileOutcome
    from indexer_service.service.observability.metrics import Metrics

log = logging.getLogger(__name__)

IN_PROCESS = "in-process"


class WarmupState(enum.Enum):
    RUNNING = "running"
    READY = "ready"
    FAILED = "failed"
    SKIPPED = "skipped"


class KeyState(enum.Enum):
    PENDING = "pending"
    COMPILED = "compiled"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class KeyProgress:
    """One key's warmup. ``cached``: a COMPILED key that Triton loaded from its cache instead of compiling."""

    key: CompileKey
    state: KeyState
    seconds: float = 0.0
    error: str = ""
    cached: bool = False


_preloads: list[threading.Thread] = []


def preload_compiler() -> None:
    """Start loading Triton in a thread of its own: its import and the hash of its installation that keys its
    cache (``start_compiler``: most of it file reads and hashlib, which leave the interpreter free). Called by
    ``serve`` as soon as its configuration says it warms up, before it imports and builds the server, so that this
    overlaps that (and, on a GPU, the warmup thread's import of torch); :meth:`Warmup.load_compiler` waits for it. Not
    torch itself: its import holds the interpreter, so beside the server's start it slows both, and the server is
    ready later, not sooner (docs/performance.md); an ahead-of-time warmup (no GPU) never imports it. Idempotent; a
    failure here is left for the warmup to meet again and report."""
    if _preloads:
        return

    def compiler() -> None:
        with contextlib.suppress(Exception):
            from indexer_service.kernels.compile_engine import start_compiler

            start_compiler()

    thread = threading.Thread(target=compiler, name="preload-triton", daemon=True)
    thread.start()
    _preloads.append(thread)


def use_triton_cache_dir(configured: str) -> str | None:
    """Point Triton at ``configured`` unless TRITON_CACHE_DIR is already set, which always wins.

    Returns the directory Triton will use (None: Triton's default).
    """
    existing = os.environ.get("TRITON_CACHE_DIR")
    if existing:
        if configured and os.path.abspath(configured) != os.path.abspath(existing):
            log.warning("triton_cache_dir=%s ignored: TRITON_CACHE_DIR=%s is set and wins", configured, existing)
        return existing
    if configured:
        os.environ["TRITON_CACHE_DIR"] = configured
        return configured
    return None


def compile_and_log(
    keys: Sequence[CompileKey],
    model_keys: Sequence[CompileKey],
    target: str | None,
    workers: int,
    phase: str,
    on_outcome: Callable[[CompileOutcome], None] | None = None,
) -> list[CompileOutcome]:
    """Compile ``keys``, logging ``<phase> n/N key=... seconds=... source=cache|compiler proof=...`` per key. Every
    key must be in ``model_keys``, the model's warmup set (:func:`~kernels.specialization.warmup_keys`): the compile
    engine refuses any other before anything compiles."""
    from indexer_service.kernels.compile_engine import compile_keys

    def progress(done: int, total: int, outcome: CompileOutcome) -> None:
        if outcome.ok:
            log.info(
                "%s %d/%d key=%s seconds=%.3f source=%s proof=%s",
                phase,
                done,
                total,
                outcome.key.label(),
                outcome.seconds,
                "cache" if outcome.cached else "compiler",
                outcome.proof,
            )
        else:
            log.error(
                "%s %d/%d key=%s seconds=%.3f failed error=%r",
                phase,
                done,
                total,
                outcome.key.label(),
                outcome.seconds,
                outcome.error,
            )
        if on_outcome is not None:
            on_outcome(outcome)

    return compile_keys(keys, model_keys, target=target, workers=workers, progress=progress)


class Warmup:
    """Runs the warmup once and answers, at any time, how far it got."""

    def __init__(
        self,
        keys: Sequence[CompileKey],
        *,
        target: str | None,
        enabled: bool,
        workers: int,
        metrics: Metrics,
        model: ModelConfig | None = None,
    ) -> None:
        self.keys = tuple(keys)
        # What the keys are checked against before anything compiles: the model's warmup set (without a model,
        # in tests that warm a chosen set, the keys themselves).
        self.model_keys = tuple(warmup_keys(model)) if model is not None else self.keys
        self.target = target  # None: in-process on the serving GPU
        self.enabled = enabled
        self.workers = workers
        self.metrics = metrics
        self._lock = threading.Lock()
        initial = KeyState.PENDING if enabled else KeyState.SKIPPED
        self._progress = {key: KeyProgress(key, initial) for key in self.keys}
        self._state = WarmupState.RUNNING if enabled else WarmupState.SKIPPED
        self.seconds = 0.0
        # Runs after every key compiled and proved, before READY (auto's crossover measurement); set by the
        # server. Its failure is logged and leaves the server ready: what it tunes has a safe default.
        self.calibrate: Callable[[Sequence[CompileKey]], object] | None = None
        metrics.warmup_keys.labels(state="planned").set(len(self.keys))

    @property
    def target_name(self) -> str:
        if not self.enabled:
            return "none"
        return self.target or IN_PROCESS

    @property
    def state(self) -> WarmupState:
        with self._lock:
            return self._state

    @property
    def finished_ok(self) -> bool:
        return self.state in (WarmupState.READY, WarmupState.SKIPPED)

    def progress(self) -> list[KeyProgress]:
        with self._lock:
            return [self._progress[key] for key in self.keys]

    def compiled_keys(self) -> frozenset[CompileKey]:
        with self._lock:
            return frozenset(k for k, p in self._progress.items() if p.state is KeyState.COMPILED)

    def load_compiler(self) -> None:
        """Import the compile engine, and torch for an in-process warmup on the GPU (seconds), ahead of :meth:`run`,
        so that the workers of a replica, which take turns for the compiles, import them in parallel; in one
        process, wait for :func:`preload_compiler`'s threads instead. An ahead-of-time warmup (a target, no GPU)
        needs no torch: its keys bind host arrays and prove in Triton's interpreter. An import that fails is left for
        :meth:`run` to meet again and report."""
        if self.enabled:
            with contextlib.suppress(Exception):
                if self.target is None:
                    import torch  # noqa: F401

                import indexer_service.kernels.compile_engine  # noqa: F401
            for thread in _preloads:
                thread.join()

    def run(self) -> WarmupState:
        """Compile every key; READY only when all compiled. Never raises: anything unexpected is FAILED."""
        if not self.enabled:
            log.info("warmup skipped keys=%d (warmup_target=none)", len(self.keys))
            return self.state
        log.info("warmup start keys=%d target=%s workers=%d", len(self.keys), self.target_name, self.workers)
        start = time.perf_counter()
        try:
            compile_and_log(self.keys, self.model_keys, self.target, self.workers, "warmup", self._record)
        except Exception as exc:  # fail closed: a warmup that could not run leaves the server not ready
            log.exception("warmup aborted target=%s error=%r", self.target_name, exc)
            with self._lock:
                for key, p in self._progress.items():
                    if p.state is KeyState.PENDING:
                        self._progress[key] = KeyProgress(key, KeyState.FAILED, error=f"warmup aborted: {exc!r}")
                        self.metrics.warmup_failures_total.inc()
                self._publish_counts()
        with self._lock:
            failed = sum(p.state is KeyState.FAILED for p in self._progress.values())
        if not failed and self.calibrate is not None:
            try:
                self.calibrate(self.keys)
            except Exception as exc:
                log.exception("warmup calibration failed (its default stays) error=%r", exc)
        self.seconds = time.perf_counter() - start
        self.metrics.warmup_duration_seconds.set(self.seconds)
        with self._lock:
            self._state = WarmupState.FAILED if failed else WarmupState.READY
        if failed:
            log.error("warmup failed failed=%d/%d seconds=%.3f: not ready", failed, len(self.keys), self.seconds)
        else:
            log.info("warmup done keys=%d seconds=%.3f", len(self.keys), self.seconds)
        return self.state

    def _record(self, outcome: CompileOutcome) -> None:
        state = KeyState.COMPILED if outcome.ok else KeyState.FAILED
        label = outcome.key.label()
        self.metrics.warmup_key_compile_seconds.labels(key=label).set(outcome.seconds)
        self.metrics.compile_duration_seconds.labels(phase="warmup").observe(outcome.seconds)
        if not outcome.ok:
            self.metrics.warmup_failures_total.inc()
        with self._lock:
            self._progress[outcome.key] = KeyProgress(
                outcome.key, state, outcome.seconds, outcome.error or "", outcome.ok and outcome.cached
            )
            self._publish_counts()

    def _publish_counts(self) -> None:
        """The compiled, cached and failed gauges from the per-key states (caller holds the lock): a key loaded
        from Triton's cache counts as cached, not compiled."""
        progress = self._progress.values()
        counts = {
            "compiled": sum(p.state is KeyState.COMPILED and not p.cached for p in progress),
            "cached": sum(p.state is KeyState.COMPILED and p.cached for p in progress),
            "failed": sum(p.state is KeyState.FAILED for p in progress),
        }
        for label, count in counts.items():
            self.metrics.warmup_keys.labels(state=label).set(count)
