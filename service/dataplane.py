"""The one request path behind every transport (KServe's "data plane"): readiness, validation, limits, policy,
backend, metrics. The gRPC servicer and the HTTP app only decode and encode around :meth:`DataPlane.call`.

Every failure leaves this module as a :class:`ServiceError` carrying a gRPC status code, so the transports
map one exception type and the metrics see the same code the caller does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from contextvars import ContextVar
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from indexer_service.kernels.inputs import (
    ChunkArrays,
    ChunkHostPart,
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    InvalidInputError,
    assemble,
    chunk_host_parts,
    validate_batch,
    validate_dcp,
)
from indexer_service.kernels.naive import chunk_arrays_numpy_many
from indexer_service.kernels.planner import (
    WORKSPACE_TOKENS_PER_MODEL_LEN,
    BatchInputs,
    PlanTooLargeError,
    PrefillPlan,
    chunk_inputs_of_plan,
    max_prefill_seq_len,
    plan_prefill_batch,
    prefill_workspace_size,
)
from indexer_service.kernels.specialization import CompileKey, normalize_compress_ratio
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import _fastpath, codec
from indexer_service.service.admission import (
    Admission,
    Caller,
    Refused,
    container_memory_limit,
    default_response_budget,
)
from indexer_service.service.auto_backend import AutoSelector
from indexer_service.service.config import ConfigError, ServiceConfig
from indexer_service.service.metrics import SHED_REASONS, Metrics
from indexer_service.service.warmup import KeyState, Warmup, WarmupState

log = logging.getLogger(__name__)

# Upper bound of a ChunkMetadata's (and its ChunkSpec's) bytes besides the arrays: tags, lengths, scalars.
_CHUNK_OVERHEAD_BYTES = 512
# The backend label of calls that service/fastpath.c served whole.
FAST_PATH_BACKEND = "native"
# What a planned chunk costs besides its bytes, in bytes of response: each is a few Python objects and a
# backend call (~150 us against ~1 GB/s for the arrays), which is what makes tiny-budget plans expensive.
CHUNK_COST_BYTES = 64 * 2**10


_METHODS = pb.DESCRIPTOR.services_by_name["PrefillMetadata"].methods
REQUEST_TYPES = {method.name: getattr(pb, method.input_type.name) for method in _METHODS}
RESPONSE_TYPES = {method.name: getattr(pb, method.output_type.name) for method in _METHODS}


class ServiceError(Exception):
    """A request's final status: a gRPC code and a message for the caller; ``shed_reason`` (one of
    metrics.SHED_REASONS) when the server refused or cut the call to protect itself."""

    def __init__(self, code: grpc.StatusCode, message: str, shed_reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.shed_reason = shed_reason


@dataclass
class _CallState:
    """The current call, for the phases of its handler: who calls, what it holds until it returns (a heavy-lane
    slot), and whether the server's shutdown grace has ended."""

    caller: Caller
    held: ExitStack
    shutdown_cut: threading.Event


# Set by DataPlane.call for the call's duration, on its thread.
_CALL: ContextVar[_CallState | None] = ContextVar("call", default=None)


def stop_if_abandoned() -> None:
    """Stop the current call's work when its caller has cancelled or its deadline has passed (or the shutdown
    grace has ended and the server cancelled it): nobody would read the answer, and the thread is better spent
    on calls whose callers wait."""
    state = _CALL.get()
    code = state.caller.gone() if state is not None else None
    if code is None:
        return
    if state.shutdown_cut.is_set():
        raise ServiceError(code, "the server shut down before the call finished; work stopped", "shutdown")
    raise ServiceError(code, "the caller went away (cancelled or past its deadline); work stopped")


def _parse(method: str, data: bytes, where: str) -> object:
    try:
        return REQUEST_TYPES[method].FromString(data)
    except DecodeError:
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{where}: not a {REQUEST_TYPES[method].__name__} message"
        ) from None


def _at(field: str, index: int | None = None) -> str:
    return field if index is None else f"{field}[{index}]"


