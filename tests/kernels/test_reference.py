"""kernels/reference.py, the slow literal reference of docs/spec.md, against the golden cases; then every fast path
against the reference on varied batches: the numpy backend and the planner, the compiled fast path
(service/compute/fastpath.c), and the Triton kernel through Triton's CPU interpreter. Every field of ChunkMetadata is
compared, the echoed ones (req_start, req_end, query_slice) included."""

from __future__ import annotations

import ast
import dataclasses
import re
import zlib
from collections.abc import Callable

import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs, ChunkMetadata, DcpConfig
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.kernels.planner import BatchInputs, ChunkBuilder, PrefillPlan, build_prefill_batch
from indexer_service.kernels.reference import (
    reference_chunk_metadata,
    reference_local,
    reference_local_by_dealing,
    reference_plan,
    reference_prefill_batch,
    reference_warmup_compress_ratios,
    reference_workspace,
)
from testkit.batches import BatchShape, random_batch, random_chunk_inputs
from testkit.paths import REPO
from tests.golden import ARRAY_FIELDS, GOLDEN, SCALAR_FIELDS, case_id, chunk_inputs, metadata_as_dict

NO_DCP = DcpConfig()
METADATA_FIELDS = tuple(f.name for f in dataclasses.fields(ChunkMetadata))
RandomKey = tuple[str, int, str]  # (shape, ratio, DCP setting) of a random chunk
FastPath = Callable[[ChunkInputs], tuple[bool, ChunkMetadata | None]]
METADATA_ARRAYS = ("cu_seq_lens", "token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke", "local_cu_seq_lens")


def fields_of(meta: ChunkMetadata | None) -> dict | None:
    """Every field of a result as plain values; arrays must be int32."""
    if meta is None:
        return None
    out = {}
    for name in METADATA_FIELDS:
        value = getattr(meta, name)
        if name in METADATA_ARRAYS:
            array = np.asarray(value)
            assert array.dtype == np.int32, f"{name} is {array.dtype}"
            out[name] = array.tolist()
        elif name == "query_slice":
            out[name] = (int(value[0]), int(value[1]))
        elif name == "skip_kv_gather":
            out[name] = bool(value)
        else:
            out[name] = int(value)
    return out


def assert_same(got: ChunkMetadata | None, want: ChunkMetadata | None) -> None:
    have, expected = fields_of(got), fields_of(want)
    if expected is None or have is None:
        assert have == expected
        return
    wrong = {name: (have[name], expected[name]) for name in METADATA_FIELDS if have[name] != expected[name]}
    assert not wrong, f"fields differ (got, reference): {wrong}"


# --- the reference against the golden cases (all of tests/data/golden-cases.json) -------------------------------


@pytest.mark.parametrize("case", GOLDEN["chunk_metadata"], ids=case_id)
def test_reference_matches_golden_chunk(case) -> None:
    result = reference_chunk_metadata(chunk_inputs(case))
    expected = case["expected"]
    if expected is None:
        assert result is None
        return
    assert metadata_as_dict(result) == {k: expected[k] for k in (*ARRAY_FIELDS, *SCALAR_FIELDS)}
    inputs = chunk_inputs(case)
    slice_ = inputs.query_slice or (
        0,
        int(inputs.query_start_loc[inputs.req_end] - inputs.query_start_loc[inputs.req_start]),
    )
    assert (result.req_start, result.req_end, result.query_slice) == (inputs.req_start, inputs.req_end, slice_)


@pytest.mark.parametrize("case", GOLDEN["chunk_plan"], ids=case_id)
def test_reference_matches_golden_plan(case) -> None:
    spec = case["input"]
    plan = reference_plan(
        spec["cseq"], spec["qlens"], spec["workspace"], spec["max_logits_bytes"] // 4, spec.get("offset", 0)
    )
    got = [{"requests": [c.req_start, c.req_end], "query_slice": [c.query_start, c.query_stop]} for c in plan]
    assert got == case["expected"]


@pytest.mark.parametrize(
    "case",
    GOLDEN["warmup_compress_ratios"],
    ids=lambda c: f"ratios{len(c['compress_ratios'] or [])}-kpool{c['index_kpool']}",
)
def test_reference_matches_golden_warmup_ratios(case) -> None:
    assert reference_warmup_compress_ratios(case["compress_ratios"], case["index_kpool"]) == tuple(case["expected"])


