"""The Go load generator (main.go) of benchmarks/bench_workers.py, and how it is built.

    python -m benchmarks.loadgen

builds a static linux/amd64 binary (CGO_ENABLED=0: it runs on any Linux x86-64 host, one without Go included)
at benchmarks/loadgen/bin/loadgen, in GOPATH mode against Debian's Go libraries, with the helpers the Go
client's build uses (testkit/gobuild.py); prints the binary's path. Where Go or Debian's gRPC is
missing it says so: scripts/install-client-tools.sh installs them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from testkit.gobuild import go_build, go_grpc_missing

HERE = Path(__file__).resolve().parent
BINARY = HERE / "bin" / "loadgen"


def missing() -> str | None:
    """Why the load generator cannot be built here, or None."""
    return go_grpc_missing()


def build() -> Path:
    """Builds :data:`BINARY` (seconds once Go's build cache is warm); RuntimeError says why it cannot."""
    why = missing()
    if why:
        raise RuntimeError(why)
    go_build(HERE, ".", BINARY, CGO_ENABLED="0", GOOS="linux", GOARCH="amd64")
    return BINARY


def binary() -> Path:
    """The load generator's binary: built here where Go is, else one built elsewhere and carried here (a host
    without Go); RuntimeError says why there is neither."""
    why = missing()
    if why and BINARY.is_file():
        print(f"Go load generator: {BINARY} as it is ({why})", file=sys.stderr)
        return BINARY
    return build()
