"""service/compute/fastpath.c against the Python request path it stands in for: where it answers, its bytes are the
general path's bytes (and its size figures the same); where the general path refuses, it steps aside (None);
and on the plain requests schedulers send, it does answer. Golden cases, hypothesis-generated requests valid
and not, raw byte mutations, wire encodings protobuf accepts but the fast path leaves alone, every limit and
check at its boundary and one past it, the generated wire contract, and (in the test build that
tests/service/test_compiled_sanitized.py makes) a size pass that disagrees with the write pass."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer_service.kernels.inputs import ChunkInputs, DcpConfig, chunk_host_parts
from indexer_service.kernels.specialization import CompileKey, warmup_keys
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import codec
from indexer_service.service.compute import _fastpath
from indexer_service.service.compute.backends import FAST_PATH_BACKEND, make_backend
from indexer_service.service.compute.warmup import Warmup, WarmupState
from indexer_service.service.config import ServiceConfig, load_config
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.errors import Code, ServiceError
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.overload.admission import Caller
from testkit.batches import BatchShape, random_chunk_inputs
from testkit.fuzzing import FUZZ_LIMITS, chunk_request, rng_draw
from testkit.paths import REPO
from testkit.payloads import big_answer_build_chunk
from testkit.planes import make_plane
from tests.conftest import examples
from tests.golden import GOLDEN, case_id, chunk_inputs, metadata_as_dict

# tests/service/test_compiled_sanitized.py runs fewer: under ASan every Python allocation is a guarded malloc.
FUZZ_EXAMPLES = int(os.environ.get("FASTPATH_FUZZ_EXAMPLES", examples(600)))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The fast path serves the warmup set's ratios (any other goes the general way, counted as a warmup miss): every
# ratio the tests below send is in this model's set.
FAST_RATIOS = (1, 2, 3, 4, 7, 128)
BASE = load_config({"warmup_target": "none", "compress_ratios": ",".join(map(str, FAST_RATIOS))}, env={})
LIMITED = dataclasses.replace(
    BASE,
    max_num_seqs=FUZZ_LIMITS.max_num_seqs,
    max_num_batched_tokens=FUZZ_LIMITS.max_num_batched_tokens,
    max_model_len=FUZZ_LIMITS.max_model_len,
    max_message_bytes=FUZZ_LIMITS.max_message_bytes,
)


class WarmedSet:
    """A finished warmup whose model set is ``ratios`` and that compiled exactly them (strict mode's admitted set)."""

    finished_ok = True
    state = WarmupState.READY

    def __init__(self, ratios: tuple[int, ...]) -> None:
        self._keys = frozenset(CompileKey(r) for r in ratios)
        self.model_keys = tuple(self._keys)

    def compiled_keys(self) -> frozenset[CompileKey]:
        return self._keys


class Paths:
    """One configuration served twice: with the fast path (as the server runs) and without it."""

    def __init__(self, config: ServiceConfig, strict_ratios: tuple[int, ...] | None = None) -> None:
        self.fast = self._plane(config, True, strict_ratios)
        self.general = self._plane(config, False, strict_ratios)

    @staticmethod
    def _plane(config: ServiceConfig, fast: bool, strict_ratios: tuple[int, ...] | None) -> DataPlane:
        metrics = Metrics()
        if strict_ratios is None:
            warmup = Warmup(warmup_keys(config.model), target=None, enabled=False, workers=1, metrics=metrics)
        else:  # the plane's launch admission: strict_admission of this config, as a server builds it
            config, warmup = dataclasses.replace(config, strict=True), WarmedSet(strict_ratios)
        plane = make_plane(config, native_fast_path=fast, metrics=metrics, warmup=warmup)
        plane.readiness.refresh()
        return plane

    def native(self, data: bytes) -> tuple[bytes, int, int, float] | None:
        """What service/compute/fastpath.c itself says of ``data``."""
        return _fastpath.build_chunk(data, self.fast._fast_limits, self.fast._admitted_ratios())

    def check(self, data: bytes) -> bool:
        """Asserts the fast path agrees with the general path on ``data``; True when it answered itself."""
        native = self.native(data)
        try:
            general = self.general.call("BuildChunk", data)
        except ServiceError as exc:
            assert native is None, f"the fast path answered where the general path says {exc.code.name}: {exc}"
            with pytest.raises(ServiceError) as through_fast:
                self.fast.call("BuildChunk", data)
            assert (through_fast.value.code, through_fast.value.message) == (exc.code, exc.message)
            return False
        assert self.fast.call("BuildChunk", data) == general
        if native is None:
            return False
        response, requests, tokens, seconds = native
        assert response == general
        message = pb.BuildChunkRequest.FromString(data)
        assert requests == message.req_end - message.req_start
        meta = pb.BuildChunkResponse.FromString(response).metadata
        assert tokens == meta.query_slice.stop - meta.query_slice.start
        assert seconds >= 0
        return True


@pytest.fixture(scope="module")
def paths() -> Paths:
    return Paths(BASE)


@pytest.fixture(scope="module")
def limited() -> Paths:
    return Paths(LIMITED)


def _wire(inputs: ChunkInputs, omit_token_to_seq: bool = False) -> bytes:
    return codec.chunk_inputs_to_proto(inputs, omit_token_to_seq).SerializeToString()


GOLDEN_CASES = GOLDEN["chunk_metadata"]


@pytest.mark.parametrize("case", [c for c in GOLDEN_CASES if "world" not in c["input"]], ids=case_id)
@pytest.mark.parametrize("omit", [False, True], ids=["with-token-to-seq", "omit-token-to-seq"])
def test_golden_cases_are_answered_with_the_general_paths_bytes(case: dict, omit: bool, paths: Paths) -> None:
    data = _wire(chunk_inputs(case), omit)
    assert paths.check(data)
    response = pb.BuildChunkResponse.FromString(paths.native(data)[0])
    if case["expected"] is None:
        assert not response.HasField("metadata")
        return
    got = metadata_as_dict(codec.metadata_from_proto(response.metadata))
    if omit:
        assert got.pop("token_to_seq") is None
    assert got == {k: case["expected"][k] for k in got}


@pytest.mark.parametrize("case", [c for c in GOLDEN_CASES if "world" in c["input"]], ids=case_id)
def test_dcp_goes_the_general_way(case: dict, paths: Paths) -> None:
    assert not paths.check(_wire(chunk_inputs(case)))


@pytest.mark.parametrize("ratio", [0, 1, 2, 3, 4, 7, 128])
@pytest.mark.parametrize(
    "shape",
    [BatchShape(1, 5, 20), BatchShape(8, 40, 3000), BatchShape(64, 200, 9000, zero_query_share=0.3)],
    ids=["one-request", "small", "medium-many-empty-queries"],
)
def test_random_valid_chunks_are_served_by_the_fast_path(ratio: int, shape: BatchShape, paths: Paths) -> None:
    rng = np.random.default_rng(ratio * 1000 + shape.num_requests)
    answered = 0
    for _ in range(20):
        inputs = random_chunk_inputs(rng, shape, ratio)
        answered += paths.check(_wire(inputs, omit_token_to_seq=bool(rng.integers(2))))
    # Every chunk with a compressed token is a fast-path answer; the rest (total 0) are answered empty.
    assert answered == 20


def test_a_large_request_releases_the_gil_and_agrees(paths: Paths) -> None:
    """Above 65,536 elements the arrays are written without the GIL: the same bytes."""
    rng = np.random.default_rng(7)
    inputs = random_chunk_inputs(rng, BatchShape(32, 250, 40_000), 1, with_slice=False)
    assert int(inputs.seq_lens[inputs.req_start : inputs.req_end].sum()) > 65_536
    assert paths.check(_wire(inputs))


def test_seeded_generated_requests_mostly_answered_where_valid(limited: Paths) -> None:
    """The fuzzer's requests from a fixed seed: every answer agrees, and the fast path takes a real share (not a
    path that always steps aside)."""
    draw = rng_draw(np.random.default_rng(1))
    answered = sum(limited.check(chunk_request(draw).SerializeToString()) for _ in range(1000))
    assert answered > 250


def test_no_memory_or_reference_is_kept_across_calls(limited: Paths) -> None:
    """10,000 calls, answered and stepped aside, strict and not: no Python memory is left behind (tracemalloc
    sees every bytes object the module makes) and no reference to the caller's objects is taken or dropped."""
    draw = rng_draw(np.random.default_rng(3))
    requests = [chunk_request(draw).SerializeToString() for _ in range(500)]
    limits, admitted = limited.fast._fast_limits, (1, 4, 128)

    def sweep() -> int:
        answered = 0
        for data in requests:
            answered += _fastpath.build_chunk(data, limits, None) is not None
            _fastpath.build_chunk(data, limits, admitted)
        return answered

    assert sweep() > 100
    counts = [sys.getrefcount(x) for x in (*requests, limits, admitted)]
    # Only the memory allocated from this file's lines: the module's own allocations are traced to the line that
    # called it, while other threads of this test process (another test's server winding down, the metrics' fold
    # thread) allocate from their own files; counting them made this test fail once in a CI run (12,767 bytes).
    here = [tracemalloc.Filter(True, __file__)]
    tracemalloc.start()
    try:
        sweep()
        gc.collect()
        before = tracemalloc.take_snapshot().filter_traces(here)
        for _ in range(9):
            sweep()
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(here)
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert grown < 4096, f"{grown} bytes kept over 9,000 calls"
    assert [sys.getrefcount(x) for x in (*requests, limits, admitted)] == counts


@FUZZ
@given(data=st.data())
def test_generated_requests_valid_and_not(data: st.DataObject, limited: Paths) -> None:
    request = chunk_request(lambda lo, hi: data.draw(st.integers(lo, hi)))
    limited.check(request.SerializeToString())


@FUZZ
@given(data=st.data())
def test_mutated_request_bytes(data: st.DataObject, limited: Paths) -> None:
    """Flipped, cut and inserted bytes of a valid request: never a crash, never an answer of its own."""
    wire = bytearray(_wire(ChunkInputs(np.array([0, 3, 7, 7]), np.array([9, 40, 12]), 4, 0, 3, (1, 6))))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(wire)))
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip" and at < len(wire):
            wire[at] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del wire[at:]
        else:
            wire[at:at] = data.draw(st.binary(min_size=1, max_size=6))
    data_bytes = bytes(wire)
    native = limited.native(data_bytes)
    try:
        message = pb.BuildChunkRequest.FromString(data_bytes)
    except Exception:
        assert native is None  # protobuf itself refuses it
        return
    assert message is not None
    limited.check(data_bytes)