def test_reference_spec_section2_at_scale() -> None:
    """Spec section 2's last worked plan: the default budget splits one request in four."""
    workspace = reference_workspace(2**20, 4)
    assert workspace == 10_485_760
    plan = reference_plan([65_536], [8_192], workspace, 512 * 2**20 // 4)
    assert [(c.query_start, c.query_stop) for c in plan] == [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8192)]


@pytest.mark.parametrize("world, interleave", [(1, 1), (1, 3), (2, 1), (3, 2), (4, 1), (4, 2), (5, 3), (8, 4)])
def test_reference_dcp_formula_is_the_dealing(world: int, interleave: int) -> None:
    """Spec section 1's local(L) formula against its definition (token g on rank (g // I) mod W), every rank."""
    for length in range(0, 3 * world * interleave + 5):
        for rank in range(world):
            assert reference_local(length, rank, world, interleave) == reference_local_by_dealing(
                length, rank, world, interleave
            ), (length, rank)


def test_reference_without_dcp_gives_an_equal_local_array_not_the_same_object() -> None:
    """Spec section 8: local_cu_seq_lens is an equal array when DCP is off (the wire has no aliasing)."""
    result = reference_chunk_metadata(ChunkInputs(np.array([0, 3]), np.array([7]), 1, 0, 1))
    assert result.local_cu_seq_lens is not result.cu_seq_lens
    assert result.local_cu_seq_lens.tolist() == result.cu_seq_lens.tolist()


