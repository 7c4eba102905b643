"""The one request path behind every transport (KServe's "data plane"). The gRPC servicer and the HTTP app
only decode and encode around :meth:`DataPlane.call`; each part of the path lives in its own place:

- which RPCs exist and their message types: service/rpcs.py;
- whether the server takes calls: service/compute/readiness.py;
- what one request may ask for (limits, policy): service/overload/limits.py;
- what the server lets in under load (response budget, heavy lane): service/overload/admission.py;
- what computes the arrays (numpy, the C fast path, Triton, auto): service/compute/backends.py;
- how a call fails: service/errors.py. Every failure leaves :meth:`DataPlane.call` as one of its
  :class:`~service.errors.ServiceError` kinds, so each transport maps one type once and the metrics see the code
  the caller does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar

from google.protobuf.message import Message

from indexer_service.kernels.inputs import (
    ChunkInputs,
    ChunkMetadata,
    InvalidInputError,
    ValidBatch,
    assemble,
    chunk_host_parts,
)
from indexer_service.kernels.planner import (
    PlanTooLargeError,
    PrefillPlan,
    chunk_inputs_of_plan,
    max_prefill_seq_len,
    plan_prefill_batch,
)
from indexer_service.kernels.specialization import CompileKey
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import adapters, codec
from indexer_service.service.compute.backends import FAST_PATH_BACKEND, Backend
from indexer_service.service.compute.readiness import Readiness
from indexer_service.service.compute.warmup import KeyState, Warmup, WarmupState
from indexer_service.service.config import ServiceConfig
from indexer_service.service.errors import (
    CallerGone,
    Code,
    InternalError,
    InvalidArgument,
    NotReady,
    OutOfMemory,
    ServiceError,
    Shed,
)
from indexer_service.service.observability.logs import FailedCallLog, RateLimitedLog
from indexer_service.service.observability.metrics import UNKNOWN_METHOD, Metrics
from indexer_service.service.observability.tracing import RpcTracer
from indexer_service.service.observability.version import version_line
from indexer_service.service.overload.admission import (
    SHED_LOG_INTERVAL_SECONDS,
    Admission,
    Caller,
    Refused,
    default_response_budget,
)
from indexer_service.service.overload.books import NOT_COMPILED, load_compiled
from indexer_service.service.overload.limits import RequestLimits, fast_path_limits
from indexer_service.service.process.cgroups import memory_limit
from indexer_service.service.reasons import Port, ShedReason
from indexer_service.service.rpcs import RPCS, parse_request

log = logging.getLogger(__name__)

# Kernel variants indexer_warmup_misses_total names one by one; any further one is "other".
MAX_MISSED_VARIANTS = 32

# What a planned chunk costs besides its bytes, in bytes of response: each is a few Python objects and a
# backend call, as costly as this many bytes of arrays (docs/performance.md), which is what makes tiny-budget plans
# expensive.
CHUNK_COST_BYTES = 64 * 2**10


# The current call, set by DataPlane.call for the call's duration, on its thread: the admission steps deep in a
# handler (the planner's chunk count, the fast path's answer size) find their caller here.
_CALL: ContextVar[Caller | None] = ContextVar("call", default=None)


def _as_error(refused: Refused, caller: Caller, hint: str = "") -> ServiceError:
    """An admission refusal as the data plane's error: Shed (its message ending in ``hint``), or CallerGone when the
    caller left while waiting. Called in an ``except``: a context manager around every call's budget reservation
    cost an object and two method calls each time, a ``try`` nothing until something is refused."""
    if refused.gone:
        return CallerGone(caller.gone() or Code.CANCELLED, refused.message, refused.reason)
    return Shed(refused.reason, refused.message + hint)


def as_service_error(method: str, exc: Exception) -> ServiceError:
    """``exc`` as the failure the caller sees: a :class:`ServiceError` as it is, the kernel layer's invalid input
    as InvalidArgument, running out of memory as OutOfMemory, anything else as InternalError (logged)."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, InvalidInputError):
        return InvalidArgument(str(exc))
    if isinstance(exc, MemoryError):  # the backend ran out of host or GPU memory; the next request may fit
        log.warning("out of memory method=%s: %s", method, exc)
        return OutOfMemory(f"out of memory: {exc}")
    log.exception("internal error method=%s", method)
    return InternalError(f"internal error ({type(exc).__name__}); see the server log")


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
    """Serves the RPCs of ``indexer.v1.PrefillMetadata`` whatever the transport. ``admit_launch``: strict mode's
    launch admission, the backend's own (limits.strict_admission; None: any kernel variant may compile). The
    transports also share its log of failed calls and its tracer (None: tracing off)."""

    def __init__(
        self,
        config: ServiceConfig,
        metrics: Metrics,
        warmup: Warmup,
        backend: Backend,
        admit_launch: Callable[[CompileKey], None] | None,
        tracer: RpcTracer | None = None,
    ) -> None:
        self.config = config
        self.tracer = tracer
        self.failed_calls = FailedCallLog()
        self.metrics = metrics
        self.warmup = warmup
        self.backend = backend
        self.readiness = Readiness(warmup, metrics, backend.name)
        self.limits = RequestLimits(config, admit_launch, frozenset(warmup.model_keys), self._warmup_miss)
        self._missed: set[str] = set()  # the variants named in indexer_warmup_misses_total so far
        self._miss_log = RateLimitedLog(log, SHED_LOG_INTERVAL_SECONDS)
        budget = config.response_budget_bytes or default_response_budget(memory_limit())
        # Waiters hold a gRPC thread each: at most a quarter of the pool waits, so with the heavy lane's own
        # slots at least half of it is always free for light calls (half is too many: docs/performance.md).
        self.admission = Admission(
            budget,
            config.heavy_request_bytes,
            config.heavy_lane_slots,
            config.admission_wait_seconds,
            max_waiting=config.grpc_workers // 4,
            metrics=metrics,
        )
        self._warmed = False  # warmup.finished_ok, read until it is True, then a flag (docs/performance.md)
        self._fast_limits = fast_path_limits(config)
        # The ratios the fast path serves: the warmup set's (strict mode: the warmed ones, known once the warmup is
        # over); any other goes the general way, where it is counted as a warmup miss.
        self._fast_admitted: tuple[int, ...] | None = None
        self._fast_admitted_known = False
        # Set when the shutdown grace ends: calls still running were cut by the shutdown, not by their callers.
        self.shutdown_cut = threading.Event()
        self.last_call_end = time.monotonic()
        # Every shed series exists from the start at 0, so rate() and alerts see the first shed call.
        for method in RPCS:
            for reason in ShedReason:
                metrics.child(metrics.requests_shed_total, method, reason)
        # Each method's in-flight gauge and OK-duration histogram, resolved once: every call touches both.
        self._call_metrics = {
            method: (
                metrics.child(metrics.requests_in_flight, method),
                metrics.child(metrics.request_duration_seconds, method, Code.OK.name),
            )
            for method in RPCS
        }
        # The compiled fast path (None: the backend has none) and the observe of each histogram a call it served
        # records into (only with a fast path: its backend series exists only where one can serve).
        self._build_chunk_fast = backend.build_chunk_fast
        compiled_books = load_compiled()
        if compiled_books is None:
            log.warning(NOT_COMPILED)
        if self._build_chunk_fast is not None:
            # The fast path's admit: the common call's in one compiled call (service/overload/budget.c), any other's
            # _admit_work; _admit_work itself where the books are not compiled. Made once, not per call.
            self._admit_fast = (
                self._admit_work
                if compiled_books is None
                else compiled_books.FastAdmit(
                    _CALL,
                    self.admission.heavy_request_bytes,
                    CHUNK_COST_BYTES,
                    self.admission.budget.books,
                    self._admit_work,
                    self._stop_if_abandoned,
                )
            )
            self._fast_call_observes = tuple(
                child.observe
                for child in (
                    self._call_metrics["BuildChunk"][1],
                    metrics.child(metrics.backend_duration_seconds, "BuildChunk", FAST_PATH_BACKEND),
                    metrics.child(metrics.request_batch_requests, "BuildChunk"),
                    metrics.child(metrics.request_query_tokens, "BuildChunk"),
                )
            )
        self._handlers: dict[str, Callable[[Message], bytes]] = {
            "BuildChunk": self._build_chunk,
            "PlanBatch": self._plan_batch,
            "GetWarmupStatus": self._warmup_status,
        }

    def call(self, method: str, request: object, where: str = "request", caller: Caller | None = None) -> bytes:
        """Serve one RPC: the response message's wire bytes, which both transports send as they are; raises
        only :class:`ServiceError`. ``request`` is a message, or its serialized bytes (undecodable bytes are
        INVALID_ARGUMENT naming ``where``). ``caller`` is the transport's view of the call (see
        :class:`~service.overload.admission.Caller`): a build checks ``caller.gone()`` between its phases and stops, and
        on success ``caller.ticket`` holds the answer's bytes in the response budget until the transport
        releases it. Without a caller the ticket is released on return.

        One frame for the whole call around the handler, the compiled fast path's included (no ExitStack, no
        per-call state object besides the caller): a Python call on this path costs several times more server CPU
        under load than in a loop (docs/performance.md)."""
        in_flight, served_ok = self._call_metrics[method]
        in_flight.inc()
        start = time.perf_counter()
        failed: Code | None = None  # the failed call's code (None, not Code.OK: no enum read, docs/performance.md)
        fast = None  # the fast path's (answer, requests, query tokens, seconds), once it has answered
        local = caller is None
        if local:
            caller = Caller()
        token = _CALL.set(caller)
        try:
            if RPCS[method].needs_ready and not self._warmed:
                # Gated on the warmup, not on readiness: while draining, calls already on their way still get
                # answered (gRPC itself refuses new ones once the server stops).
                if not self.warmup.finished_ok:
                    raise NotReady(f"not ready: {self.readiness.not_ready_reason()}")
                self._warmed = True  # for good: a warmup that finished well never runs again
            if self._build_chunk_fast is not None and method == "BuildChunk" and isinstance(request, bytes):
                # service/compute/fastpath.c's answer; admission by _admit_fast (the general path's rules)
                ratios = self._fast_admitted if self._fast_admitted_known else self._admitted_ratios()
                fast = self._build_chunk_fast(request, self._fast_limits, ratios, self._admit_fast)
            if fast is not None:  # else the request needs the general path (errors included)
                answer = fast[0]
            else:
                parsed = parse_request(method, request, where) if isinstance(request, bytes) else request
                answer = self._handlers[method](parsed)
            ticket = caller.ticket
            if ticket is not None and ticket.nbytes > len(answer) * caller.held_per_answer_byte:
                # smaller than reserved (the general path reserves an estimate); protobuf's held bytes written out
                held = len(answer) if caller.held_per_answer_byte == 1.0 else caller.held_bytes(len(answer))
                ticket.budget.give_back(ticket, held)
            return answer
        except Exception as exc:
            error = as_service_error(method, exc)
            failed = error.code
            if error.shed_reason is not None:
                self.admission.shed.record(method, error.shed_reason, error.message, caller.port)
            if error is exc:
                raise
            raise error from exc
        finally:
            _CALL.reset(token)
            if caller.in_heavy_lane:
                caller.in_heavy_lane = False
                self.admission.lane.release()
            if caller.ticket is not None and (local or failed is not None):
                caller.ticket.release()
            duration = time.perf_counter() - start
            if failed is not None:
                self.metrics.child(self.metrics.request_duration_seconds, method, failed.name).observe(duration)
                self.metrics.child(self.metrics.request_errors_total, method, failed.name).inc()
            elif fast is not None:  # (nothing after the fast path's answer can fail)
                # four C calls in a single process (service/observability/threadmetrics.py), no Python frame
                observe_duration, observe_backend, observe_requests, observe_tokens = self._fast_call_observes
                observe_duration(duration)
                observe_backend(fast[3])
                observe_requests(fast[1])
                observe_tokens(fast[2])
            else:
                served_ok.observe(duration)
            in_flight.dec()
            self.last_call_end = time.monotonic()

    def unknown_method(self) -> None:
        """Count a call to a method the service does not have (the transport answers UNIMPLEMENTED)."""
        self.metrics.child(self.metrics.request_errors_total, UNKNOWN_METHOD, Code.UNIMPLEMENTED.name).inc()

    def shed(self, method: str, reason: ShedReason, detail: str, port: str = "") -> None:
        """Count and log a call the transport refused or cut before or after the data plane saw it, on ``port``
        (its name: the log has a line per reason and port)."""
        self.admission.shed.record(method, reason, detail, port)

    def shed_on(self, port: Port) -> Callable[[str, ShedReason, str], None]:
        """:meth:`shed` for the calls of ``port``: what a port's gate and servicers are given."""
        return self.admission.shed.on(port)

    def _stop_if_abandoned(self, caller: Caller | None) -> None:
        """Stop the call's work when its caller has cancelled or its deadline has passed (or the shutdown grace
        has ended and the server cancelled it): nobody would read the answer, and the thread is better spent on
        calls whose callers wait. ``caller`` None: a handler called outside DataPlane.call (tests)."""
        code = None if caller is None else caller.gone()
        if code is None:
            return
        if self.shutdown_cut.is_set():
            raise CallerGone(code, "the server shut down before the call finished; work stopped", ShedReason.SHUTDOWN)
        raise CallerGone(code, "the caller went away (cancelled or past its deadline); work stopped")

    def _admit_heavy(self, caller: Caller, cost_bytes: int) -> None:
        """Take a heavy-lane slot, held until the call returns, when the work's estimated cost passes
        heavy_request_bytes (once per call: a plan asks as soon as its chunk count is known, before the
        per-chunk work, and again with its answer's size); or refuse."""
        if caller.in_heavy_lane or cost_bytes <= self.admission.heavy_request_bytes:
            return
        try:
            self.admission.lane.acquire(caller)
        except Refused as refused:
            raise _as_error(refused, caller) from None
        caller.in_heavy_lane = True

    def _admit_plan(self, num_chunks: int) -> None:
        """The chunk count is a plan's first known cost: a plan of many small chunks is heavy before its answer's
        size is (the per-chunk host work is most of such a call). Called by the planner before any chunk exists."""
        caller = _CALL.get()
        if caller is not None:
            self._admit_heavy(caller, CHUNK_COST_BYTES * num_chunks)

    def _admit_work(self, response_bytes: int, answer_bytes: int | None = None, num_chunks: int = 1) -> Caller | None:
        """The heavy lane when the work is heavy (by ``response_bytes``, the limits' estimate of the answer), then the
        answer's bytes in the response budget until the transport releases them (``answer_bytes`` when its exact
        size is known, else the estimate, given back down to the answer's size once it is written), then a last
        look at the caller (a wait may have outlived it); or refuse (Shed, or CallerGone when the caller left). The
        call's caller, None outside DataPlane.call (a handler called by a test: nothing to hold). The compiled fast
        path's admission (``_admit_fast``: service/overload/budget.c's FastAdmit, or this itself) hands it every call
        it does not decide alone, with both sizes, once the request is known valid (one chunk): a large answer waits
        for its budget and the heavy lane like any other, and is then written without the GIL."""
        caller = _CALL.get()
        if caller is None:
            return None
        cost_bytes = response_bytes + CHUNK_COST_BYTES * num_chunks
        if cost_bytes > self.admission.heavy_request_bytes:  # tested here too: a light call makes no call
            self._admit_heavy(caller, cost_bytes)
        if answer_bytes is not None:
            response_bytes = answer_bytes
        held = response_bytes if caller.held_per_answer_byte == 1.0 else caller.held_bytes(response_bytes)
        try:
            caller.ticket = self.admission.budget.reserve(caller.peer, held, caller)
        except Refused as refused:
            hint = (
                f" (a JSON answer holds {caller.held_per_answer_byte:g}x its {response_bytes} protobuf bytes while it "
                "is encoded: send application/x-protobuf)"
                if held != response_bytes
                else ""
            )
            raise _as_error(refused, caller, hint) from None
        if caller.gone() is not None:
            self._stop_if_abandoned(caller)
        return caller

    def _build(
        self, method: str, chunks: Sequence[ChunkInputs], valid: ValidBatch, omit_token_to_seq: bool
    ) -> list[ChunkMetadata | None]:
        """Every chunk's metadata (None where it has no compressed token) after the limits on the workspace
        and the response size, checked on the host parts before any array is computed."""
        hosts = chunk_host_parts(chunks, valid)
        response_bytes = self.limits.check_sizes(chunks, hosts, omit_token_to_seq)
        caller = self._admit_work(response_bytes, num_chunks=len(chunks))
        present = [host for host in hosts if host is not None]
        backend = self.backend.for_request(present, not omit_token_to_seq)
        start = time.perf_counter()
        arrays = iter(backend.arrays_many(present, chunks[0].dcp, not omit_token_to_seq) if present else [])
        self.metrics.child(self.metrics.backend_duration_seconds, method, backend.name).observe(
            time.perf_counter() - start
        )
        self._stop_if_abandoned(caller)
        return [
            None if host is None else assemble(inputs, host, *next(arrays))
            for inputs, host in zip(chunks, hosts, strict=True)
        ]

    def _observe_size(self, method: str, requests: int, tokens: int) -> None:
        self.metrics.child(self.metrics.request_batch_requests, method).observe(requests)
        self.metrics.child(self.metrics.request_query_tokens, method).observe(tokens)

    def _admitted_ratios(self) -> tuple[int, ...] | None:
        """The compress ratios the fast path serves: the model's warmup set's, or in strict mode the warmed ones.
        Read once the warmup is over (the fast path serves only then): the numpy backend compiles nothing after it,
        so the warmed set no longer changes."""
        if not self._fast_admitted_known:
            keys = self.warmup.compiled_keys() if self.limits.admit_launch is not None else self.warmup.model_keys
            # The keys a fast-path request can need: the service's own (aligned buffers, int32 scalars).
            launchable = {k.compress_ratio for k in keys if k == CompileKey(k.compress_ratio)}
            self._fast_admitted = tuple(sorted(launchable))
            self._fast_admitted_known = True
        return self._fast_admitted

    def _warmup_miss(self, key: CompileKey) -> None:
        """A request whose kernel variant is outside the model's warmup set: counted by variant (the first
        ``MAX_MISSED_VARIANTS`` by name, any later as "other": callers choose the ratio) and logged rate-limited,
        on every backend, so a model config that would compile after ready on a GPU replica shows on a CPU one."""
        label = key.label()
        if label not in self._missed:
            if len(self._missed) >= MAX_MISSED_VARIANTS:
                label = "other"
            else:
                self._missed.add(label)
        self.metrics.child(self.metrics.warmup_misses_total, label).inc()
        self._miss_log.note(
            "warmup_miss",
            label,
            "a GPU replica would compile this kernel variant after ready: fix the model config or the warmup set",
        )

    def _build_chunk(self, request: pb.BuildChunkRequest) -> bytes:
        inputs = codec.chunk_inputs_from_proto(request)
        valid = self.limits.check_request(inputs)
        (meta,) = self._build("BuildChunk", [inputs], valid, request.omit_token_to_seq)
        if meta is None:
            self._observe_size("BuildChunk", inputs.req_end - inputs.req_start, 0)
        else:
            a, b = meta.query_slice
            self._observe_size("BuildChunk", meta.num_reqs, b - a)
        return codec.build_chunk_response_bytes(meta, request.omit_token_to_seq)

    def _plan_batch(self, request: pb.PlanBatchRequest) -> bytes:
        config = self.config
        batch = codec.batch_inputs_from_proto(request, config.max_model_len, config.max_logits_bytes)
        valid = self.limits.check_request(batch)
        self.limits.check_plan_model_len(batch)
        try:
            chunks = plan_prefill_batch(batch, config.max_plan_chunks, valid, self._admit_plan)
        except PlanTooLargeError:
            raise Shed(
                ShedReason.WORK_LIMIT,
                f"max_logits_bytes: {batch.max_logits_bytes} bytes of logits per chunk would split the batch into "
                f"more than max_plan_chunks {config.max_plan_chunks} chunks; raise max_logits_bytes or send fewer "
                "query tokens",
            ) from None
        built = self._build("PlanBatch", chunk_inputs_of_plan(batch, chunks), valid, request.omit_token_to_seq)
        plan = PrefillPlan(chunks, [meta for meta in built if meta is not None], max_prefill_seq_len(batch))
        decodes = batch.num_decodes  # validated by the planner
        tokens = int(batch.query_start_loc[-1] - batch.query_start_loc[decodes])
        self._observe_size("PlanBatch", batch.seq_lens.size - decodes, tokens)
        self._stop_if_abandoned(_CALL.get())
        return codec.plan_response_bytes(plan, request.omit_token_to_seq)

    def _warmup_status(self, request: pb.GetWarmupStatusRequest) -> bytes:
        warmup = self.warmup
        return pb.GetWarmupStatusResponse(
            state=_WARMUP_STATES[warmup.state],
            backend=self.backend.name,
            target=warmup.target_name,
            strict=self.config.strict,
            keys=[
                pb.KeyStatus(
                    label=p.key.label(),
                    key_json=p.key.to_json(),
                    # Warmed alike inside (COMPILED); on the wire, where the key came from.
                    state=pb.KEY_STATE_CACHED if p.cached else _KEY_STATES[p.state],
                    compile_seconds=p.seconds,
                    error=p.error,
                )
                for p in warmup.progress()
            ],
            warmup_seconds=warmup.seconds,
            compiles_after_ready=self.readiness.compiles_after_ready,
            ready=self.readiness.ready,
            auto_crossover_elements=self.backend.selector.crossover if self.backend.selector else 0,
            server_version=version_line(),
            dependency_fallbacks=[
                pb.DependencyFallback(library=f.library, feature=f.feature, detail=f.describe())
                for f in adapters.taken()
            ],
        ).SerializeToString()
