"""Build the light Python client distribution, ``indexer-service-client``: ``python clients/python/build.py OUT``.

Schedulers need the client, not the server: this wheel holds the client (``service/client.py``), the wire codec,
the request and result types and the generated protobuf code, and needs numpy, grpcio, grpcio-health-checking
and protobuf only (no torch, no Triton). It is made from the repository's own files, never a copy kept by hand:
the modules below are staged under the import name ``indexer_service_client`` (their ``indexer_service.``
imports rewritten to match, so it installs beside the server's ``indexer_service`` without sharing a file), then
``pip wheel`` builds it. tests/system/test_client_light.py installs the wheel alone in a fresh virtual environment and
calls a real server with it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PACKAGE = "indexer_service_client"
# The client's import closure, repository path -> path inside the package (tests/system/test_client_light.py proves it
# closed: the wheel imports in an environment that has nothing else of this project).
MODULES = {
    "service/client.py": "client.py",
    "service/codec.py": "codec.py",
    "kernels/inputs.py": "kernels/inputs.py",
    "kernels/formulas.py": "kernels/formulas.py",
    "kernels/planner.py": "kernels/planner.py",
    "kernels/specialization.py": "kernels/specialization.py",
    "protos/indexer/v1/indexer_pb2.py": "protos/indexer/v1/indexer_pb2.py",
    "protos/indexer/v1/indexer_pb2_grpc.py": "protos/indexer/v1/indexer_pb2_grpc.py",
    "protos/indexer/v1/indexer.proto": "protos/indexer/v1/indexer.proto",
}
# "from indexer_service.service import codec" -> "from indexer_service_client import codec";
# "from indexer_service.service.codec import X" -> "from indexer_service_client.codec import X";
# "from indexer_service.kernels.inputs import X" -> "from indexer_service_client.kernels.inputs import X".
_IMPORTS = re.compile(r"^(\s*)(from|import) indexer_service(\.service(?= import)|\.service\.|\.)", re.MULTILINE)


def _rewrite(match: re.Match) -> str:
    indent, keyword, rest = match.groups()
    return f"{indent}{keyword} {PACKAGE}{'' if rest == '.service' else '.'}"


def version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def stage(into: Path) -> Path:
    """The distribution's source tree under ``into``: pyproject.toml, README.md and the package."""
    package = into / PACKAGE
    for source, target in MODULES.items():
        path = package / target
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (REPO / source).read_text()
        if source.endswith(".py"):
            # service.client / service.codec sit at the package's top; the others keep their folders.
            text = _IMPORTS.sub(
                lambda m: f"{m.group(1)}{m.group(2)} {PACKAGE}{'' if m.group(3) == '.service' else '.'}", text
            )
        path.write_text(text)
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    (package / "__init__.py").write_text(
        '"""The indexer-service client (see client.py); built from the indexer-service repository."""\n\n'
        "from indexer_service_client.client import IndexerClient, tls_credentials\n"
        "from indexer_service_client.kernels.inputs import ChunkInputs, ChunkMetadata, DcpConfig\n"
        "from indexer_service_client.kernels.planner import BatchInputs, ChunkSpec, PrefillPlan\n\n"
        '__all__ = ["BatchInputs", "ChunkInputs", "ChunkMetadata", "ChunkSpec", "DcpConfig", "IndexerClient", '
        '"PrefillPlan", "tls_credentials"]\n'
    )
    pyproject = (HERE / "pyproject.toml.in").read_text().replace("@VERSION@", version())
    (into / "pyproject.toml").write_text(pyproject)
    shutil.copy(HERE / "README.md", into / "README.md")
    return into


def build(out: Path) -> Path:
    """Stage and build the wheel into ``out``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="client-build-") as scratch:
        source = stage(Path(scratch))
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), "."],
            cwd=source,
            check=True,
        )
    (wheel,) = out.glob(f"{PACKAGE}-{version()}-*.whl")
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python clients/python/build.py", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder the wheel is written to")
    print(build(parser.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
