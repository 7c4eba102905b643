"""The one request path behind every transport (KServe's "data plane"): readiness, validation, limits, policy,
backend, metrics. The gRPC servicer and the HTTP app only decode and encode around :meth:`DataPlane.call`.

Every failure leaves this module as a :class:`ServiceError` carrying a gRPC status code, so the transports
map one exception type and the metrics see the same code the caller does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from kernels.inputs import (
    ChunkHostPart,
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    InvalidInputError,
    assemble,
    chunk_host_part,
)
from kernels.naive import chunk_arrays_numpy
from kernels.planner import BatchInputs, build_prefill_batch, prefill_workspace_size
from kernels.specialization import CompileKey, normalize_compress_ratio
from protos.indexer.v1 import indexer_pb2 as pb
from service import codec
from service.config import ConfigError, ServiceConfig
from service.metrics import Metrics
from service.warmup import KeyState, Warmup, WarmupState

log = logging.getLogger(__name__)

# Upper bound of a ChunkMetadata's (and its ChunkSpec's) bytes besides the arrays: tags, lengths, scalars.
_CHUNK_OVERHEAD_BYTES = 512


class ServiceError(Exception):
    """A request's final status: a gRPC code and a message for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _at(field: str, index: int | None = None) -> str:
    return field if index is None else f"{field}[{index}]"


ArraysFn = Callable[[ChunkHostPart, DcpConfig], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Backend:
    """What computes a chunk's three arrays once the host part is known."""

    name: str
    arrays: ArraysFn


def resolve_backend(choice: str) -> str:
    """``auto`` becomes ``triton`` on a CUDA machine and ``numpy`` elsewhere; ``triton`` needs CUDA."""
    if choice == "numpy":
        return "numpy"
    import torch  # only when the Triton backend is possible: importing torch costs seconds

    if torch.cuda.is_available():
        return "triton"
    if choice == "triton":
        raise ConfigError("backend", "triton needs a CUDA GPU, and torch sees none")
    return "numpy"


def launch_admission(warmup: Warmup) -> Callable[[CompileKey], None]:
    """Strict mode's check: a launch whose kernel variant is outside the warmed set is refused, not compiled."""

    def admit(key: CompileKey) -> None:
        if key not in warmup.compiled_keys():
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{_at('compress_ratio')}: kernel variant {key.label()} is not in the warmed set and strict mode "
                "refuses to compile after ready",
            )

    return admit


def make_backend(name: str, admit: Callable[[CompileKey], None] | None) -> Backend:
    """The numpy implementation, or the Triton kernel on the current CUDA device (``admit`` sees each launch)."""
    if name == "triton":
        from kernels.triton_kernel import TritonChunkBuilder

        return Backend("triton", TritonChunkBuilder("cuda", admit=admit).arrays)
    return Backend("numpy", chunk_arrays_numpy)


_WARMUP_STATES = {
    WarmupState.RUNNING: pb.WARMUP_STATE_RUNNING,
    WarmupState.READY: pb.WARMUP_STATE_READY,
    WarmupState.FAILED: pb.WARMUP_STATE_FAILED,
    WarmupState.SKIPPED: pb.WARMUP_STATE_SKIPPED,
}
_KEY_STATES = {
    KeyState.PENDING: pb.KEY_STATE_PENDING,
    KeyState.COMPILED: pb.KEY_STATE_COMPILED,
    KeyState.FAILED: pb.KEY_STATE_FAILED,
    KeyState.SKIPPED: pb.KEY_STATE_SKIPPED,
}


class _RequestBuild:
    """Builds the chunks of one request: guards the workspace and the response size before any array exists,
    and adds up the backend's time."""

    def __init__(self, plane: DataPlane, omit_token_to_seq: bool) -> None:
        self.plane = plane
        self.omit = omit_token_to_seq
        self.response_bytes = 0
        self.backend_seconds = 0.0

    def __call__(self, inputs: ChunkInputs) -> ChunkMetadata | None:
        self.response_bytes += _CHUNK_OVERHEAD_BYTES
        host = chunk_host_part(inputs)
        if host is None:
            return None
        self._charge(inputs, host)
        start = time.perf_counter()
        token_to_seq, ks, ke = self.plane.backend.arrays(host, inputs.dcp)
        self.backend_seconds += time.perf_counter() - start
        return assemble(inputs, host, token_to_seq, ks, ke)

    def _charge(self, inputs: ChunkInputs, host: ChunkHostPart) -> None:
        config = self.plane.config
        workspace = prefill_workspace_size(config.max_model_len, host.ratio)
        if host.total > workspace:
            over = int(np.searchsorted(host.cu_seq_lens, workspace, side="right")) - 1
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{_at('seq_lens', inputs.req_start + over)}: the chunk's compressed tokens reach {host.total}, "
                f"above the KV workspace of {workspace} (max_model_len {config.max_model_len} * 40 / compress "
                f"ratio {host.ratio})",
            )
        a, b = host.query_slice
        self.response_bytes += 8 * (b - a) + 8 * host.cu_seq_lens.size + (0 if self.omit else 4 * host.total)
        if self.response_bytes > config.max_message_bytes:
            advice = "send a smaller batch" if self.omit else "set omit_token_to_seq or send a smaller batch"
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"response: more than {self.response_bytes} bytes, above max_message_bytes "
                f"{config.max_message_bytes}; {advice}",
            )


