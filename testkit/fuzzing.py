"""Random requests, valid and invalid, and the oracle that judges every answer the server gives to one.

The generator takes its randomness from a ``Draw`` (an integer in ``[lo, hi]``), so the same code feeds
hypothesis (``data.draw(st.integers(lo, hi))``, which then shrinks failures to small requests), a numpy
generator (the 100k-request fuzz of ``benchmarks/soak.py``) and atheris' byte stream.

The oracle (:func:`judge`) decides from the request alone what a correct server may answer:
- the kernel layer's numpy result, field by field, when the request is valid and within the server's limits;
- otherwise one of the codes that the request's defects justify: INVALID_ARGUMENT (bad bytes or fields),
  RESOURCE_EXHAUSTED (over a configured limit, the KV workspace or the message size), FAILED_PRECONDITION
  (DCP with compression). A request with several defects may be refused for any of them.
Every refusal must name a request field (``seq_lens[3]: ...``). INTERNAL and UNKNOWN are never right.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import grpc
import numpy as np

from indexer_service.kernels.inputs import (
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    InvalidInputError,
    assemble,
    chunk_host_part,
    chunk_host_parts,
    validate_batch,
    validate_dcp,
)
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy
from indexer_service.kernels.planner import (
    WORKSPACE_TOKENS_PER_MODEL_LEN,
    BatchInputs,
    PlanTooLargeError,
    PrefillPlan,
    build_prefill_batch,
    chunk_inputs_of_plan,
    plan_prefill_batch,
)
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import rpcs

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
# What a refusal may name besides the request's own fields: the response it would have sent.
EXTRA_FIELDS = frozenset({"response"})
FIELD_ERROR = re.compile(r"^(?P<field>[a-z_]+)(?:\[\d+\])?: \S")
# The dataplane's allowance per chunk for everything but the arrays (tags, scalars, the ChunkSpec).
CHUNK_OVERHEAD_BYTES = 512

T = TypeVar("T")


class Draw(Protocol):
    def __call__(self, lo: int, hi: int) -> int: ...


def rng_draw(rng: np.random.Generator) -> Draw:
    return lambda lo, hi: int(rng.integers(lo, hi, endpoint=True))


def pick(draw: Draw, options: Sequence[T]) -> T:
    """One of ``options``; shrinks towards the first."""
    return options[draw(0, len(options) - 1)]


def chance(draw: Draw, percent: int) -> bool:
    """True with probability ``percent``/100; shrinks towards False (the plain request)."""
    return draw(0, 99) >= 100 - percent


@dataclass(frozen=True)
class Limits:
    """The limits the server under test was started with; the oracle's view of the configuration."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 200_000
    max_message_bytes: int = 2**20
    max_logits_bytes: int = 2**20
    max_plan_chunks: int = 1024

    def flags(self) -> tuple[str, ...]:
        return (
            f"--max-num-seqs={self.max_num_seqs}",
            f"--max-num-batched-tokens={self.max_num_batched_tokens}",
            f"--max-model-len={self.max_model_len}",
            f"--max-message-bytes={self.max_message_bytes}",
            f"--max-logits-bytes={self.max_logits_bytes}",
            f"--max-plan-chunks={self.max_plan_chunks}",
        )


# Small enough that the fuzz reaches every limit with small requests.
FUZZ_LIMITS = Limits()

# --- generation ---------------------------------------------------------------------------------------------


def _batch(draw: Draw, limits: Limits) -> tuple[np.ndarray, np.ndarray]:
    """A valid batch (int64 ``query_start_loc``, ``seq_lens``), now and then at or just over a limit."""
    size = pick(draw, (3, 1, 0, 8, 12, limits.max_num_seqs, limits.max_num_seqs + 1))
    long_queries = chance(draw, 10)
    long_contexts = chance(draw, 10)
    query_cap = limits.max_num_batched_tokens // max(size, 1) + 2 if long_queries else 40
    context_cap = limits.max_model_len if long_contexts else 3000
    query = [draw(0, query_cap) for _ in range(size)]
    context = [draw(0, context_cap) for _ in range(size)]
    qsl = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(query, out=qsl[1:])
    return qsl, np.asarray(query, dtype=np.int64) + np.asarray(context, dtype=np.int64)


