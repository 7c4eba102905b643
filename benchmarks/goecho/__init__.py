"""The Go echo server (main.go) of benchmarks/bench_rpc.py, and how it is built.

    python -m benchmarks.goecho

builds a static linux/amd64 binary at benchmarks/goecho/bin/goecho, as benchmarks/loadgen builds its own (GOPATH
mode against Debian's Go libraries, testkit/gobuild.py), and prints its path.
"""

from __future__ import annotations

from pathlib import Path

from testkit.gobuild import static_binary

HERE = Path(__file__).resolve().parent
BINARY = HERE / "bin" / "goecho"


def binary() -> Path:
    """The echo's binary (testkit.gobuild.static_binary)."""
    return static_binary(HERE, BINARY, "Go echo")