PLAIN = ChunkInputs(np.array([0, 3, 7]), np.array([9, 40]), 4, 0, 2)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return codec._varint(number << 3 | wire_type) + payload


@pytest.mark.parametrize(
    ("extra", "answered"),
    [
        (_field(99, 0, b"\x01"), False),  # an unknown field: protobuf keeps it aside
        (_field(3, 0, b"\x04"), False),  # compress_ratio twice: the last one wins
        (_field(7, 0, b"\x02"), False),  # skip_kv_gather = 2 is true to protobuf
        (_field(5, 0, b"\xff" * 9 + b"\x01"), False),  # req_end -1 in ten bytes
        (_field(5, 0, b"\x82\x80\x80\x80\x10"), False),  # req_end 2 + 2^32: protobuf truncates to int32
        (_field(3, 2, b"\x00"), False),  # compress_ratio with the wrong wire type
        (_field(4, 0, b"\x80\x00"), True),  # req_start 0 as a two-byte varint: still 0
    ],
    ids=[
        "unknown-field",
        "repeated-scalar",
        "bool-two",
        "negative-int32",
        "truncated-int32",
        "wrong-wire-type",
        "long-varint",
    ],
)
def test_unusual_encodings_go_the_general_way(extra: bytes, answered: bool, paths: Paths) -> None:
    assert paths.check(_wire(PLAIN) + extra) is answered


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"max_num_seqs": 1}, "RESOURCE_EXHAUSTED"),
        ({"max_num_batched_tokens": 6}, "RESOURCE_EXHAUSTED"),
        ({"max_model_len": 39}, "RESOURCE_EXHAUSTED"),
        ({"max_model_len": 40, "max_num_batched_tokens": 8}, None),  # the KV workspace still fits: answered
        ({"max_message_bytes": 600}, "RESOURCE_EXHAUSTED"),
    ],
    ids=["seqs", "tokens", "model-len", "at-the-limits", "message-size"],
)
def test_every_limit_is_the_general_paths_to_refuse(change: dict, code: str | None) -> None:
    limited = Paths(dataclasses.replace(BASE, **change))
    if code is None:
        assert limited.check(_wire(PLAIN))
        return
    assert limited.native(_wire(PLAIN)) is None
    with pytest.raises(ServiceError) as refused:
        limited.fast.call("BuildChunk", _wire(PLAIN))
    assert refused.value.code.name == code