# Inputs outside the spec's domain (sections 5 and 8): the reference has no answer, and neither has the backend.
INVALID = {
    "qsl-not-from-0": ChunkInputs(np.array([1, 3]), np.array([5]), 1, 0, 1),
    "qsl-decreasing": ChunkInputs(np.array([0, 3, 2]), np.array([5, 5]), 1, 0, 2),
    "seq-below-query": ChunkInputs(np.array([0, 3]), np.array([2]), 1, 0, 1),
    "seq-negative": ChunkInputs(np.array([0, 0]), np.array([-1]), 1, 0, 1),
    "ratio-negative": ChunkInputs(np.array([0, 3]), np.array([5]), -1, 0, 1),
    "range-outside": ChunkInputs(np.array([0, 3]), np.array([5]), 1, 0, 2),
    "slice-outside": ChunkInputs(np.array([0, 3]), np.array([5]), 1, 0, 1, query_slice=(1, 4)),
    "slice-reversed": ChunkInputs(np.array([0, 3]), np.array([5]), 1, 0, 1, query_slice=(2, 1)),
    "dcp-rank-outside": ChunkInputs(np.array([0, 3]), np.array([5]), 1, 0, 1, dcp=DcpConfig(2, 2, 1)),
    "dcp-interleave-0": ChunkInputs(np.array([0, 3]), np.array([5]), 1, 0, 1, dcp=DcpConfig(0, 2, 0)),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_reference_and_numpy_both_refuse_inputs_outside_the_spec(name) -> None:
    with pytest.raises(ValueError):
        reference_chunk_metadata(INVALID[name])
    with pytest.raises(ValueError):  # InvalidInputError is a ValueError
        build_chunk_metadata_numpy(INVALID[name])


# --- varied chunks ------------------------------------------------------------------------------------------------


def chunk(
    query_lens: list[int],
    seq_lens: list[int],
    ratio: int,
    start: int = 0,
    end: int | None = None,
    qslice: tuple[int, int] | None = None,
    skip: bool = False,
    dcp: DcpConfig = NO_DCP,
) -> ChunkInputs:
    qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    end = len(query_lens) if end is None else end
    return ChunkInputs(qsl, np.array(seq_lens, dtype=np.int32), ratio, start, end, qslice, skip, dcp)


def dcp(world: int, interleave: int = 1, rank: int = 0) -> DcpConfig:
    return DcpConfig(rank=rank, world_size=world, interleave=interleave)


# Hand-made chunks, one per corner of section 1 (and section 5's edge cases that have an answer).
CASES: dict[str, ChunkInputs] = {
    "one-request": chunk([5], [12], 1),
    "one-request-ratio4": chunk([7], [30], 4),
    "one-request-all-context-ratio1": chunk([1], [40], 1),
    "empty-chunk": chunk([3, 2], [5, 4], 1, start=1, end=1),
    "empty-chunk-at-end": chunk([3, 2], [5, 4], 4, start=2, end=2),
    "all-below-ratio-ratio4": chunk([1, 2, 3], [3, 2, 3], 4),
    "all-below-ratio-ratio128": chunk([4, 2], [127, 100], 128),
    "seq0-zero-query-ratio1": chunk([2, 0, 3], [5, 0, 9], 1),
    "zero-query-owns-kv-ratio4": chunk([2, 0, 3], [9, 17, 8], 4),
    "ratio0-means-1": chunk([3, 1], [5, 2], 0),
    "ratio1-after-decodes": chunk([1, 1, 4, 3], [10, 7, 9, 3], 1, start=2, end=4),
    "ratio4-some-below-ratio": chunk([3, 2, 4], [3, 9, 4], 4),
    "ratio4-first-rows-see-nothing": chunk([6], [6], 4),
    "ratio128": chunk([5, 3], [300, 130], 128),
    "ratio128-qslice": chunk([6, 4], [400, 260], 128, qslice=(2, 8)),
    "ratio128-at-ratio-boundary": chunk([3, 2], [129, 128], 128),
    "ratio4-qslice-empty": chunk([3, 4], [10, 12], 4, qslice=(3, 3)),
    "ratio4-qslice-first-rows": chunk([3, 4], [10, 12], 4, qslice=(0, 2)),
    "ratio1-qslice-across-zero-query": chunk([3, 0, 4], [5, 6, 9], 1, qslice=(1, 6)),
    "ratio1-qslice-last-row": chunk([3, 4], [5, 9], 1, qslice=(6, 7)),
    "ratio1-skip_kv": chunk([2, 3], [4, 7], 1, skip=True),
    "ratio4-qslice-from-0-skip_kv": chunk([2, 3], [9, 7], 4, qslice=(0, 3), skip=True),
    "dcp2-ratio1": chunk([4, 2], [7, 5], 1, dcp=dcp(2)),
    "dcp2-rank1-ratio1": chunk([4, 2], [7, 5], 1, dcp=dcp(2, rank=1)),
    "dcp4-interleave2-ratio1-skip_kv": chunk([3, 5], [11, 14], 1, qslice=(2, 7), dcp=dcp(4, 2, rank=1)),
    "dcp4-interleave3-rank3-ratio1": chunk([2, 6, 1], [9, 20, 4], 1, dcp=dcp(4, 3, rank=3)),
    "dcp4-interleave1-rank2-ratio0-qslice": chunk([4, 4], [13, 6], 0, qslice=(1, 6), dcp=dcp(4, 1, rank=2)),
    "dcp2-interleave4-rank1-ratio1": chunk([5, 0, 3], [17, 2, 8], 1, dcp=dcp(2, 4, rank=1)),
    "dcp1-interleave2-ratio1": chunk([3, 2], [8, 5], 1, dcp=dcp(1, 2)),
    "dcp8-interleave3-rank5-short": chunk([2, 3], [4, 3], 1, dcp=dcp(8, 3, rank=5)),
    # DCP with ratio > 1 is refused by the service (section 5) but is defined by section 1 at the kernel layer.
    "dcp2-ratio4-kernel-layer": chunk([3, 5], [21, 30], 4, dcp=dcp(2, 1, rank=1)),
}
# One chunk per rank of a few DCP settings (the ranks' shares add up: test_reference_dcp_ranks_partition_the_chunk).
for _world, _inter in ((2, 1), (4, 2), (3, 3)):
    for _rank in range(_world):
        CASES[f"dcp{_world}-interleave{_inter}-rank{_rank}-every-rank"] = chunk(
            [3, 0, 5], [10, 4, 13], 1, qslice=(1, 8), dcp=dcp(_world, _inter, rank=_rank)
        )


@pytest.mark.parametrize("world, interleave", [(2, 1), (4, 2), (3, 3)])
def test_reference_dcp_ranks_partition_the_chunk(world: int, interleave: int) -> None:
    """Over all ranks, the local totals add up to T, and max_local_total_seq_lens is the largest of them."""
    results = [CASES[f"dcp{world}-interleave{interleave}-rank{rank}-every-rank"] for rank in range(world)]
    metas = [reference_chunk_metadata(inputs) for inputs in results]
    assert sum(m.local_total_seq_lens for m in metas) == metas[0].total_seq_lens
    assert {m.max_local_total_seq_lens for m in metas} == {max(m.local_total_seq_lens for m in metas)}


# Random batches (testkit/batches.py), kept small: the reference is slow.
SHAPES = {
    "one-request": BatchShape(1, 9, 40),
    "few": BatchShape(4, 6, 20),
    "zero-heavy": BatchShape(6, 4, 5, zero_query_share=0.6),
    "short-contexts": BatchShape(8, 3, 3),  # many S < ratio
    "long-contexts": BatchShape(3, 8, 600),  # several compressed tokens even at ratio 128
}
DCP_SETTINGS = {
    "nodcp": NO_DCP,
    "dcp2-rank1": dcp(2, 1, rank=1),
    "dcp4-interleave2-rank2": dcp(4, 2, rank=2),
    "dcp4-interleave3-rank0": dcp(4, 3, rank=0),
}
RATIOS = (0, 1, 4, 128)
DRAWS = 3


def random_cases(shape_name: str, ratio: int, dcp_name: str) -> list[ChunkInputs]:
    rng = np.random.default_rng(zlib.crc32(f"reference-{shape_name}-{ratio}-{dcp_name}".encode()))
    return [random_chunk_inputs(rng, SHAPES[shape_name], ratio, DCP_SETTINGS[dcp_name]) for _ in range(DRAWS)]


RANDOM_IDS = [(shape, ratio, dcp_name) for shape in SHAPES for ratio in RATIOS for dcp_name in DCP_SETTINGS]


def random_id(key: RandomKey) -> str:
    shape, ratio, dcp_name = key
    return f"random-{shape}-ratio{ratio}-{dcp_name}"


# --- (a) the numpy backend and the planner ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_numpy_equals_reference(name) -> None:
    assert_same(build_chunk_metadata_numpy(CASES[name]), reference_chunk_metadata(CASES[name]))


@pytest.mark.parametrize("key", RANDOM_IDS, ids=random_id)
def test_numpy_equals_reference_on_random_chunks(key) -> None:
    for inputs in random_cases(*key):
        assert_same(build_chunk_metadata_numpy(inputs), reference_chunk_metadata(inputs))


def batch(
    query_lens: list[int],
    seq_lens: list[int],
    ratio: int,
    num_decodes: int,
    max_model_len: int,
    max_logits_bytes: int,
    dcp_config: DcpConfig = NO_DCP,
) -> BatchInputs:
    qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    return BatchInputs(
        qsl, np.array(seq_lens, dtype=np.int32), ratio, num_decodes, max_model_len, max_logits_bytes, dcp_config
    )


def random_batch_inputs(
    seed: str, shape: BatchShape, ratio: int, max_model_len: int, logits: int, dcp_config: DcpConfig = NO_DCP
) -> BatchInputs:
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    qsl, seq = random_batch(rng, shape)
    num_decodes = int(rng.integers(0, shape.num_requests // 2 + 1))
    return BatchInputs(qsl, seq, ratio, num_decodes, max_model_len, 4 * logits, dcp_config)


PLANS: dict[str, BatchInputs] = {
    "plan-spec-E3": batch([1, 6], [30, 10], 1, num_decodes=1, max_model_len=1000, max_logits_bytes=160),
    "plan-ratio4-empty-first-chunk": batch([3, 4], [3, 40], 4, 0, max_model_len=100, max_logits_bytes=4 * 12),
    "plan-all-decodes": batch([1, 1], [5, 9], 1, num_decodes=2, max_model_len=100, max_logits_bytes=400),
    "plan-zero-queries": batch([1, 0, 0], [5, 9, 4], 1, num_decodes=1, max_model_len=100, max_logits_bytes=400),
    "plan-oversize-request-alone-ratio1": batch(
        [2, 3, 1], [10, 90, 5], 1, 0, max_model_len=1, max_logits_bytes=4 * 10_000
    ),
    "plan-ratio0-default-budget": batch([3, 2, 4], [9, 2, 30], 0, 1, max_model_len=4096, max_logits_bytes=512 * 2**20),
    "plan-ratio128-split-along-queries": batch([1, 9], [200, 700], 128, 1, max_model_len=100, max_logits_bytes=4 * 10),
    "plan-dcp4-interleave2-ratio1": batch(
        [1, 4, 3, 6], [8, 12, 9, 20], 1, 1, max_model_len=1, max_logits_bytes=4 * 50, dcp_config=dcp(4, 2, rank=1)
    ),
    "plan-random-ratio1-many-chunks": random_batch_inputs("plan-r1", BatchShape(10, 12, 60), 1, 3, 300),
    "plan-random-ratio4-many-chunks": random_batch_inputs("plan-r4", BatchShape(12, 20, 300), 4, 10, 400),
    "plan-random-ratio128-tight-logits": random_batch_inputs("plan-r128", BatchShape(6, 10, 900), 128, 60, 12),
    "plan-random-dcp2-ratio0": random_batch_inputs("plan-dcp", BatchShape(8, 8, 40), 0, 2, 150, dcp(2, 1, 1)),
}


def assert_same_plan(got: PrefillPlan, want: PrefillPlan) -> None:
    assert got.chunks == want.chunks
    assert got.max_prefill_seq_len == want.max_prefill_seq_len
    assert len(got.metadata) == len(want.metadata)
    for have, expected in zip(got.metadata, want.metadata, strict=True):
        assert_same(have, expected)


@pytest.mark.parametrize("name", list(PLANS))
def test_planner_equals_reference(name) -> None:
    want = reference_prefill_batch(PLANS[name])
    assert_same_plan(build_prefill_batch(PLANS[name], build_chunk_metadata_numpy), want)


def test_plans_reach_the_corners_they_are_named_for() -> None:
    """The plan cases are not vacuous: several chunks, a request cut along its queries, an empty chunk."""
    plans = {name: reference_prefill_batch(b) for name, b in PLANS.items()}
    assert plans["plan-all-decodes"].chunks == [] and plans["plan-zero-queries"].chunks == []
    assert (
        len(plans["plan-ratio4-empty-first-chunk"].metadata) == len(plans["plan-ratio4-empty-first-chunk"].chunks) - 1
    )
    for name in ("plan-ratio128-split-along-queries", "plan-random-ratio4-many-chunks", "plan-spec-E3"):
        assert any(c.query_start > 0 for c in plans[name].chunks), name
    for name in ("plan-random-ratio1-many-chunks", "plan-random-ratio4-many-chunks", "plan-dcp4-interleave2-ratio1"):
        assert len(plans[name].chunks) >= 3, name


# --- (b) the compiled fast path (service/compute/fastpath.c), its bytes decoded with service.codec
# -----------------------


@pytest.fixture(scope="module")
def fast_path() -> FastPath:
    """service/compute/fastpath.c's build_chunk with the default configuration's limits, any ratio admitted (a skip
    where the extension is not built: the kernel tests run without it, tests/service/ needs it)."""
    _fastpath = pytest.importorskip(
        "indexer_service.service.compute._fastpath", reason="service/compute/_fastpath is not built"
    )
    from indexer_service.service import codec
    from indexer_service.service.config import load_config
    from indexer_service.service.overload.limits import fast_path_limits

    config = load_config({"warmup_target": "none"}, env={})
    limits = fast_path_limits(config)

    def build(inputs: ChunkInputs) -> tuple[bool, ChunkMetadata | None]:
        """(answered, result): answered is False where the fast path steps aside to the general path."""
        from indexer_service.protos.indexer.v1 import indexer_pb2 as pb

        native = _fastpath.build_chunk(codec.chunk_inputs_to_proto(inputs).SerializeToString(), limits, None)
        if native is None:
            return False, None
        response = pb.BuildChunkResponse.FromString(native[0])
        return True, codec.metadata_from_proto(response.metadata) if response.HasField("metadata") else None

    return build


def check_fast_path(build: FastPath, inputs: ChunkInputs) -> bool:
    answered, result = build(inputs)
    if not answered:
        # The only valid chunks it leaves to the general path are those naming any DCP field, even world 1
        # (service/compute/fastpath.c serves "no DCP" only).
        assert inputs.dcp != NO_DCP, "the fast path stepped aside on a valid chunk without DCP"
        return False
    assert_same(result, reference_chunk_metadata(inputs))
    return True


@pytest.mark.parametrize("name", [name for name, inputs in CASES.items() if inputs.dcp == NO_DCP])
def test_fast_path_equals_reference(name: str, fast_path: FastPath) -> None:
    assert check_fast_path(fast_path, CASES[name])


def test_fast_path_leaves_dcp_to_the_general_path_or_agrees(fast_path: FastPath) -> None:
    """service/compute/fastpath.c serves no DCP today; should it start to, its answers are held to the reference
    here."""
    for inputs in CASES.values():
        if inputs.dcp != NO_DCP:
            check_fast_path(fast_path, inputs)


@pytest.mark.parametrize("key", [k for k in RANDOM_IDS if k[2] == "nodcp"], ids=random_id)
def test_fast_path_equals_reference_on_random_chunks(key: RandomKey, fast_path: FastPath) -> None:
    for inputs in random_cases(*key):
        assert check_fast_path(fast_path, inputs)


# --- (c) the Triton kernel through Triton's CPU interpreter (a smaller set: the interpreter is slower) -----------

# Every hand-made chunk and plan; of the random grid, every shape and ratio with one DCP setting each (rotating).
TRITON_CASES = tuple(CASES)
TRITON_RANDOM = [
    (shape, ratio, list(DCP_SETTINGS)[(i + j) % len(DCP_SETTINGS)])
    for i, shape in enumerate(SHAPES)
    for j, ratio in enumerate(RATIOS)
]
TRITON_PLANS = tuple(PLANS)


@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_interpreter_equals_reference(name: str, triton_cpu: ChunkBuilder) -> None:
    assert_same(triton_cpu(CASES[name]), reference_chunk_metadata(CASES[name]))


@pytest.mark.parametrize("key", TRITON_RANDOM, ids=random_id)
def test_triton_interpreter_equals_reference_on_random_chunks(key: RandomKey, triton_cpu: ChunkBuilder) -> None:
    for inputs in random_cases(*key):
        assert_same(triton_cpu(inputs), reference_chunk_metadata(inputs))


@pytest.mark.parametrize("name", TRITON_PLANS)
def test_triton_interpreter_plan_equals_reference(name: str, triton_cpu: ChunkBuilder) -> None:
    assert_same_plan(build_prefill_batch(PLANS[name], triton_cpu), reference_prefill_batch(PLANS[name]))


# --- served by nothing, independent of what it checks ------------------------------------------------------------

_IMPORTS_REFERENCE = re.compile(
    r"^\s*(from\s+(indexer_service\.)?kernels\.reference\s+import|import\s+(indexer_service\.)?kernels\.reference\b"
    r"|from\s+(indexer_service\.)?kernels\s+import\s+[^#\n]*\breference\b"
    r"|from\s+\.\s*import\s+[^#\n]*\breference\b|from\s+\.reference\s+import)",
    re.MULTILINE,
)
_NAMES_REFERENCE = re.compile(r"""["'](indexer_service\.)?kernels\.reference["']""")  # import_module("...reference")


def test_no_product_module_imports_the_reference() -> None:
    offenders = []
    for package in ("service", "kernels"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name == "reference.py" and path.parent.name == "kernels":
                continue
            text = path.read_text()
            if _IMPORTS_REFERENCE.search(text) or _NAMES_REFERENCE.search(text):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []


def test_reference_imports_only_the_dataclasses() -> None:
    """The reference calls none of the code it checks: from the kernels package it takes the dataclasses only."""
    allowed = {
        "indexer_service.kernels.inputs": {"ChunkInputs", "ChunkMetadata", "DcpConfig"},
        "indexer_service.kernels.planner": {"BatchInputs", "ChunkSpec", "PrefillPlan"},
    }
    tree = ast.parse((REPO / "kernels" / "reference.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert all(not alias.name.startswith("indexer_service") for alias in node.names), ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            assert node.level == 0, ast.dump(node)
            if module.startswith("indexer_service"):
                assert module in allowed, module
                assert {alias.name for alias in node.names} <= allowed[module], ast.dump(node)
            else:
                assert module in {"__future__", "collections.abc", "numpy"}, module