def _mutate(draw: Draw, qsl: np.ndarray, seq: np.ndarray) -> tuple[bytes, bytes]:
    """Up to two defects in the arrays, then their wire bytes (some with a ragged length)."""
    qsl, seq = qsl.copy(), seq.copy()
    qsl_tail = seq_tail = b""
    for _ in range(draw(1, 2) if chance(draw, 25) else 0):
        kind = draw(0, 10)
        if kind == 0 and qsl.size:
            qsl[0] = pick(draw, (1, -1, INT32_MAX))
        elif kind == 1 and qsl.size > 1:
            i = draw(1, qsl.size - 1)
            qsl[i] = qsl[i - 1] - draw(1, 5)
        elif kind == 2 and seq.size:
            seq[draw(0, seq.size - 1)] = pick(draw, (-1, INT32_MIN, -draw(1, 1000)))
        elif kind == 3 and min(seq.size, qsl.size - 1) > 0:
            i = draw(0, min(seq.size, qsl.size - 1) - 1)
            seq[i] = max(0, int(qsl[i + 1] - qsl[i]) - draw(1, 3))
        elif kind == 4 and seq.size:
            seq[draw(0, seq.size - 1)] = pick(draw, (INT32_MAX, 2**30, 2**24))
        elif kind == 5 and qsl.size > 1:
            qsl[draw(1, qsl.size - 1) :] = pick(draw, (INT32_MAX, 2**30))
        elif kind == 6:
            seq = seq[:-1] if seq.size and chance(draw, 50) else np.append(seq, draw(0, 100))
        elif kind == 7:
            qsl = qsl[:0]
        elif kind == 8:
            qsl_tail = b"\x00" * draw(1, 3)
        elif kind == 9:
            seq_tail = b"\x01" * draw(1, 3)
        elif kind == 10 and qsl.size > 2:
            qsl = qsl[:-1]
    return qsl.astype("<i4").tobytes() + qsl_tail, seq.astype("<i4").tobytes() + seq_tail


def _ratio(draw: Draw) -> int:
    if chance(draw, 6):
        return pick(draw, (-1, INT32_MIN))
    return pick(draw, (4, 1, 0, 128, 2, 3, 7, INT32_MAX))


def _dcp(draw: Draw, request: pb.BuildChunkRequest | pb.PlanBatchRequest) -> None:
    if not chance(draw, 30):
        return
    world = pick(draw, (2, 4, 1, 8, 64, 0, -1, 65_536, 65_537, INT32_MAX))
    request.dcp_world_size = world
    request.dcp_rank = draw(0, world - 1) if world > 0 and not chance(draw, 15) else pick(draw, (world, -1, 1))
    if chance(draw, 60):
        request.dcp_interleave = pick(draw, (1, 2, 4, 64, 2**16, 0, -3, INT32_MAX))


def _int32(draw: Draw, valid_lo: int, valid_hi: int) -> int:
    """Mostly in ``[valid_lo, valid_hi]``, sometimes just outside it or at an int32 extreme."""
    if not chance(draw, 6) and valid_lo <= valid_hi:
        return draw(valid_lo, valid_hi)
    return pick(draw, (valid_hi + 1, valid_lo - 1, -1, INT32_MAX, INT32_MIN))


def chunk_request(draw: Draw, limits: Limits = FUZZ_LIMITS) -> pb.BuildChunkRequest:
    """A BuildChunkRequest: a random batch and chunk, most of them valid, the rest with one or more defects."""
    qsl, seq = _batch(draw, limits)
    request = pb.BuildChunkRequest(
        compress_ratio=_ratio(draw), skip_kv_gather=chance(draw, 20), omit_token_to_seq=chance(draw, 30)
    )
    size = seq.size
    start = _int32(draw, 0, size)
    end = _int32(draw, start, size) if 0 <= start <= size else _int32(draw, 0, size)
    request.req_start, request.req_end = start, end
    if chance(draw, 40):
        rows = int(qsl[end] - qsl[start]) if 0 <= start <= end <= size else 0
        a = _int32(draw, 0, rows)
        request.query_slice.start, request.query_slice.stop = a, _int32(draw, max(a, 0), rows)
    _dcp(draw, request)
    request.query_start_loc, request.seq_lens = _mutate(draw, qsl, seq)
    return request


def plan_request(draw: Draw, limits: Limits = FUZZ_LIMITS) -> pb.PlanBatchRequest:
    """A PlanBatchRequest; small logits budgets make plans of many chunks, some of one query row each."""
    qsl, seq = _batch(draw, limits)
    request = pb.PlanBatchRequest(
        compress_ratio=_ratio(draw), omit_token_to_seq=chance(draw, 30), num_decodes=_int32(draw, 0, seq.size)
    )
    if chance(draw, 50):
        bad = chance(draw, 10)
        request.max_model_len = pick(
            draw, (limits.max_model_len + 1, 0, -5, 2**40) if bad else (5000, 64, limits.max_model_len)
        )
    if chance(draw, 50):
        bad = chance(draw, 10)
        request.max_logits_bytes = pick(draw, (3, 0, -4) if bad else (4000, 4, 400, 40_000, 2**40))
    _dcp(draw, request)
    request.query_start_loc, request.seq_lens = _mutate(draw, qsl, seq)
    return request


