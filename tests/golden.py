"""The hand-checked cases of docs/spec.md (tests/data/golden-cases.json), as the project's own types."""

from __future__ import annotations

import json

import numpy as np

from indexer_service.kernels.inputs import ChunkInputs, ChunkMetadata, DcpConfig
from testkit.paths import REPO

GOLDEN_PATH = REPO / "tests" / "data" / "golden-cases.json"
GOLDEN = json.loads(GOLDEN_PATH.read_text())

ARRAY_FIELDS = ("cu_seq_lens", "token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke", "local_cu_seq_lens")
SCALAR_FIELDS = (
    "total_seq_lens",
    "token_start",
    "token_end",
    "num_reqs",
    "skip_kv_gather",
    "local_total_seq_lens",
    "max_local_total_seq_lens",
)


def chunk_inputs(case: dict) -> ChunkInputs:
    spec = case["input"]
    return ChunkInputs(
        query_start_loc=np.array(spec["qsl"], dtype=np.int32),
        seq_lens=np.array(spec["seq_lens"], dtype=np.int32),
        compress_ratio=spec["ratio"],
        req_start=spec["start"],
        req_end=spec["end"],
        query_slice=tuple(spec["qslice"]) if "qslice" in spec else None,
        dcp=DcpConfig(rank=spec.get("rank", 0), world_size=spec.get("world", 1), interleave=spec.get("inter", 1)),
    )


def metadata_as_dict(meta: ChunkMetadata) -> dict:
    """The spec's fields of a result, as plain lists and scalars, comparable to a golden ``expected``."""
    out = {name: np.asarray(getattr(meta, name)).tolist() for name in ARRAY_FIELDS}
    out.update({name: getattr(meta, name) for name in SCALAR_FIELDS})
    return out


def case_id(case: dict) -> str:
    return case["name"]
