"""The Go load generator (main.go) of benchmarks/bench_workers.py, and how it is built.

    python -m benchmarks.loadgen

builds a static linux/amd64 binary (CGO_ENABLED=0: it runs on any Linux x86-64 host, one without Go included)
at benchmarks/loadgen/bin/loadgen, in GOPATH mode against Debian's Go libraries, with the helpers the Go
client's build uses (testkit/gobuild.py); prints the binary's path. Where Go or Debian's gRPC is
missing it says so: scripts/install-client-tools.sh installs them.
"""

from __future__ import annotations

from pathlib import Path

from testkit.gobuild import static_binary

HERE = Path(__file__).resolve().parent
BINARY = HERE / "bin" / "loadgen"


def binary() -> Path:
    """The load generator's binary (testkit.gobuild.static_binary)."""
    return static_binary(HERE, BINARY, "Go load generator")