# (host parts, DCP settings, with_token_to_seq) -> each chunk's arrays
ArraysFn = Callable[[Sequence[ChunkHostPart], DcpConfig, bool], list[ChunkArrays]]
# (request bytes, limits, admitted ratios) -> (response bytes, requests, query tokens, seconds), or None: see
# service/fastpath.c
FastPathFn = Callable[[bytes, tuple[int, ...], tuple[int, ...] | None], tuple[bytes, int, int, float] | None]


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


def resolve_backend(choice: str) -> str:
    """``auto`` stays ``auto`` on a CUDA machine (numpy or Triton per request) and becomes ``numpy`` elsewhere;
    ``triton`` needs CUDA."""
    if choice == "numpy":
        return "numpy"
    import torch  # only when the Triton backend is possible: importing torch costs seconds

    if torch.cuda.is_available():
        return choice
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


def make_backend(name: str, admit: Callable[[CompileKey], None] | None, native_fast_path: bool = False) -> Backend:
    """The numpy implementation (with service/fastpath.c for BuildChunk's common case when
    ``native_fast_path``), or the Triton kernel on the current CUDA device (``admit`` sees each launch)."""
    numpy_backend = Backend("numpy", chunk_arrays_numpy_many, _fastpath.build_chunk if native_fast_path else None)
    if name == "numpy":
        return numpy_backend
    from indexer_service.kernels.triton_kernel import TritonChunkBuilder

    # One launch for all the chunks of a request (a whole prefill plan): one copy in, one copy out. No fast
    # path: this backend's point is computing on the GPU.
    triton_backend = Backend("triton", TritonChunkBuilder("cuda", admit=admit).arrays_many)
    if name == "triton":
        return triton_backend
    from indexer_service.service.auto_backend import AutoSelector

    selector = AutoSelector(numpy_backend, triton_backend, numpy_backend.arrays_many, triton_backend.arrays_many)
    fast = None
    if native_fast_path:

        def fast(data: bytes, limits: tuple[int, ...], admitted: tuple[int, ...] | None):
            # Answers at or above the crossover step aside to the general path, which gives them to Triton.
            bounded = (*limits[:4], selector.fast_path_bytes(limits[4]), *limits[5:])
            return _fastpath.build_chunk(data, bounded, admitted)

    return Backend("auto", numpy_backend.arrays_many, fast, selector)


def fast_path_limits(config: ServiceConfig, max_response_bytes: int) -> tuple[int, ...]:
    """The limits service/fastpath.c checks, in its order (the general path's, see ``_admit_request`` and
    ``_check_sizes``); a larger answer than ``max_response_bytes`` steps aside to the general path."""
    return (
        config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
        config.max_model_len * WORKSPACE_TOKENS_PER_MODEL_LEN, max_response_bytes, _CHUNK_OVERHEAD_BYTES,
    )  # fmt: skip


def max_request_bytes(config: ServiceConfig) -> int:
    """The largest request message either transport accepts: what a valid request at the configured limits can
    take (two int32 arrays of max_num_seqs + 1 elements and a few scalars), with room for other encodings.
    Anything larger is refused before it is read whole, so queued requests cannot fill memory."""
    return min(config.max_message_bytes, 64 * 2**10 + 32 * (config.max_num_seqs + 1))


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


