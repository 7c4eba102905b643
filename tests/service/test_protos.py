"""The committed generated code is what ``python -m indexer_service.protos.generate`` produces now, and it imports."""

from __future__ import annotations

from pathlib import Path

from indexer_service.protos import generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generated = generate.generate(tmp_path)
    assert generated, "no proto file found"
    for path in generated:
        committed = generate.PROTO_ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `make protos`"


def test_generated_stubs_import_through_the_protos_package() -> None:
    from indexer_service.protos.indexer.v1 import indexer_pb2, indexer_pb2_grpc

    service = indexer_pb2.DESCRIPTOR.services_by_name["PrefillMetadata"]
    assert service.full_name == "indexer.v1.PrefillMetadata"
    assert {m.name for m in service.methods} == {"BuildChunk", "PlanBatch", "GetWarmupStatus"}
    assert hasattr(indexer_pb2_grpc, "PrefillMetadataStub")
    stub_source = Path(indexer_pb2_grpc.__file__).read_text()
    assert "from indexer_service.protos.indexer.v1 import indexer_pb2" in stub_source
