"""The Go echo server (main.go) of benchmarks/bench_rpc.py, and how it is built.

    python -m benchmarks.goecho

builds a static linux/amd64 binary at benchmarks/goecho/bin/goecho, as benchmarks/loadgen builds its own (GOPATH
mode against Debian's Go libraries, testkit/gobuild.py), and prints its path.
"""

from __future__ import annotations

import sys
from pathlib import Path

from testkit.gobuild import go_build, go_grpc_missing

HERE = Path(__file__).resolve().parent
BINARY = HERE / "bin" / "goecho"


def binary() -> Path:
    """The echo's binary: built here where Go is, else one built elsewhere and carried here; RuntimeError says
    why there is neither."""
    why = go_grpc_missing()
    if why and BINARY.is_file():
        print(f"Go echo: {BINARY} as it is ({why})", file=sys.stderr)
        return BINARY
    if why:
        raise RuntimeError(why)
    go_build(HERE, ".", BINARY, CGO_ENABLED="0", GOOS="linux", GOARCH="amd64")
    return BINARY