REQUESTS: dict[str, Callable[[Draw, Limits], pb.BuildChunkRequest | pb.PlanBatchRequest]] = {
    "BuildChunk": chunk_request,
    "PlanBatch": plan_request,
}
# The fuzzed methods' message types, as the service maps them.
REQUEST_TYPES = {method: rpcs.REQUEST_TYPES[method] for method in REQUESTS}
RESPONSE_TYPES = {method: rpcs.RESPONSE_TYPES[method] for method in REQUESTS}
FIELDS = {m: frozenset(t.DESCRIPTOR.fields_by_name) | EXTRA_FIELDS for m, t in REQUEST_TYPES.items()}

# --- the oracle ---------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What a correct server may answer; :meth:`expected` computes numpy's result (once) when OK is allowed."""

    method: str
    must_refuse: frozenset[grpc.StatusCode]  # non-empty: OK is wrong, one of these is right
    may_refuse: frozenset[grpc.StatusCode]  # refusals allowed besides OK (conservative size estimates)
    reasons: tuple[str, ...]
    chunks: int = 1  # chunks the server plans for it: its work grows with this
    build: Callable[[], ChunkMetadata | PrefillPlan | None] | None = None
    _expected: list = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.must_refuse

    def expected(self) -> ChunkMetadata | PrefillPlan | None:
        if not self._expected:
            assert self.build is not None, "no expected result for a request that must be refused"
            self._expected.append(self.build())
        return self._expected[0]


def _decode(data: bytes) -> np.ndarray | None:
    return None if len(data) % 4 else np.frombuffer(data, dtype="<i4").astype(np.int64)


def _dcp_of(request: pb.BuildChunkRequest | pb.PlanBatchRequest) -> DcpConfig:
    return DcpConfig(
        rank=request.dcp_rank,
        world_size=request.dcp_world_size if request.HasField("dcp_world_size") else 1,
        interleave=request.dcp_interleave if request.HasField("dcp_interleave") else 1,
    )


def _plan_scalars_invalid(request: pb.PlanBatchRequest, qsl: np.ndarray, seq: np.ndarray) -> bool:
    """Whether the kernel layer would reject a PlanBatch request; for requests too large to plan here."""
    try:
        validate_batch(qsl, seq)
    except InvalidInputError:
        return True
    return (
        request.compress_ratio < 0
        or not 0 <= request.num_decodes <= seq.size
        or (request.HasField("max_model_len") and request.max_model_len < 1)
        or (request.HasField("max_logits_bytes") and request.max_logits_bytes < 4)
    )


