"""Helpers of the other-language client tests (tests/system/test_clients_*.py, tests/system/test_proto_buf.py):
where the toolchains are, how the Go client is built, and the runnable blocks of docs/clients.md. The Go build
itself is testkit/gobuild.py's, which the benchmarks' Go load generator (benchmarks/loadgen) shares."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from testkit.gobuild import DEBIAN_GOPATH, INSTALL_HINT, go_build, go_toolchain_missing
from testkit.paths import REPO

PROTOS = REPO / "protos"
GOLDEN_FILE = REPO / "tests" / "data" / "golden-cases.json"

NODE_DIR = REPO / "clients" / "node"
GO_DIR = REPO / "clients" / "go"
GO_MODULE = "github.com/indexer-service/indexer-service/clients/go"
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


def build_go_client(workdir: Path) -> dict[str, Path]:
    """Generates the Go package from protos/ and builds cmd/check and cmd/example in a GOPATH under ``workdir``."""
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