def test_workspace_limit() -> None:
    """max_model_len * 40 / ratio compressed tokens per chunk: one over is refused by the general path."""
    inputs = ChunkInputs(np.array([0, 1]), np.array([1000]), 1, 0, 1)
    assert Paths(dataclasses.replace(BASE, max_model_len=1000)).check(_wire(inputs))
    tight = Paths(dataclasses.replace(BASE, max_model_len=24))  # workspace 960 < 1000; seq 1000 > 24 also
    assert tight.native(_wire(inputs)) is None


def test_strict_mode_admits_only_the_warmed_ratios() -> None:
    strict = Paths(BASE, strict_ratios=(4,))
    assert strict.check(_wire(PLAIN))
    refused = _wire(dataclasses.replace(PLAIN, compress_ratio=128))
    assert strict.native(refused) is None
    with pytest.raises(ServiceError) as outside:
        strict.fast.call("BuildChunk", refused)
    assert outside.value.code.name == "FAILED_PRECONDITION"


def test_a_ratio_outside_the_warmup_set_goes_the_general_way_counted_as_a_miss(paths: Paths) -> None:
    missed = _wire(dataclasses.replace(PLAIN, compress_ratio=16))
    assert paths.native(missed) is None and not paths.check(missed)  # the same answer, from the general path
    registry = paths.fast.metrics.registry
    assert registry.get_sample_value("indexer_warmup_misses_total", {"variant": "r16-b1024-aligned-i32"}) >= 1


