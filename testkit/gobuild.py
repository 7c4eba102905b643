"""Building Go programs in GOPATH mode against Debian's Go libraries: the Go client's tests
(tests/system/clients_support.py) and the benchmarks' load generator (benchmarks/loadgen) share it, so it lives
here, where tests and benchmarks may both import it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

INSTALL_HINT = "run scripts/install-client-tools.sh (make test does)"
# Debian's Go libraries for GOPATH builds (golang-google-grpc-dev and friends).
DEBIAN_GOPATH = Path("/usr/share/gocode")


def go_toolchain_missing(tools: Iterable[str], packages: Iterable[str]) -> str | None:
    """Why a GOPATH-mode build with these tools against these of Debian's Go packages cannot run here, or None."""
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} is not installed: {INSTALL_HINT}"
    for package in packages:
        if not (DEBIAN_GOPATH / "src" / package).is_dir():
            return f"{DEBIAN_GOPATH}/src/{package} is missing: {INSTALL_HINT}"
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


def static_binary(directory: Path, binary: Path, label: str) -> Path:
    """``binary``, a static linux/amd64 build of the Go program in ``directory`` (CGO_ENABLED=0: it runs on any Linux
    x86-64 host, one without Go included): built here where Go is, else one built elsewhere and carried here (the
    GPU machine has no Go); RuntimeError says why there is neither."""
    why = go_grpc_missing()
    if why and binary.is_file():
        print(f"{label}: {binary} as it is ({why})", file=sys.stderr)
        return binary
    if why:
        raise RuntimeError(why)
    go_build(directory, ".", binary, CGO_ENABLED="0", GOOS="linux", GOARCH="amd64")
    return binary