def judge(method: str, request: pb.BuildChunkRequest | pb.PlanBatchRequest, limits: Limits) -> Verdict:
    """Everything a correct server may answer to ``request`` (a BuildChunk or PlanBatch request)."""
    must: dict[grpc.StatusCode, list[str]] = {}
    may: dict[grpc.StatusCode, list[str]] = {}

    def refuse(into: dict, code: grpc.StatusCode, why: str) -> None:
        into.setdefault(code, []).append(why)

    def verdict(**extra: object) -> Verdict:
        reasons = tuple(f"{c.name}: {w}" for d in (must, may) for c, ws in d.items() for w in ws)
        return Verdict(method, frozenset(must), frozenset(may), reasons, **extra)

    dcp = _dcp_of(request)
    qsl, seq = _decode(request.query_start_loc), _decode(request.seq_lens)
    if qsl is None or seq is None:
        refuse(must, INVALID, "an array's byte length is not a multiple of 4")
        return verdict()
    if seq.size > limits.max_num_seqs:
        refuse(must, EXHAUSTED, f"{seq.size} sequences")
    if qsl.size and qsl.max() > limits.max_num_batched_tokens:
        refuse(must, EXHAUSTED, "query tokens over max_num_batched_tokens")
    if seq.size and seq.max() > limits.max_model_len:
        refuse(must, EXHAUSTED, "a sequence over max_model_len")
    over_limits = bool(must)
    ratio = request.compress_ratio
    if ratio < 0:
        refuse(must, INVALID, "negative compress_ratio")
    try:  # the DCP settings are checked for every request, before limits and policy, chunks or none
        validate_dcp(dcp)
    except InvalidInputError as exc:
        refuse(must, INVALID, str(exc))
    if dcp.world_size > 1 and ratio > 1:
        refuse(must, PRECONDITION, "DCP with compress ratio > 1")
    if method == "PlanBatch" and request.HasField("max_model_len") and request.max_model_len > limits.max_model_len:
        refuse(must, EXHAUSTED, "max_model_len over the server's")
    if over_limits and method == "PlanBatch":
        # Its plan can hold a chunk per query row of a 2^30-token request: only validate.
        if _plan_scalars_invalid(request, qsl, seq):
            refuse(must, INVALID, "the kernel layer rejects the batch")
        return verdict()

    omit = request.omit_token_to_seq

    def build_numpy(inputs: ChunkInputs) -> ChunkMetadata | None:
        # numpy's result without the token_to_seq the answer leaves out: the oracle's memory stays that of
        # the answer, however many long chunks a plan has.
        host = chunk_host_part(inputs)
        if host is None:
            return None
        return assemble(inputs, host, *chunk_arrays_numpy(host, inputs.dcp, with_token_to_seq=not omit))

    # First the host parts only (validation, sizes): no array of a chunk's length exists yet.
    chunks: list[ChunkInputs] = []
    try:
        if method == "BuildChunk":
            slice_ = (request.query_slice.start, request.query_slice.stop) if request.HasField("query_slice") else None
            chunks = [
                ChunkInputs(qsl, seq, ratio, request.req_start, request.req_end, slice_, request.skip_kv_gather, dcp)
            ]

            def build() -> ChunkMetadata | None:
                return build_numpy(chunks[0])

        else:
            batch = BatchInputs(
                qsl,
                seq,
                ratio,
                request.num_decodes,
                request.max_model_len if request.HasField("max_model_len") else limits.max_model_len,
                request.max_logits_bytes if request.HasField("max_logits_bytes") else limits.max_logits_bytes,
                dcp,
            )
            try:
                chunks = chunk_inputs_of_plan(batch, plan_prefill_batch(batch, limits.max_plan_chunks))
            except PlanTooLargeError:
                refuse(must, EXHAUSTED, "a plan over max_plan_chunks")
                return verdict(chunks=limits.max_plan_chunks)

            def build() -> PrefillPlan:
                return build_prefill_batch(batch, build_numpy)

        hosts = [host for host in chunk_host_parts(chunks) if host is not None]
    except InvalidInputError as exc:
        refuse(must, INVALID, str(exc))
        return verdict(chunks=max(1, len(chunks)))

    workspace = limits.max_model_len * WORKSPACE_TOKENS_PER_MODEL_LEN // max(1, ratio)
    if any(host.total > workspace for host in hosts):
        refuse(must, EXHAUSTED, f"a chunk with more compressed tokens than the workspace {workspace}")
    rows = sum(h.query_slice[1] - h.query_slice[0] for h in hosts)
    tokens = sum(h.total for h in hosts)
    array_bytes = 8 * rows + 8 * sum(h.cu_seq_lens.size for h in hosts) + (0 if omit else 4 * tokens)
    if array_bytes > limits.max_message_bytes:
        refuse(must, EXHAUSTED, f"response arrays alone take {array_bytes} bytes")
    elif array_bytes + CHUNK_OVERHEAD_BYTES * len(chunks) >= limits.max_message_bytes:
        refuse(may, EXHAUSTED, "response near max_message_bytes")
    if must or over_limits:
        return verdict(chunks=len(chunks))
    return verdict(chunks=len(chunks), build=build)


# --- checking an answer -------------------------------------------------------------------------------------


def _array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4")


def _compare_metadata(got: pb.ChunkMetadata, want: ChunkMetadata, omit: bool, where: str) -> list[str]:
    problems = []
    arrays = {
        "cu_seq_lens": want.cu_seq_lens,
        "cu_seqlen_ks": want.cu_seqlen_ks,
        "cu_seqlen_ke": want.cu_seqlen_ke,
        "local_cu_seq_lens": want.local_cu_seq_lens,
    }
    if omit:
        if got.token_to_seq or not got.token_to_seq_omitted:
            problems.append(f"{where}.token_to_seq: sent although omit_token_to_seq was set")
    else:
        arrays["token_to_seq"] = want.token_to_seq
    for name, values in arrays.items():
        if not np.array_equal(_array(getattr(got, name)), values):
            problems.append(f"{where}.{name}: {_array(getattr(got, name))[:8]}... != numpy's {values[:8]}...")
    scalars = {
        "total_seq_lens": want.total_seq_lens,
        "token_start": want.token_start,
        "token_end": want.token_end,
        "num_reqs": want.num_reqs,
        "skip_kv_gather": want.skip_kv_gather,
        "local_total_seq_lens": want.local_total_seq_lens,
        "max_local_total_seq_lens": want.max_local_total_seq_lens,
        "req_start": want.req_start,
        "req_end": want.req_end,
    }
    for name, value in scalars.items():
        if getattr(got, name) != value:
            problems.append(f"{where}.{name}: {getattr(got, name)} != numpy's {value}")
    if (got.query_slice.start, got.query_slice.stop) != tuple(want.query_slice):
        problems.append(f"{where}.query_slice: {got.query_slice} != numpy's {want.query_slice}")
    return problems