def test_fast_path_calls_carry_the_native_backend_label(paths: Paths) -> None:
    registry = paths.fast.metrics.registry
    labels = {"method": "BuildChunk", "backend": FAST_PATH_BACKEND}
    before = registry.get_sample_value("indexer_backend_duration_seconds_count", labels) or 0
    paths.fast.call("BuildChunk", _wire(PLAIN))
    assert registry.get_sample_value("indexer_backend_duration_seconds_count", labels) == before + 1


def test_off_switch_sends_everything_the_general_way() -> None:
    config = load_config({"warmup_target": "none", "native_fast_path": "false"}, env={})
    assert not config.native_fast_path
    backend = make_backend("numpy", None, config.native_fast_path)
    assert backend.build_chunk_fast is None
    assert make_backend("numpy", None, True).build_chunk_fast is _fastpath.build_chunk


# --- the C checks held equal to the Python ones: each limit and check at its boundary and one past it ---------


def _outcome(paths: Paths, inputs: ChunkInputs, omit: bool = False) -> str:
    """Who answers ``inputs``: ``fast`` (service/compute/fastpath.c, with the general path's bytes), ``general`` (the
    fast path stepped aside and the general path served it), or the general path's refusal code."""
    data = _wire(inputs, omit)
    if paths.check(data):
        return "fast"
    try:
        paths.general.call("BuildChunk", data)
    except ServiceError as exc:
        return exc.code.name
    return "general"


def _requests(seq_lens: list[int], ratio: int = 1, queries: int = 1) -> ChunkInputs:
    """A chunk of every request of a batch, ``queries`` query tokens a request (``seq_lens`` >= it)."""
    qsl = np.arange(len(seq_lens) + 1) * queries
    return ChunkInputs(qsl, np.array(seq_lens), ratio, 0, len(seq_lens))


def _response_estimate(inputs: ChunkInputs, omit: bool) -> int:
    """The general path's own estimate of the answer's bytes (what max_message_bytes is compared with)."""
    return Paths(BASE).general.limits.check_sizes([inputs], chunk_host_parts([inputs]), omit)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """A limit or check at its boundary (``at`` under ``settings``: the fast path answers, with the general path's
    bytes) and one past it (``past`` under ``past_settings``, by default the same: the answer is ``outcome``)."""

    settings: dict
    at: ChunkInputs
    past: ChunkInputs
    outcome: str
    past_settings: dict | None = None
    omit: bool = False


def _replace(inputs: ChunkInputs, **change: object) -> ChunkInputs:
    return dataclasses.replace(inputs, **change)


