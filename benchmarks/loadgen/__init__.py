"""The Go load generator (main.go) of the throughput benchmarks (bench_rpc, bench_workers, bench_shapes): how it
is built, its command line, and how a run's row is read and judged.

    python -m benchmarks.loadgen

builds a static linux/amd64 binary (CGO_ENABLED=0: it runs on any Linux x86-64 host, one without Go included)
at benchmarks/loadgen/bin/loadgen, in GOPATH mode against Debian's Go libraries, with the helpers the Go
client's build uses (testkit/gobuild.py); prints the binary's path. Where Go or Debian's gRPC is
missing it says so: scripts/install-client-tools.sh installs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from testkit.gobuild import static_binary
from testkit.harness import ServiceProcess
from testkit.record import note_pinned, process_name

HERE = Path(__file__).resolve().parent
BINARY = HERE / "bin" / "loadgen"
# A throughput benchmark's rule: a stray failed call (at most one in a thousand) is reported, more voids the run.
STRAY_FAILURES = 1 / 1000


def binary() -> Path:
    """The load generator's binary (testkit.gobuild.static_binary)."""
    return static_binary(HERE, BINARY, "Go load generator")


def command(
    binary: Path,
    addresses: Sequence[str],
    method: str,
    request_file: Path,
    in_flight: int,
    connections: int,
    seconds: float,
    start_at: float | None = None,
    window: int = 0,
) -> list[str]:
    """The command line of one run: ``in_flight`` calls of ``method`` (``request_file``'s bytes) over
    ``connections`` ClientConns to ``addresses`` (round_robin where several) for ``seconds``, from ``start_at``
    (Unix time) when given; with ``window`` (bytes) static receive windows in place of grpc-go's dynamic ones
    (main.go's ``-window``: why)."""
    flags = [
        f"-address={','.join(addresses)}",
        f"-method={method}",
        f"-request-file={request_file}",
        f"-in-flight={in_flight}",
        f"-connections={connections}",
        f"-seconds={seconds}",
        *([f"-start-at={start_at}"] if start_at is not None else []),
        *([f"-window={window}"] if window else []),
    ]
    return [str(binary), *flags]


def start(argv: list[str], cpus: Collection[int] | None = None) -> subprocess.Popen:
    """A client process (the load generator, or a benchmark's own Python client) on ``cpus`` when given, else
    where this process runs; its output captured for :func:`result`."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    if cpus:
        note_pinned(argv, cpus)  # the run record names what ran where
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pin)


def result(process: subprocess.Popen, seconds: float) -> dict:
    """The JSON row a client process of a ``seconds`` run prints last; the run ends here if it failed."""
    out, err = process.communicate(timeout=seconds + 120)
    if process.returncode:
        raise SystemExit(f"load generator exited {process.returncode}: {err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def judge_failures(
    calls: int, errors: Mapping[str, int], why: object, servers: Sequence[ServiceProcess], allowed: float
) -> int:
    """How many of ``calls`` failed (``errors``: by code; ``why``: their messages). Failures are printed with the
    servers' log lines other than INFO; more than ``allowed`` of the calls (a share: 0, none) end the run, whose
    figures would not measure serving."""
    failed = sum(errors.values())
    if failed:
        print(f"{failed} of {calls} calls failed: {dict(errors)} {why}; the servers logged:", file=sys.stderr)
        for server in servers:
            lines = [line for line in server.log().splitlines() if " INFO " not in line]
            print(f"{process_name(server.command)} at {server.address}:", file=sys.stderr)
            print("\n".join(lines[-40:]) or "(nothing)", file=sys.stderr)
        if failed > calls * allowed:
            raise SystemExit("too many calls failed: the figures would not measure serving")
    return failed


def run(
    binary: Path,
    servers: Sequence[ServiceProcess],
    method: str,
    request_file: Path,
    in_flight: int,
    connections: int,
    seconds: float,
    failures_allowed: float,
    cpus: Collection[int] | None = None,
    window: int = 0,
) -> dict:
    """One run of the load generator against ``servers`` (:func:`command`, on ``cpus`` when given, ``window`` its
    receive windows): its JSON row (calls, elapsed, errors, error_messages, p50_us, p99_us, per_connection_calls,
    per_address_calls), once :func:`judge_failures` has let ``failures_allowed`` (a share of the calls) pass."""
    addresses = [s.address for s in servers]
    argv = command(binary, addresses, method, request_file, in_flight, connections, seconds, window=window)
    row = result(start(argv, cpus), seconds)
    judge_failures(row["calls"], row["errors"], row["error_messages"], servers, failures_allowed)
    return row
