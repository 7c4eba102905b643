"""Helpers of the other-language client tests (tests/system/test_clients_*.py, tests/system/test_proto_buf.py):
where the toolchains are, how the Go client is built, and the runnable blocks of docs/clients.md."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from testkit.paths import REPO

PROTOS = REPO / "protos"
GOLDEN_FILE = REPO / "tests" / "data" / "golden-cases.json"
INSTALL_HINT = "run scripts/install-client-tools.sh (make test does)"

NODE_DIR = REPO / "clients" / "node"
GO_DIR = REPO / "clients" / "go"
GO_MODULE = "github.com/indexer-service/indexer-service/clients/go"
# Debian's Go libraries for GOPATH builds (golang-google-grpc-dev and friends).
DEBIAN_GOPATH = Path("/usr/share/gocode")
BUF = REPO / "tools" / "buf" / "node_modules" / ".bin" / "buf"
VENV_BIN = Path(sys.executable).parent


def node_missing() -> str | None:
    """Why the Node client cannot run here, or None."""
    if shutil.which("node") is None:
        return f"node is not installed: {INSTALL_HINT}"
    for package in ("@grpc/grpc-js", "@grpc/proto-loader"):
        if not (NODE_DIR / "node_modules" / package).is_dir():
            return f"clients/node/node_modules lacks {package}: {INSTALL_HINT}"
    return None


def go_missing() -> str | None:
    """Why the Go client cannot be built here, or None."""
    for tool in ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: {INSTALL_HINT}"
    for package in (
        "google.golang.org/grpc/health",
        "google.golang.org/protobuf/proto",
        "github.com/golang/protobuf/proto",
    ):
        if not (DEBIAN_GOPATH / "src" / package).is_dir():
            return f"{DEBIAN_GOPATH}/src/{package} is missing: {INSTALL_HINT}"
    # golang-google-grpc-dev accepts golang/protobuf 1.3, which cannot marshal APIv2 messages: 1.5 has this file.
    if not (DEBIAN_GOPATH / "src/github.com/golang/protobuf/proto/registry.go").is_file():
        return f"github.com/golang/protobuf in {DEBIAN_GOPATH} is older than 1.5: {INSTALL_HINT}"
    return None


def build_go_client(workdir: Path) -> dict[str, Path]:
    """Generates the Go package from protos/ and builds cmd/check and cmd/example in a GOPATH under
    ``workdir``; Go's build cache (GOCACHE, shared by every build of the run and later runs) makes a rebuild of
    unchanged code take seconds."""
    gopath = workdir / "gopath"
    source = gopath / "src" / GO_MODULE
    shutil.copytree(GO_DIR, source, ignore=shutil.ignore_patterns("indexer"))
    subprocess.run(["bash", str(source / "generate.sh"), str(PROTOS)], check=True, timeout=120)
    env = {
        "PATH": "/usr/bin:/bin:/usr/local/bin",
        "HOME": str(Path.home()),
        "GO111MODULE": "off",
        "GOPATH": f"{gopath}:{DEBIAN_GOPATH}",
        "GOFLAGS": "",
    }
    binaries = {}
    for name in ("check", "example"):
        binaries[name] = workdir / f"go-{name}"
        subprocess.run(
            ["go", "build", "-o", str(binaries[name]), f"./cmd/{name}"],
            cwd=source,
            env=env,
            check=True,
            timeout=600,
            capture_output=True,
        )
    return binaries


_BLOCK = re.compile(r"<!-- (run|output|file): ([\w./-]+) -->\n```[\w]*\n(.*?)```", re.DOTALL)


def doc_blocks(path: Path = REPO / "docs" / "clients.md") -> dict[tuple[str, str], str]:
    """The marked code blocks of a document: {(kind, name): text}, kind in run, output, file."""
    return {(kind, name): text for kind, name, text in _BLOCK.findall(path.read_text())}
