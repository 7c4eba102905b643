"""Build the light Python client distribution, ``indexer-service-client``: ``python clients/python/build.py OUT``.

Schedulers need the client, not the server: this wheel holds the client (``clients/python/client/__init__.py``), the
wire codec, the request and result types and the generated protobuf code, and needs numpy, grpcio,
grpcio-health-checking and protobuf only (no torch, no Triton). It is made from the repository's own files, never a copy
kept by hand: the modules below go under the import name ``indexer_service_client`` (their ``indexer_service.`` imports
rewritten to match, so it installs beside the server's ``indexer_service`` without sharing a file).

The generated protobuf and gRPC code is not the server's: schedulers pin their own grpcio and protobuf, often a year
or more behind, and the server's ``*_pb2.py`` and ``*_pb2_grpc.py`` refuse at import any runtime older than the
grpcio-tools that wrote them. The wheel takes ``clients/python/generated/`` instead, written by
``clients/python/generate.py`` (``make protos`` runs both generators) from the server's own descriptor bytes: the
messages are made at import from the serialized ``FileDescriptorProto`` (``descriptor_pool`` and
``message_factory.GetMessageClass``, enums wrapped as protoc's own output wraps them), the stubs with
``channel.unary_unary``: APIs that every grpcio and protobuf of metadata.toml's range has, and no version check.
Chosen over generating with an older pinned grpcio-tools: that would need a second, old toolchain (and environment)
to build and to check freshness, its output would still carry a version check that a newer runtime may turn into a
warning or an error, and it would move the lower bound only as far as that one pin. The same descriptor bytes mean
the server's and the client's modules can even share a process. tests/service/test_protos.py checks the generated
files fresh; tests/system/test_client_light.py installs the wheel at the lowest and at the newest versions its
metadata allows and calls a real server with each.

The wheel is written with the standard library alone (a wheel is a zip of the package plus METADATA, WHEEL and
RECORD: PEP 427, PEP 376), so any Python >= 3.11 builds it, without setuptools or pip (a system Python's older
setuptools refuses the SPDX license field). Its bytes depend only on the sources: entries are sorted and dated
1980-01-01. tests/system/test_client_light.py builds it with the system's python3.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import tomllib
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PACKAGE = "indexer_service_client"
# The client's import closure, repository path -> path inside the package (tests/system/test_client_light.py proves it
# closed: the wheel imports in an environment that has nothing else of this project).
MODULES = {
    "clients/python/client/__init__.py": "client.py",
    "service/process/addresses.py": "addresses.py",
    "service/codec.py": "codec.py",
    "kernels/inputs.py": "kernels/inputs.py",
    "kernels/formulas.py": "kernels/formulas.py",
    "kernels/planner.py": "kernels/planner.py",
    "kernels/specialization.py": "kernels/specialization.py",
    # The version-neutral generated code (see above), and the server's type stubs, which describe the same names.
    "clients/python/generated/indexer/v1/indexer_pb2.py": "protos/indexer/v1/indexer_pb2.py",
    "clients/python/generated/indexer/v1/indexer_pb2_grpc.py": "protos/indexer/v1/indexer_pb2_grpc.py",
    "protos/indexer/v1/indexer_pb2.pyi": "protos/indexer/v1/indexer_pb2.pyi",
    "protos/indexer/v1/indexer.proto": "protos/indexer/v1/indexer.proto",
}
INIT = (
    '"""The indexer-service client (see client.py); built from the indexer-service repository."""\n\n'
    "from indexer_service_client.client import IndexerClient, tls_credentials\n"
    "from indexer_service_client.kernels.inputs import ChunkInputs, ChunkMetadata, DcpConfig\n"
    "from indexer_service_client.kernels.planner import BatchInputs, ChunkSpec, PrefillPlan\n\n"
    '__all__ = ["BatchInputs", "ChunkInputs", "ChunkMetadata", "ChunkSpec", "DcpConfig", "IndexerClient", '
    '"PrefillPlan", "tls_credentials"]\n'
)
# "from indexer_service.service import codec" -> "from indexer_service_client import codec";
# "from indexer_service.service.codec import X" -> "from indexer_service_client.codec import X";
# "from indexer_service.service.process.addresses import X" -> "from indexer_service_client.addresses import X";
# "from indexer_service.kernels.inputs import X" -> "from indexer_service_client.kernels.inputs import X".
_IMPORTS = re.compile(
    r"^(\s*)(from|import) indexer_service(\.service(?:\.process)?(?= import)|\.service(?:\.process)?\.|\.)",
    re.MULTILINE,
)
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the oldest date a zip holds: the wheel's bytes depend only on its files


def version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def package_files() -> dict[str, bytes]:
    """Path inside the wheel -> content: the modules with their imports rewritten, and every package's
    ``__init__.py``."""
    files: dict[str, bytes] = {}
    for source, target in MODULES.items():
        text = (REPO / source).read_text()
        if source.endswith(".py"):
            # indexer_service.client, .addresses and .codec sit at the package's top; the others keep their folders.
            text = _IMPORTS.sub(
                lambda m: f"{m.group(1)}{m.group(2)} {PACKAGE}{'.' if m.group(3).endswith('.') else ''}", text
            )
        files[f"{PACKAGE}/{target}"] = text.encode()
        for parent in Path(target).parents:
            files.setdefault(f"{PACKAGE}/{parent}/__init__.py".replace("/./", "/"), b"")
    files[f"{PACKAGE}/__init__.py"] = INIT.encode()
    return files


def metadata(project: dict, version: str) -> str:
    """Core metadata (METADATA) of the wheel from the ``[project]`` table, the README as its description."""
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {version}",
        f"Summary: {project['description']}",
        f"License: {project['license']}",
        f"Requires-Python: {project['requires-python']}",
        *(f"Requires-Dist: {dependency}" for dependency in project["dependencies"]),
        "Description-Content-Type: text/markdown",
    ]
    return "\n".join(lines) + "\n\n" + (HERE / "README.md").read_text()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build(out: Path) -> Path:
    """Write the wheel into ``out``; returns its path."""
    project = tomllib.loads((HERE / "metadata.toml").read_text())["project"]
    name, release = project["name"].replace("-", "_"), version()
    dist_info = f"{name}-{release}.dist-info"
    files = package_files()
    files[f"{dist_info}/METADATA"] = metadata(project, release).encode()
    files[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: indexer-service clients/python/build.py\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n"
    )
    record = [f"{path},{_record_hash(data)},{len(data)}" for path, data in sorted(files.items())]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"{name}-{release}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in sorted(files.items(), key=lambda item: (item[0].startswith(dist_info), item[0])):
            entry = zipfile.ZipInfo(path, _EPOCH)
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, data, zipfile.ZIP_DEFLATED)
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python clients/python/build.py", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder the wheel is written to")
    print(build(parser.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