class DataPlane:
    """Serves the RPCs of ``indexer.v1.PrefillMetadata`` whatever the transport, and owns readiness."""

    def __init__(self, config: ServiceConfig, metrics: Metrics, warmup: Warmup, backend: Backend) -> None:
        self.config = config
        self.metrics = metrics
        self.warmup = warmup
        self.backend = backend
        self._admit = launch_admission(warmup) if config.strict else None
        budget = config.response_budget_bytes or default_response_budget(container_memory_limit())
        # Waiters hold a gRPC thread each: at most a quarter of the pool waits, so with the heavy lane's own
        # slots at least half of it is always free for light calls (a full-size attack with half the pool
        # allowed to wait left the light callers 65 % of their calls).
        self.admission = Admission(
            budget, config.heavy_request_bytes, config.heavy_lane_slots, config.admission_wait_seconds,
            max_waiting=config.grpc_workers // 4, metrics=metrics,
        )  # fmt: skip
        # The fast path serves light answers only: it reserves this much before it knows the size, and a
        # larger answer takes the general path, which reserves its estimate and the heavy lane.
        self._fast_reserve = min(config.max_message_bytes, config.heavy_request_bytes)
        self._fast_limits = fast_path_limits(config, self._fast_reserve)
        # Set when the shutdown grace ends: calls still running were cut by the shutdown, not by their callers.
        self.shutdown_cut = threading.Event()
        self.last_call_end = time.monotonic()
        # Every shed series exists from the start at 0, so rate() and alerts see the first shed call.
        for method in REQUEST_TYPES:
            for reason in SHED_REASONS:
                metrics.child(metrics.requests_shed_total, method, reason)
        self._fast_admitted: tuple[int, ...] | None = None
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
        log.warning("compile after ready kernel=%s total=%d: a launch needed a variant outside the warmup",
                    kernel_name, total)  # fmt: skip

    # --- the request path -------------------------------------------------------------------------------

    def call(self, method: str, request: object, where: str = "request", caller: Caller | None = None) -> bytes:
        """Serve one RPC: the response message's wire bytes, which both transports send as they are; raises
        only :class:`ServiceError`. ``request`` is a message, or its serialized bytes (undecodable bytes are
        INVALID_ARGUMENT naming ``where``). ``caller`` is the transport's view of the call (see
        :class:`~service.admission.Caller`): a build checks ``caller.gone()`` between its phases and stops, and
        on success ``caller.ticket`` holds the answer's bytes in the response budget until the transport
        releases it. Without a caller the ticket is released on return."""
        handler, needs_ready = self._handlers[method]
        in_flight = self.metrics.child(self.metrics.requests_in_flight, method)
        in_flight.inc()
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        local = caller is None
        caller = Caller() if caller is None else caller
        try:
            if needs_ready and not self.warmup.finished_ok:
                # Gated on the warmup, not on readiness: while draining, calls already on their way still
                # get answered (gRPC itself refuses new ones once the server stops).
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"not ready: {self.not_ready_reason()}")
            if isinstance(request, bytes):
                if method == "BuildChunk" and self.backend.build_chunk_fast is not None:
                    answer = self._build_chunk_fast(request, caller)
                    if answer is not None:
                        return answer
                request = _parse(method, request, where)
            with ExitStack() as held:
                token = _CALL.set(_CallState(caller, held, self.shutdown_cut))
                try:
                    answer = handler(request)
                finally:
                    _CALL.reset(token)
            if caller.ticket is not None:
                caller.ticket.shrink(len(answer))
            return answer
        except ServiceError as exc:
            code = exc.code
            if exc.shed_reason is not None:
                self.admission.shed.record(method, exc.shed_reason, exc.message)
            raise
        except InvalidInputError as exc:
            code = grpc.StatusCode.INVALID_ARGUMENT
            raise ServiceError(code, str(exc)) from exc
        except MemoryError as exc:  # the backend ran out of host or GPU memory; the next request may fit
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            log.warning("out of memory method=%s: %s", method, exc)
            raise ServiceError(code, f"out of memory: {exc}") from exc
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("internal error method=%s", method)
            raise ServiceError(code, f"internal error ({type(exc).__name__}); see the server log") from exc
        finally:
            if caller.ticket is not None and (local or code is not grpc.StatusCode.OK):
                caller.ticket.release()
            self.metrics.child(self.metrics.request_duration_seconds, method, code.name).observe(
                time.perf_counter() - start
            )
            if code is not grpc.StatusCode.OK:
                self.metrics.child(self.metrics.request_errors_total, method, code.name).inc()
            in_flight.dec()
            self.last_call_end = time.monotonic()

    def shed(self, method: str, reason: str, detail: str) -> None:
        """Count and log a call the transport refused or cut before or after the data plane saw it."""
        self.admission.shed.record(method, reason, detail)

    def _admit_work(self, response_bytes: int, num_chunks: int) -> None:
        """Hold the answer's bytes in the response budget and, for a heavy request, a heavy-lane slot until the
        call returns; or refuse (RESOURCE_EXHAUSTED, or the caller's own code when it left while waiting)."""
        state = _CALL.get()
        if state is None:  # a handler called outside DataPlane.call (tests): nothing to hold
            return
        caller, admission = state.caller, self.admission
        try:
            caller.ticket = admission.budget.reserve(caller.peer, response_bytes, caller)
            if response_bytes + CHUNK_COST_BYTES * num_chunks > admission.heavy_request_bytes:
                state.held.enter_context(admission.lane.slot(caller))
        except Refused as exc:
            code = (caller.gone() or grpc.StatusCode.CANCELLED) if exc.gone else grpc.StatusCode.RESOURCE_EXHAUSTED
            raise ServiceError(code, exc.message, exc.reason) from None

    def _admit_request(self, inputs: ChunkInputs | BatchInputs) -> None:
        """Malformed input first (INVALID_ARGUMENT), then limits (RESOURCE_EXHAUSTED), then policy
        (FAILED_PRECONDITION), all before any work: a request is named malformed before a limit or a policy
        speaks about values that mean nothing. The kernel layer checks the rest of the shape (chunk bounds)."""
        config = self.config
        qsl, seq = validate_batch(inputs.query_start_loc, inputs.seq_lens)
        validate_dcp(inputs.dcp)
        try:
            ratio = normalize_compress_ratio(inputs.compress_ratio)
        except ValueError as exc:
            raise InvalidInputError("compress_ratio", str(exc)) from None
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

    def _build(self, method: str, chunks: Sequence[ChunkInputs], omit_token_to_seq: bool) -> list[ChunkMetadata | None]:
        """Every chunk's metadata (None where it has no compressed token) after the limits on the workspace
        and the response size, checked on the host parts before any array is computed."""
        hosts = chunk_host_parts(chunks)
        response_bytes = self._check_sizes(chunks, hosts, omit_token_to_seq)
        self._admit_work(response_bytes, len(chunks))
        stop_if_abandoned()
        present = [host for host in hosts if host is not None]
        backend = self.backend.for_request(present, not omit_token_to_seq)
        start = time.perf_counter()
        arrays = iter(backend.arrays_many(present, chunks[0].dcp, not omit_token_to_seq) if present else [])
        self.metrics.child(self.metrics.backend_duration_seconds, method, backend.name).observe(
            time.perf_counter() - start
        )
        stop_if_abandoned()
        return [
            None if host is None else assemble(inputs, host, *next(arrays))
            for inputs, host in zip(chunks, hosts, strict=True)
        ]

    def _check_sizes(
        self, chunks: Sequence[ChunkInputs], hosts: Sequence[ChunkHostPart | None], omit_token_to_seq: bool
    ) -> int:
        """The response's size (an upper bound), after the limits on the workspace and max_message_bytes."""
        config = self.config
        response_bytes = _CHUNK_OVERHEAD_BYTES * len(chunks)
        for inputs, host in zip(chunks, hosts, strict=True):
            if host is None:
                continue
            workspace = prefill_workspace_size(config.max_model_len, host.ratio)
            if host.total > workspace:
                over = inputs.req_start + int(np.searchsorted(host.cu_seq_lens, workspace, side="right")) - 1
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{_at('seq_lens', over)}: the chunk's compressed tokens reach {host.total}, above the KV "
                    f"workspace of {workspace} (max_model_len {config.max_model_len} * 40 / compress ratio "
                    f"{host.ratio})",
                )
            a, b = host.query_slice
            response_bytes += 8 * (b - a) + 8 * host.cu_seq_lens.size + (0 if omit_token_to_seq else 4 * host.total)
        if response_bytes > config.max_message_bytes:
            advice = "send a smaller batch" if omit_token_to_seq else "set omit_token_to_seq or send a smaller batch"
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"response: about {response_bytes} bytes, above max_message_bytes {config.max_message_bytes}; {advice}",
            )
        return response_bytes

    def _observe_size(self, method: str, requests: int, tokens: int) -> None:
        self.metrics.child(self.metrics.request_batch_requests, method).observe(requests)
        self.metrics.child(self.metrics.request_query_tokens, method).observe(tokens)

    def _build_chunk_fast(self, data: bytes, caller: Caller) -> bytes | None:
        """The response from service/fastpath.c, or None where the request needs the general path (errors
        included: their messages are all the general path's; answers above the fast path's reserve; a budget
        too full to reserve it without waiting)."""
        ticket = self.admission.budget.try_reserve(caller.peer, self._fast_reserve)
        if ticket is None:
            return None
        try:
            served = self.backend.build_chunk_fast(data, self._fast_limits, self._admitted_ratios())
        except BaseException:
            ticket.release()
            raise
        if served is None:
            ticket.release()
            return None
        response, requests, tokens, seconds = served
        ticket.shrink(len(response))
        caller.ticket = ticket
        self.metrics.child(self.metrics.backend_duration_seconds, "BuildChunk", FAST_PATH_BACKEND).observe(seconds)
        self._observe_size("BuildChunk", requests, tokens)
        return response

    def _admitted_ratios(self) -> tuple[int, ...] | None:
        """Strict mode's admitted compress ratios for the fast path (None: any). Read once the warmup is over:
        the numpy backend compiles nothing after it, so the warmed set no longer changes."""
        if self._admit is None:
            return None
        if self._fast_admitted is None:
            self._fast_admitted = tuple(
                sorted({k.compress_ratio for k in self.warmup.compiled_keys() if k == CompileKey(k.compress_ratio)})
            )
        return self._fast_admitted

    def _build_chunk(self, request: pb.BuildChunkRequest) -> bytes:
        inputs = codec.chunk_inputs_from_proto(request)
        self._admit_request(inputs)
        (meta,) = self._build("BuildChunk", [inputs], request.omit_token_to_seq)
        if meta is None:
            self._observe_size("BuildChunk", inputs.req_end - inputs.req_start, 0)
        else:
            a, b = meta.query_slice
            self._observe_size("BuildChunk", meta.num_reqs, b - a)
        return codec.build_chunk_response_bytes(meta, request.omit_token_to_seq)

    def _plan_batch(self, request: pb.PlanBatchRequest) -> bytes:
        config = self.config
        batch = codec.batch_inputs_from_proto(request, config.max_model_len, config.max_logits_bytes)
        self._admit_request(batch)
        if batch.max_model_len > config.max_model_len:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"max_model_len: {batch.max_model_len}, above the server's max_model_len {config.max_model_len}",
            )
        try:
            chunks = plan_prefill_batch(batch, config.max_plan_chunks)
        except PlanTooLargeError:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"max_logits_bytes: {batch.max_logits_bytes} bytes of logits per chunk would split the batch into "
                f"more than max_plan_chunks {config.max_plan_chunks} chunks; raise max_logits_bytes or send fewer "
                "query tokens",
                "work_limit",
            ) from None
        built = self._build("PlanBatch", chunk_inputs_of_plan(batch, chunks), request.omit_token_to_seq)
        plan = PrefillPlan(chunks, [meta for meta in built if meta is not None], max_prefill_seq_len(batch))
        decodes = batch.num_decodes  # validated by the planner
        tokens = int(batch.query_start_loc[-1] - batch.query_start_loc[decodes])
        self._observe_size("PlanBatch", batch.seq_lens.size - decodes, tokens)
        stop_if_abandoned()
        return codec.plan_response_bytes(plan, request.omit_token_to_seq)

    def _warmup_status(self, request: pb.GetWarmupStatusRequest) -> bytes:
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
            auto_crossover_elements=self.backend.selector.crossover if self.backend.selector else 0,
        ).SerializeToString()
