"""The proto as other languages meet it: buf lint clean, no breaking change against the last released proto,
language options set, every element documented, the wire rules stated, and the .proto shipped in the wheel."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import tomllib
from importlib import resources
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from tests.system.clients_support import BUF, INSTALL_HINT, PROTOS, REPO
from tests.tools import needs_tool

PROTO = PROTOS / "indexer" / "v1" / "indexer.proto"
RELEASED = sorted((PROTOS / "released").glob("indexer-v1-*.binpb"))
needs_buf = needs_tool(None if BUF.exists() else f"buf is not installed: {INSTALL_HINT}")


def buf(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def latest_release() -> Path:
    assert RELEASED, "no released proto image under protos/released/"
    return max(RELEASED, key=lambda p: tuple(int(x) for x in p.name.removeprefix("indexer-v1-")[:-6].split(".")))


@needs_buf
def test_buf_lint_is_clean() -> None:
    run = buf("lint")
    assert run.returncode == 0, run.stdout + run.stderr


@needs_buf
def test_no_breaking_change_against_the_last_release() -> None:
    run = buf("breaking", "--against", str(latest_release().relative_to(REPO)))
    assert run.returncode == 0, run.stdout + run.stderr


@needs_buf
def test_breaking_check_catches_a_retyped_field(tmp_path: Path) -> None:
    """The check has teeth: the same configuration refuses a field whose type changed."""
    shutil.copy2(REPO / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(PROTOS / "indexer", tmp_path / "protos" / "indexer", ignore=shutil.ignore_patterns("*.py*"))
    changed = tmp_path / "protos/indexer/v1/indexer.proto"
    text = changed.read_text()
    assert "  int32 compress_ratio = 3;" in text
    changed.write_text(text.replace("  int32 compress_ratio = 3;", "  int64 compress_ratio = 3;"))
    run = buf("breaking", "--against", str(latest_release()), cwd=tmp_path)
    assert run.returncode != 0
    assert 'changed type from "int32" to "int64"' in run.stdout


def released_file() -> descriptor_pb2.FileDescriptorProto:
    # A buf image is wire-compatible with FileDescriptorSet.
    images = descriptor_pb2.FileDescriptorSet.FromString(latest_release().read_bytes())
    return next(f for f in images.file if f.name == "indexer/v1/indexer.proto")


def test_breaking_exceptions_only_while_the_release_lacks_the_options() -> None:
    """buf.yaml excuses the language options that 0.1.0 did not set; once a released image carries them, the
    exceptions must go."""
    config = (REPO / "buf.yaml").read_text()
    if released_file().options.HasField("go_package"):
        assert "FILE_SAME_" not in config, "drop buf.yaml's breaking exceptions: the released proto has the options"


def current_file() -> descriptor_pb2.FileDescriptorProto:
    """The proto as protoc parses it, comments included."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "set.binpb"
        assert protoc.main(["protoc", f"-I{PROTOS}", "--include_source_info", f"-o{target}", str(PROTO)]) == 0
        return descriptor_pb2.FileDescriptorSet.FromString(target.read_bytes()).file[0]


def test_language_options_are_set() -> None:
    options = current_file().options
    assert options.go_package.endswith("/clients/go/indexer/v1;indexerv1")
    assert options.java_package == "io.github.indexerservice.indexer.v1"
    assert options.java_multiple_files
    assert options.java_outer_classname
    assert options.csharp_namespace == "IndexerService.Indexer.V1"
    assert options.objc_class_prefix and options.php_namespace and options.ruby_package


def documented_paths(file: descriptor_pb2.FileDescriptorProto) -> set[tuple[int, ...]]:
    return {tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()}


def test_every_service_method_message_field_and_enum_value_has_a_comment() -> None:
    file = current_file()
    documented = documented_paths(file)
    missing = []
    # Paths in FileDescriptorProto: message_type 4 (field 2), enum_type 5 (value 2), service 6 (method 2).
    for i, message in enumerate(file.message_type):
        if message.field and (4, i) not in documented:
            missing.append(message.name)
        missing += [f"{message.name}.{f.name}" for j, f in enumerate(message.field) if (4, i, 2, j) not in documented]
    for i, enum in enumerate(file.enum_type):
        if (5, i) not in documented:
            missing.append(enum.name)
        missing += [f"{enum.name}.{v.name}" for j, v in enumerate(enum.value) if (5, i, 2, j) not in documented]
    for i, service in enumerate(file.service):
        if (6, i) not in documented:
            missing.append(service.name)
        missing += [f"{service.name}.{m.name}" for j, m in enumerate(service.method) if (6, i, 2, j) not in documented]
    assert not missing, f"undocumented in {PROTO.relative_to(REPO)}: {missing}"


def test_the_wire_rules_are_stated_in_the_proto() -> None:
    text = PROTO.read_text()
    assert "LITTLE-ENDIAN INT32" in text
    assert "service/compute/fastpath.c" in text and (REPO / "service" / "compute" / "fastpath.c").exists()
    assert "base64" in text and "int64 fields are JSON strings" in text


def test_the_proto_ships_in_the_wheel() -> None:
    """docs/clients.md promises the .proto as package data of every release's wheel."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_data = project["tool"]["setuptools"]["package-data"]
    assert any("*.proto" in patterns for patterns in package_data.values()), package_data
    assert (resources.files("indexer_service.protos.indexer.v1") / "indexer.proto").is_file()
    assert "protos/indexer/v1/indexer.proto" in (REPO / "docs" / "clients.md").read_text()