class DataPlane:
    """Serves the RPCs of ``indexer.v1.PrefillMetadata`` whatever the transport, and owns readiness."""

    def __init__(self, config: ServiceConfig, metrics: Metrics, warmup: Warmup, backend: Backend) -> None:
        self.config = config
        self.metrics = metrics
        self.warmup = warmup
        self.backend = backend
        self._admit = launch_admission(warmup) if config.strict else None
        self._handlers: dict[str, tuple[Callable, bool]] = {
            "BuildChunk": (self._build_chunk, True),
            "PlanBatch": (self._plan_batch, True),
            "GetWarmupStatus": (self._warmup_status, False),  # answered before ready: it says why not
        }
        self._lock = threading.Lock()
        self._draining = False
        self._ready = False
        self._compiles_after_ready = 0
        self._listeners: list[Callable[[bool], None]] = []

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self._handlers)

    # --- readiness --------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._ready

    def add_readiness_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(ready)`` now and on every change (health service, readiness gauge)."""
        with self._lock:
            self._listeners.append(listener)
            ready = self._ready
        listener(ready)

    def refresh_readiness(self) -> bool:
        """Ready = warmup finished well and not draining. Call after the warmup and on shutdown."""
        with self._lock:
            ready = self.warmup.finished_ok and not self._draining
            changed, self._ready = ready != self._ready, ready
            listeners = list(self._listeners) if changed else []
        for listener in listeners:
            listener(ready)
        if changed:
            self.metrics.ready.set(int(ready))
            if ready:
                log.info("ready backend=%s warmup=%s", self.backend.name, self.warmup.state.value)
            else:
                log.info("not ready reason=%s", self.not_ready_reason())
        return ready

    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True
        self.refresh_readiness()

    def not_ready_reason(self) -> str:
        """Why the server is not ready ("" when it is), for /readyz and UNAVAILABLE messages."""
        with self._lock:
            draining = self._draining
        if draining:
            return "draining: the server is shutting down"
        state = self.warmup.state
        if state is WarmupState.RUNNING:
            compiled = len(self.warmup.compiled_keys())
            return f"warming up: {compiled}/{len(self.warmup.keys)} kernel variants compiled"
        if state is WarmupState.FAILED:
            return "warmup failed: a kernel variant did not compile (see GetWarmupStatus and the server log)"
        return ""

    def on_kernel_compile(self, kernel_name: str) -> None:
        """Triton's post-compile hook: a compile after ready means a launch missed the warmed set."""
        if not self.warmup.finished_ok:
            return
        with self._lock:
            self._compiles_after_ready += 1
            total = self._compiles_after_ready
        self.metrics.compiles_after_ready_total.inc()
        log.warning("compile after ready kernel=%s total=%d: a launch needed a variant outside the warmup", kernel_name,
                    total)  # fmt: skip

    # --- the request path -------------------------------------------------------------------------------

    def call(self, method: str, request: object) -> object:
        """Serve one RPC; raises only :class:`ServiceError`."""
        handler, needs_ready = self._handlers[method]
        in_flight = self.metrics.requests_in_flight.labels(method=method)
        in_flight.inc()
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            if needs_ready and not self.warmup.finished_ok:
                # Gated on the warmup, not on readiness: while draining, calls already on their way still
                # get answered (gRPC itself refuses new ones once the server stops).
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"not ready: {self.not_ready_reason()}")
            return handler(request)
        except ServiceError as exc:
            code = exc.code
            raise
        except InvalidInputError as exc:
            code = grpc.StatusCode.INVALID_ARGUMENT
            raise ServiceError(code, str(exc)) from exc
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("internal error method=%s", method)
            raise ServiceError(code, f"internal error ({type(exc).__name__}); see the server log") from exc
        finally:
            self.metrics.request_duration_seconds.labels(method=method, code=code.name).observe(
                time.perf_counter() - start
            )
            if code is not grpc.StatusCode.OK:
                self.metrics.request_errors_total.labels(method=method, code=code.name).inc()
            in_flight.dec()

    def _admit_request(self, inputs: ChunkInputs | BatchInputs) -> None:
        """Limits (RESOURCE_EXHAUSTED) and policy (FAILED_PRECONDITION) before any work; the kernel layer
        validates everything else (INVALID_ARGUMENT)."""
        config = self.config
        qsl, seq = inputs.query_start_loc, inputs.seq_lens
        exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
        if seq.size > config.max_num_seqs:
            raise ServiceError(exhausted, f"{_at('seq_lens')}: {seq.size} sequences, above max_num_seqs "
                                          f"{config.max_num_seqs}")  # fmt: skip
        if (qsl > config.max_num_batched_tokens).any():
            i = int(np.argmax(qsl > config.max_num_batched_tokens))
            raise ServiceError(exhausted, f"{_at('query_start_loc', i)}: {qsl[i]} query tokens, above "
                                          f"max_num_batched_tokens {config.max_num_batched_tokens}")  # fmt: skip
        if (seq > config.max_model_len).any():
            i = int(np.argmax(seq > config.max_model_len))
            raise ServiceError(exhausted, f"{_at('seq_lens', i)}: {seq[i]} tokens, above max_model_len "
                                          f"{config.max_model_len}")  # fmt: skip
        try:
            ratio = normalize_compress_ratio(inputs.compress_ratio)
        except ValueError as exc:
            raise InvalidInputError("compress_ratio", str(exc)) from None
        if inputs.dcp.world_size > 1 and ratio > 1:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{_at('dcp_world_size')}: DCP (world size {inputs.dcp.world_size}) with compress ratio {ratio} is "
                "not supported: no engine shards compressed KV across DCP ranks (vLLM's builder rejects it); "
                "DCP is supported at compress ratio 0 or 1",
            )
        if self._admit is not None:
            # Service-owned buffers are always aligned and scalars validated to int32, so the ratio alone
            # decides the variant, on either backend; the Triton backend checks each real launch again.
            self._admit(CompileKey(compress_ratio=ratio))

    def _observe_size(self, method: str, requests: int, tokens: int, build: _RequestBuild) -> None:
        self.metrics.request_batch_requests.labels(method=method).observe(requests)
        self.metrics.request_query_tokens.labels(method=method).observe(tokens)
        self.metrics.backend_duration_seconds.labels(method=method, backend=self.backend.name).observe(
            build.backend_seconds
        )

    def _build_chunk(self, request: pb.BuildChunkRequest) -> pb.BuildChunkResponse:
        inputs = codec.chunk_inputs_from_proto(request)
        self._admit_request(inputs)
        build = _RequestBuild(self, request.omit_token_to_seq)
        meta = build(inputs)
        if meta is None:
            self._observe_size("BuildChunk", inputs.req_end - inputs.req_start, 0, build)
            return pb.BuildChunkResponse()
        a, b = meta.query_slice
        self._observe_size("BuildChunk", meta.num_reqs, b - a, build)
        return pb.BuildChunkResponse(metadata=codec.metadata_to_proto(meta, request.omit_token_to_seq))

    def _plan_batch(self, request: pb.PlanBatchRequest) -> pb.PlanBatchResponse:
        config = self.config
        batch = codec.batch_inputs_from_proto(request, config.max_model_len, config.max_logits_bytes)
        self._admit_request(batch)
        if batch.max_model_len > config.max_model_len:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"max_model_len: {batch.max_model_len}, above the server's max_model_len {config.max_model_len}",
            )
        build = _RequestBuild(self, request.omit_token_to_seq)
        plan = build_prefill_batch(batch, build)
        decodes = batch.num_decodes  # validated by the planner
        tokens = int(batch.query_start_loc[-1] - batch.query_start_loc[decodes])
        self._observe_size("PlanBatch", batch.seq_lens.size - decodes, tokens, build)
        return codec.plan_to_proto(plan, request.omit_token_to_seq)

    def _warmup_status(self, request: pb.GetWarmupStatusRequest) -> pb.GetWarmupStatusResponse:
        warmup = self.warmup
        with self._lock:
            compiles_after_ready = self._compiles_after_ready
        return pb.GetWarmupStatusResponse(
            state=_WARMUP_STATES[warmup.state],
            backend=self.backend.name,
            target=warmup.target_name,
            strict=self.config.strict,
            keys=[
                pb.KeyStatus(
                    label=p.key.label(),
                    key_json=p.key.to_json(),
                    state=_KEY_STATES[p.state],
                    compile_seconds=p.seconds,
                    error=p.error,
                )
                for p in warmup.progress()
            ],
            warmup_seconds=warmup.seconds,
            compiles_after_ready=compiles_after_ready,
            ready=self.ready,
        )