def _compare(verdict: Verdict, request, response) -> list[str]:
    omit = request.omit_token_to_seq
    expected = verdict.expected()
    if verdict.method == "BuildChunk":
        if expected is None:
            return ["metadata: sent for a chunk with no compressed token"] if response.HasField("metadata") else []
        if not response.HasField("metadata"):
            return ["metadata: missing"]
        return _compare_metadata(response.metadata, expected, omit, "metadata")
    plan: PrefillPlan = expected
    got_chunks = [(c.req_start, c.req_end, c.query_start, c.query_stop) for c in response.chunks]
    want_chunks = [(c.req_start, c.req_end, c.query_start, c.query_stop) for c in plan.chunks]
    problems = [] if got_chunks == want_chunks else [f"chunks: {got_chunks[:4]}... != numpy's {want_chunks[:4]}..."]
    if len(response.metadata) != len(plan.metadata):
        return [*problems, f"metadata: {len(response.metadata)} chunks, numpy has {len(plan.metadata)}"]
    for i, (got, want) in enumerate(zip(response.metadata, plan.metadata, strict=True)):
        problems += _compare_metadata(got, want, omit, f"metadata[{i}]")
    if response.max_prefill_seq_len != plan.max_prefill_seq_len:
        problems.append(f"max_prefill_seq_len: {response.max_prefill_seq_len} != {plan.max_prefill_seq_len}")
    return problems


def check_answer(verdict: Verdict, request, code: grpc.StatusCode, details: str, response=None) -> list[str]:
    """What is wrong with the server's answer (``code``, ``details``, ``response`` when OK); [] if right."""
    if code is OK:
        if not verdict.valid:
            return [f"answered OK where it must refuse ({'; '.join(verdict.reasons)})"]
        return _compare(verdict, request, response)
    allowed = verdict.must_refuse or verdict.may_refuse
    problems = []
    if code not in allowed:
        why = "; ".join(verdict.reasons) or "a valid request within every limit"
        problems.append(f"answered {code.name} ({details!r}) for {why}")
    match = FIELD_ERROR.match(details or "")
    if not match or match["field"] not in FIELDS[verdict.method]:
        problems.append(f"{code.name} message does not start with a request field: {details!r}")
    return problems


def describe(request) -> str:
    """A short, readable form of a request for failure messages."""
    qsl, seq = _decode(request.query_start_loc), _decode(request.seq_lens)
    fields = {f.name: v for f, v in request.ListFields() if f.name not in ("query_start_loc", "seq_lens")}
    return f"query_start_loc={_short(qsl, request.query_start_loc)} seq_lens={_short(seq, request.seq_lens)} {fields}"


def _short(values: np.ndarray | None, raw: bytes) -> str:
    if values is None:
        return f"<{len(raw)} bytes>"
    text = np.array2string(values[:12], separator=",")
    return text if values.size <= 12 else f"{text[:-1]},...] ({values.size})"


def call_and_check(
    stubs: dict[str, grpc.UnaryUnaryMultiCallable], method: str, request, verdict: Verdict, timeout: float = 30.0
) -> tuple[grpc.StatusCode, str]:
    """One RPC through ``stubs[method]`` and the check of its answer: (code, problems joined, "" if none)."""
    try:
        response = stubs[method](request, timeout=timeout)
        code, details = OK, ""
    except grpc.RpcError as exc:
        response, code, details = None, exc.code(), exc.details() or ""
    problems = check_answer(verdict, request, code, details, response)
    return code, "; ".join(problems)


def stubs_for(channel: grpc.Channel) -> dict[str, grpc.UnaryUnaryMultiCallable]:
    """The two fuzzed RPCs as plain callables (no retries: see ``harness.channel``)."""
    return {
        method: channel.unary_unary(
            f"/indexer.v1.PrefillMetadata/{method}",
            request_serializer=REQUEST_TYPES[method].SerializeToString,
            response_deserializer=RESPONSE_TYPES[method].FromString,
        )
        for method in REQUEST_TYPES
    }
