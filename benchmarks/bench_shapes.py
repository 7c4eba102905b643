"""Which deployment shape lets a client with one connection per address use every CPU it pays for.

    python -m benchmarks.bench_shapes [--n 2] [--batches small-8,medium-64] [--seconds 2] [--rounds 3]
        [--in-flight 32] [--out shapes.json]

A scheduler written the usual way in Go, Rust or Node (grpc-go, tonic, grpc-js; grpcio too) opens ONE HTTP/2
connection per address its resolver returns and spreads calls over them with ``round_robin``. Two shapes give
such a client N CPUs of serving:

- **pods**: N single-process servers (``--workers 1``: stand-ins for N pods of one CPU each behind a headless
  Service), all in the client's address list: one connection each;
- **replica**: one server of N worker processes (``--workers N``: one pod of N CPUs), one address: one
  connection, which the kernel's SO_REUSEPORT hands to one worker.

Each shape is driven twice by the Go load generator (benchmarks/loadgen) with ``-in-flight`` calls: as the usual
client (one ClientConn: round_robin over the addresses, one connection per address) and with many connections
(``4 x N`` ClientConns, each one connection per address, each call on the ClientConn with the fewest in
flight), the figure the CPUs can give. The ratio one-connection / many-connection is the share of the paid CPUs
the usual client reaches; the target is >= 0.8. Rounds alternate the shapes and the clients; each figure is the
median of its rounds. Servers and load generator share this machine's CPUs unless it has at least 2N + 1 CPUs,
where the servers get CPUs 0..N-1 (one each, as a pod would) and the load generator the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import loadgen
from benchmarks.bench_rpc import METHOD, SERVICE_FLAGS
from testkit.batches import request_files
from testkit.harness import ServiceProcess, start_all
from testkit.record import write_json

TARGET = 0.8
MANY_PER_ADDRESS = 4


def drive(binary: Path, servers: list[ServiceProcess], client_conns: int, request: Path, args, cpus) -> dict:
    """One phase of the Go load generator over ``servers`` with ``client_conns`` ClientConns. A stray failed call
    (at most one in a thousand) is recorded and its servers' log lines printed; more ends the run."""
    result = loadgen.run(
        binary, servers, METHOD, request, args.in_flight, client_conns, args.seconds, loadgen.STRAY_FAILURES, cpus
    )
    return {
        "calls_per_s": result["calls"] / result["elapsed"],
        "p50_us": result["p50_us"],
        "per_address_calls": result["per_address_calls"],
        "failed_calls": sum(result["errors"].values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2, help="CPUs paid for: pods of one worker, or workers of a pod")
    parser.add_argument("--batches", default="small-8,medium-64", help="bench_kernel batches, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each loaded phase")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians")
    parser.add_argument("--in-flight", type=int, default=32, help="calls in flight in all")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    try:
        binary = loadgen.binary()
    except RuntimeError as exc:
        raise SystemExit(f"bench_shapes needs the Go load generator: {exc}") from None
    n = args.n
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2 * n + 1
    client_cpus = set(cpus[n:]) if pinned else None
    flags = (*SERVICE_FLAGS, "--backend", "numpy")
    pods = [ServiceProcess(*flags, "--workers", "1", cpus={cpus[i]} if pinned else None) for i in range(n)]
    pin = "on" if pinned else "off"
    replica = ServiceProcess(*flags, f"--workers={n}", f"--pin-workers={pin}", cpus=set(cpus[:n]) if pinned else None)
    shapes = {"pods": pods, "replica": [replica]}
    batches = args.batches.split(",")
    rows: dict[str, dict[str, dict[str, list[dict]]]] = {
        b: {s: {"one": [], "many": []} for s in shapes} for b in batches
    }
    with tempfile.TemporaryDirectory(prefix="bench-shapes-") as scratch:
        requests = request_files(batches, Path(scratch))
        every = [*pods, replica]
        try:
            start_all(every)
            for r in range(args.rounds):
                order = list(shapes) if r % 2 == 0 else list(reversed(shapes))
                for b in batches:
                    for shape in order:
                        many = MANY_PER_ADDRESS * n
                        for client, conns in (
                            (("one", 1), ("many", many)) if r % 2 == 0 else (("many", many), ("one", 1))
                        ):
                            rows[b][shape][client].append(
                                drive(binary, shapes[shape], conns, requests[b], args, client_cpus)
                            )
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
                time.sleep(0.5)
        finally:
            for server in every:
                server.kill()

    where = "servers on CPUs 0..N-1, the load generator on the others" if pinned else f"unpinned on {len(cpus)} CPUs"
    print(f"BuildChunk, numpy backend, N = {n}, {args.in_flight} in flight; {where}")
    print(
        f"{'batch':10} {'shape':8} {'one conn/address':>17} {'many conns':>11} {'ratio':>6}  "
        "calls per server address (one)"
    )
    summary: dict[str, dict] = {}
    for b in batches:
        summary[b] = {}
        for shape in shapes:
            one = float(np.median([row["calls_per_s"] for row in rows[b][shape]["one"]]))
            many = float(np.median([row["calls_per_s"] for row in rows[b][shape]["many"]]))
            spread = rows[b][shape]["one"][-1]["per_address_calls"]
            summary[b][shape] = {
                "one_connection_per_address_calls_per_s": one,
                "many_connections_calls_per_s": many,
                "ratio": one / many,
                "target_met": one / many >= TARGET,
                "failed_calls": sum(
                    row["failed_calls"] for client in ("one", "many") for row in rows[b][shape][client]
                ),
                "rounds": rows[b][shape],
            }
            verdict = "met" if one / many >= TARGET else "MISSED"
            print(
                f"{b:10} {shape:8} {one:>17,.0f} {many:>11,.0f} {one / many:>6.2f}  {spread}  "
                f"target >= {TARGET}: {verdict}"
            )
    write_json(args.out, {"n": n, "pinned": pinned, "cpus": len(cpus), "seconds": args.seconds, "batches": summary})


if __name__ == "__main__":
    main()