ESTIMATE, ESTIMATE_OMIT = _response_estimate(PLAIN, False), _response_estimate(PLAIN, True)
EXHAUSTED, INVALID = "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"
BOUNDARIES = {
    "max_num_seqs": Boundary({"max_num_seqs": 10}, _requests([9] * 10, 4), _requests([9] * 11, 4), EXHAUSTED),
    "max_num_batched_tokens": Boundary(
        {"max_num_batched_tokens": 7}, PLAIN, _replace(PLAIN, query_start_loc=np.array([0, 3, 8])), EXHAUSTED
    ),
    "max_model_len": Boundary({"max_model_len": 40}, PLAIN, _replace(PLAIN, seq_lens=np.array([9, 41])), EXHAUSTED),
    # max_model_len 10: a KV workspace of 400 compressed tokens at ratio 1, and of 133 (rounded down) at ratio 3.
    "workspace": Boundary({"max_model_len": 10}, _requests([10] * 40), _requests([10] * 40 + [1]), EXHAUSTED),
    "workspace-ratio-3": Boundary(
        {"max_model_len": 10}, _requests([10] * 44 + [3], 3), _requests([10] * 44 + [6], 3), EXHAUSTED
    ),
    # The response estimate against max_message_bytes, with and without token_to_seq.
    "max_message_bytes": Boundary(
        {"max_message_bytes": ESTIMATE}, PLAIN, PLAIN, EXHAUSTED, {"max_message_bytes": ESTIMATE - 1}
    ),
    "max_message_bytes-omit": Boundary(
        {"max_message_bytes": ESTIMATE_OMIT}, PLAIN, PLAIN, EXHAUSTED, {"max_message_bytes": ESTIMATE_OMIT - 1}, True
    ),
    # The compressed total is int32 on the wire: 2^31 - 1 is served, 2^31 is malformed.
    "int32-total": Boundary(
        {"max_model_len": 2**30},
        ChunkInputs(np.zeros(3, np.int64), np.array([2**30, 2**30 - 1]), 1, 0, 2),
        ChunkInputs(np.zeros(3, np.int64), np.array([2**30, 2**30]), 1, 0, 2),
        INVALID,
        omit=True,
    ),
    "req_end": Boundary({}, PLAIN, _replace(PLAIN, req_end=3), INVALID),
    "req_start": Boundary({}, _replace(PLAIN, req_start=2), _replace(PLAIN, req_start=3, req_end=3), INVALID),
    "query_slice-stop": Boundary({}, _replace(PLAIN, query_slice=(0, 7)), _replace(PLAIN, query_slice=(0, 8)), INVALID),
    "query_slice-start": Boundary(
        {}, _replace(PLAIN, query_slice=(7, 7)), _replace(PLAIN, query_slice=(8, 7)), INVALID
    ),
    "compress_ratio": Boundary({}, _replace(PLAIN, compress_ratio=0), _replace(PLAIN, compress_ratio=-1), INVALID),
    "seq_lens-query-length": Boundary(
        {}, _replace(PLAIN, seq_lens=np.array([3, 4])), _replace(PLAIN, seq_lens=np.array([3, 3])), INVALID
    ),
    "dcp_world_size": Boundary(
        {}, _replace(PLAIN, compress_ratio=1), _replace(PLAIN, compress_ratio=1, dcp=DcpConfig(0, 2, 1)), "general"
    ),
}


@pytest.mark.parametrize("case", BOUNDARIES.values(), ids=BOUNDARIES.keys())
def test_every_check_answers_as_the_general_path_at_and_past_its_boundary(case: Boundary) -> None:
    """The C file's checks and limits held equal to the Python ones: at the boundary the fast path answers with
    the general path's bytes; one past it, it steps aside and the general path refuses (or serves)."""
    assert _outcome(Paths(dataclasses.replace(BASE, **case.settings)), case.at, case.omit) == "fast"
    past = Paths(dataclasses.replace(BASE, **(case.past_settings or case.settings)))
    assert _outcome(past, case.past, case.omit) == case.outcome


