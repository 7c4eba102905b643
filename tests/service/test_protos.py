"""The committed generated code is what ``python -m indexer_service.protos.generate`` and the light client's
``clients/python/generate.py`` produce now, and it imports."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

from indexer_service.protos import generate
from indexer_service.protos.indexer.v1 import indexer_pb2 as server_pb2
from testkit.paths import REPO


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


def _load(path: Path, name: str) -> ModuleType:
    """The module at ``path``, which no package of this environment holds (the light client's files)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LIGHT_GENERATOR = REPO / "clients" / "python" / "generate.py"


def test_light_client_generated_code_is_fresh(tmp_path: Path) -> None:
    light = _load(LIGHT_GENERATOR, "light_client_generate")
    written = light.generate(tmp_path)
    assert written, "no proto file found"
    for path in written:
        committed = light.GENERATED_ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `make protos`"
    committed_files = {p.relative_to(light.GENERATED_ROOT) for p in light.GENERATED_ROOT.rglob("*.py")}
    assert committed_files == {p.relative_to(tmp_path) for p in written}, "a generated file has no proto left"


def test_light_client_messages_are_the_servers() -> None:
    """The light module registers the server's descriptor bytes, so both share one pool (and one process): the
    same names, the same message classes."""
    light = _load(REPO / "clients/python/generated/indexer/v1/indexer_pb2.py", "light_indexer_pb2")
    assert light.DESCRIPTOR.serialized_pb == server_pb2.DESCRIPTOR.serialized_pb
    public = {name for name in vars(server_pb2) if not name.startswith("_")}
    assert {name for name in vars(light) if not name.startswith("_")} == public
    for name in server_pb2.DESCRIPTOR.message_types_by_name:
        assert getattr(light, name) is getattr(server_pb2, name)
    for name, enum in server_pb2.DESCRIPTOR.enum_types_by_name.items():
        assert getattr(light, name).items() == getattr(server_pb2, name).items()
        assert all(getattr(light, value.name) == value.number for value in enum.values)


def test_light_client_generator_refuses_what_it_does_not_write() -> None:
    light = _load(LIGHT_GENERATOR, "light_client_generate")
    file = descriptor_pb2.FileDescriptorProto.FromString(server_pb2.DESCRIPTOR.serialized_pb)
    file.message_type[0].nested_type.add(name="Inner")
    with pytest.raises(NotImplementedError, match="nested"):
        light.pb2_source(Path(file.name), file.SerializeToString())
