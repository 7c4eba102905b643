"""Helpers of the other-language client tests (tests/system/test_clients_*.py, tests/system/test_proto_buf.py):
where the toolchains are, how the Go client is built, and the runnable blocks of docs/clients.md. The Go build
helpers also build the benchmarks' Go load generator (benchmarks/loadgen, tests/system/test_loadgen.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
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


def check_summary(run: subprocess.CompletedProcess, code_names: dict[str, str]) -> dict:
    """The JSON summary a client's check program printed, once the parts every client shares hold: every golden
    case ok (E1, E2 and E3 among them), a bad request's code and message, and health SERVING for the server and
    the service and not found for another. ``code_names`` spells INVALID_ARGUMENT and NOT_FOUND as that
    client's library does."""
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(run.stdout)
    assert summary["problems"] == []
    cases = summary["cases"]
    for example in ("E1", "E2", "E3"):
        assert any(name.startswith(example) for name in cases), cases
    assert set(cases.values()) == {"ok"}, cases
    assert summary["bad_request"] == {
        "code": code_names["INVALID_ARGUMENT"],
        "message": "seq_lens: byte length 3 is not a multiple of 4 (little-endian int32)",
    }
    assert summary["health"][""] == "SERVING"
    assert summary["health"]["indexer.v1.PrefillMetadata"] == "SERVING"
    assert summary["health"]["no.such.Service"] == code_names["NOT_FOUND"]
    return summary


def node_missing() -> str | None:
    """Why the Node client cannot run here, or None."""
    if shutil.which("node") is None:
        return f"node is not installed: {INSTALL_HINT}"
    for package in ("@grpc/grpc-js", "@grpc/proto-loader"):
        if not (NODE_DIR / "node_modules" / package).is_dir():
            return f"clients/node/node_modules lacks {package}: {INSTALL_HINT}"
    return None


def go_toolchain_missing(tools: Iterable[str], packages: Iterable[str]) -> str | None:
    """Why a GOPATH-mode build with these tools against these of Debian's Go packages cannot run here, or None."""
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} is not installed: {INSTALL_HINT}"
    for package in packages:
        if not (DEBIAN_GOPATH / "src" / package).is_dir():
            return f"{DEBIAN_GOPATH}/src/{package} is missing: {INSTALL_HINT}"
    return None


def go_missing() -> str | None:
    """Why the Go client cannot be built here, or None."""
    why = go_toolchain_missing(
        ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"),
        ("google.golang.org/grpc/health", "google.golang.org/protobuf/proto", "github.com/golang/protobuf/proto"),
    )
    if why:
        return why
    # golang-google-grpc-dev accepts golang/protobuf 1.3, which cannot marshal APIv2 messages: 1.5 has this file.
    if not (DEBIAN_GOPATH / "src/github.com/golang/protobuf/proto/registry.go").is_file():
        return f"github.com/golang/protobuf in {DEBIAN_GOPATH} is older than 1.5: {INSTALL_HINT}"
    return None


def go_grpc_missing() -> str | None:
    """Why a Go program of the standard library and gRPC alone (benchmarks/loadgen) cannot be built here, or None."""
    return go_toolchain_missing(["go"], ["google.golang.org/grpc"])


def go_build(directory: Path, package: str, output: Path, gopath: Path | None = None, **env: str) -> None:
    """``go build -o output package`` in ``directory``, in GOPATH mode: ``gopath`` (if any), then Debian's Go
    libraries; ``env`` adds to the environment (CGO_ENABLED, GOOS, ...). Go's build cache (GOCACHE, shared by
    every build of the run and later runs) makes a rebuild of unchanged code take seconds. A failed build raises
    RuntimeError with the compiler's output."""
    path = f"{gopath}:{DEBIAN_GOPATH}" if gopath else str(DEBIAN_GOPATH)
    base = {"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(Path.home()), "GO111MODULE": "off", "GOFLAGS": ""}
    run = subprocess.run(
        ["go", "build", "-o", str(output), package],
        cwd=directory,
        env={**base, "GOPATH": path, **env},
        timeout=600,
        capture_output=True,
        text=True,
    )
    if run.returncode:
        raise RuntimeError(f"go build {package} in {directory} failed:\n{run.stdout}{run.stderr}")


def build_go_client(workdir: Path) -> dict[str, Path]:
    """Generates the Go package from protos/ and builds cmd/check and cmd/example in a GOPATH under
    ``workdir``."""
    gopath = workdir / "gopath"
    source = gopath / "src" / GO_MODULE
    shutil.copytree(GO_DIR, source, ignore=shutil.ignore_patterns("indexer"))
    subprocess.run(["bash", str(source / "generate.sh"), str(PROTOS)], check=True, timeout=120)
    binaries = {name: workdir / f"go-{name}" for name in ("check", "example")}
    for name, binary in binaries.items():
        go_build(source, f"./cmd/{name}", binary, gopath)
    return binaries


_BLOCK = re.compile(r"<!-- (run|output|file): ([\w./-]+) -->\n```[\w]*\n(.*?)```", re.DOTALL)


def doc_blocks(path: Path = REPO / "docs" / "clients.md") -> dict[tuple[str, str], str]:
    """The marked code blocks of a document: {(kind, name): text}, kind in run, output, file."""
    return {(kind, name): text for kind, name, text in _BLOCK.findall(path.read_text())}