def test_fast_path_is_admitted_with_the_general_paths_estimate_and_its_heavy_lane() -> None:
    """The fast path asks admission with the general path's own estimate (the heavy lane's measure) and its
    answer's exact size (what the budget holds) once the request is known valid, and serves large answers too
    (written without the GIL): a heavy one takes the heavy lane like any other, and with the lane full it is shed,
    counted, before any array is written."""
    data, invalid = _wire(PLAIN), _wire(_replace(PLAIN, req_end=3))
    asked: list[tuple[int, int]] = []
    limits = Paths(BASE).fast._fast_limits
    answer = _fastpath.build_chunk(data, limits, None, lambda *sizes: asked.append(sizes))
    assert answer is not None
    assert _fastpath.build_chunk(invalid, limits, None, lambda *sizes: asked.append(sizes)) is None
    assert asked == [(ESTIMATE, len(answer[0]))]  # the invalid request stepped aside before admission
    assert len(answer[0]) < ESTIMATE

    lane = {"heavy_request_bytes": ESTIMATE - 1, "heavy_lane_slots": 1, "admission_wait_seconds": 0.05}
    heavy = Paths(dataclasses.replace(BASE, **lane))
    plane, registry = heavy.fast, heavy.fast.metrics.registry
    served = {"method": "BuildChunk", "backend": FAST_PATH_BACKEND}
    assert plane.call("BuildChunk", data) == heavy.general.call("BuildChunk", data)
    assert registry.get_sample_value("indexer_backend_duration_seconds_count", served) == 1
    with plane.admission.lane.slot(Caller()), pytest.raises(ServiceError) as shed:
        plane.call("BuildChunk", data)
    assert shed.value.code is Code.RESOURCE_EXHAUSTED and "heavy" in shed.value.message
    reason = {"method": "BuildChunk", "reason": "heavy_lane"}
    assert registry.get_sample_value("indexer_requests_shed_total", reason) == 1
    assert registry.get_sample_value("indexer_backend_duration_seconds_count", served) == 1
    assert plane.admission.budget.held == 0


def test_a_large_answer_is_built_by_the_fast_path() -> None:
    """A 16 MB answer (above heavy_request_bytes) is the fast path's, which writes its arrays without the GIL,
    not the general numpy path's (64 MB answers built there stalled every probe for 0.6 s: issue 10)."""
    plane = Paths(BASE).fast
    answer = plane.call("BuildChunk", big_answer_build_chunk(16 << 20).SerializeToString())
    assert len(answer) > 15 << 20
    served = {"method": "BuildChunk", "backend": FAST_PATH_BACKEND}
    assert plane.metrics.registry.get_sample_value("indexer_backend_duration_seconds_count", served) == 1
    assert plane.admission.budget.held == 0


# --- the wire contract comes from the proto; the size pass is checked against the write pass ------------------


WRITTEN = (pb.BuildChunkResponse, pb.ChunkMetadata, pb.QuerySlice)


def test_every_field_tag_comes_from_the_generated_header() -> None:
    """service/compute/fastpath.c names every field it reads or writes through protos/indexer/v1/indexer_wire.h
    (generated by `python -m indexer_service.protos.generate`, freshness-tested), and no number stands for a tag."""
    source = (REPO / "service" / "compute" / "fastpath.c").read_text()
    assert '#include "../../protos/indexer/v1/indexer_wire.h"' in source
    header = (REPO / "protos" / "indexer" / "v1" / "indexer_wire.h").read_text()
    for message in (pb.BuildChunkRequest, *WRITTEN):
        prefix = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", message.DESCRIPTOR.name).upper()
        for field in message.DESCRIPTOR.fields:
            name = f"{prefix}_{field.name.upper()}"
            assert f"#define {name} {field.number} " in header
            assert f"{name}_TAG" in source, f"{name} is not read or written through its generated tag"
    code = re.sub(r"/\*.*?\*/", "", source, flags=re.S)
    assert not re.search(r"case\s+\d|<<\s*3\b|\b0x80,", code), "a hand-written tag"


SEAM = getattr(_fastpath, "_build_chunk_with_size_skew", None)


@pytest.mark.skipif(
    SEAM is None, reason="needs the test build: tests/service/test_compiled_sanitized.py runs this file on it"
)
@pytest.mark.parametrize("skew", [-1, 1, -40, 4096], ids=["one-short", "one-over", "into-the-arrays", "far-over"])
@pytest.mark.parametrize("large", [False, True], ids=["small", "gil-released"])
def test_a_size_pass_off_by_any_bytes_is_an_exception_not_an_overrun(skew: int, large: bool, paths: Paths) -> None:
    """The test build's seam makes the size pass wrong by ``skew`` bytes: the write pass, bounds-checked, raises
    instead of writing past the bytes object (under ASan, any write out of place would abort the run)."""
    inputs = PLAIN if not large else random_chunk_inputs(np.random.default_rng(7), BatchShape(32, 250, 40_000), 1)
    data, limits = _wire(inputs), paths.fast._fast_limits
    with pytest.raises(RuntimeError, match=r"the size pass counted \d+ response bytes and the write pass"):
        SEAM(data, limits, None, skew)
    assert SEAM(data, limits, None, 0) is not None
    assert SEAM(data, limits, None, 0)[0] == _fastpath.build_chunk(data, limits, None)[0]
