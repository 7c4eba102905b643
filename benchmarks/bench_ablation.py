"""Where a BuildChunk call's server CPU goes beyond grpcio's own: the real service with its per-call parts cut away,
layer by layer, beside bench_rpc's echo, in the same alternating rounds.

    python -m benchmarks.bench_ablation [--batches small-8,medium-64] [--rounds 6] [--seconds 2] [--out f.json]

The servers, each a process of its own on CPU 0 (the Go load generator on the other CPUs), measured as bench_rpc
measures (p50 with one call at a time; calls/s and server CPU per call at 8 and 32 in flight over 4 connections;
each figure the median of its rounds):

- ``echo``: bench_rpc's baseline, grpcio's sync server with the service's settings and its stock thread pool,
  answering each request with the service's recorded response bytes;
- ``service``: the service as shipped (numpy backend, the compiled fast path serving these calls);
- ``plane``: the same process, each call's gRPC behaviour only the data plane's call: no request id (nor its
  trailer), no caller (deadline, cancel callback), no drain watch; the answer's budget ticket is released as the
  data plane returns;
- ``compute``: the behaviour only the compiled fast path's answer: no data plane (metrics, admission, readiness);
- ``cached``: the behaviour returns the answer recorded for the request: the service's own server (its RPC pool,
  registered handlers, listeners and threads) with nothing done per call.

So ``cached`` against ``echo`` is the server around the calls, ``compute`` against ``cached`` the answer's
computation, ``plane`` against ``compute`` the data plane's bookkeeping, ``service`` against ``plane`` the gRPC
transport's. The cut servers answer the same bytes (checked before the rounds) and are never shipped: each is
``serve`` with the gRPC behaviours replaced before the server is built (``--serve-cut``). No target: it says where
to look (issue 20, benchmarks/RESULTS.md). tests/system/test_loadgen.py runs each cut server once.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from benchmarks import loadgen
from benchmarks.bench_rpc import BATCHES, IN_FLIGHT, measure, median_row, record_responses, service_flags
from testkit.harness import ServiceProcess, clean_env, listen_flags, write_json

CUTS = ("plane", "compute", "cached")
SERVERS = ("echo", "service", *CUTS)


def cut_behaviours(cut: str) -> None:
    """Replace the gRPC behaviour of every PrefillMetadata method (not their refusing twins, not unknown methods)
    with ``cut``'s, for the server built after this in this process."""
    from indexer_service.service.transport import grpc_server

    shipped = grpc_server.served

    def served(plane, method: str, serve: Callable, watchdog, started) -> Callable:
        if serve != plane.call:  # a refusing twin, an unknown method: as shipped
            return shipped(plane, method, serve, watchdog, started)
        if cut == "plane":
            call = plane.call

            def behavior(request: bytes, context: object) -> bytes:
                started.value = True
                return call(method, request)

        elif cut == "compute":
            build, limits = plane._build_chunk_fast, plane._fast_limits
            if build is None:
                raise SystemExit("--serve-cut compute: this server has no compiled fast path")

            def behavior(request: bytes, context: object) -> bytes:
                started.value = True
                return build(request, limits, None)[0]

        else:
            answers: dict[bytes, bytes] = {}

            def behavior(request: bytes, context: object) -> bytes:
                started.value = True
                answer = answers.get(request)
                if answer is None:
                    answer = answers[request] = plane.call(method, request)
                return answer

        return behavior

    grpc_server.served = served


def serve_cut(cut: str, serve_args: list[str]) -> int:
    """``indexer-service serve SERVE_ARGS`` with ``cut``'s behaviours."""
    from indexer_service.service.process.cli import main

    cut_behaviours(cut)
    return main(["serve", *serve_args])


def cut_server(cut: str, cpus: set[int] | None) -> ServiceProcess:
    command = [sys.executable, "-m", "benchmarks.bench_ablation", "--serve-cut", cut, "--", *listen_flags()]
    return ServiceProcess(*service_flags("numpy"), command=command, cpus=cpus, env=clean_env())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="bound of each measured phase of a round")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per batch")
    parser.add_argument("--batches", default="small-8,medium-64", help="which batches, comma-separated")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--serve-cut", choices=CUTS, help=argparse.SUPPRESS)
    parser.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_cut:
        sys.exit(serve_cut(args.serve_cut, args.serve_args))

    pin = len(os.sched_getaffinity(0)) >= 2
    server_cpus = {min(os.sched_getaffinity(0))} if pin else None
    if pin:
        os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - server_cpus)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ablation-") as scratch, ExitStack() as stack:
        canned = Path(scratch)
        service = stack.enter_context(ServiceProcess(*service_flags("numpy"), cpus=server_cpus))
        record_responses(service, canned)
        cuts = {cut: stack.enter_context(cut_server(cut, server_cpus)) for cut in CUTS}
        for cut, process in cuts.items():  # the same bytes as the service's, or the figures mean nothing
            answers = Path(scratch) / cut
            answers.mkdir()
            record_responses(process, answers)
            for n in range(len(BATCHES)):
                if (answers / f"{n}.response").read_bytes() != (canned / f"{n}.response").read_bytes():
                    raise SystemExit(f"--serve-cut {cut} answered {BATCHES[n]} with other bytes than the service")
        echo_command = [sys.executable, "-m", "benchmarks.bench_rpc", "--serve-echo", str(canned)]
        echo = stack.enter_context(ServiceProcess(command=echo_command, cpus=server_cpus, env=clean_env()))
        servers = {"echo": echo, "service": service, **cuts}
        binary = loadgen.binary()
        for name in args.batches.split(","):
            n = BATCHES.index(name)
            rounds: dict[str, list] = {server: [] for server in servers}
            for _ in range(args.rounds):
                for server, process in servers.items():
                    rounds[server].append(measure(binary, process, canned / f"{n}.request", args.seconds))
            results[name] = {server: median_row(rows) for server, rows in rounds.items()}
            print(f"measured {name}", file=sys.stderr)

    loaded = IN_FLIGHT[-1]
    cpu = f"server_cpu_us_per_call_{loaded}"
    print(f"BuildChunk over gRPC on 127.0.0.1: the service with its per-call parts cut away ({args.rounds} rounds)")
    print(
        f"{'batch':10} {'server':8} {'p50 us':>8} {'/echo':>6} {f'calls/s @{loaded}':>14} {'/echo':>6}"
        f" {f'cpu us/call @{loaded}':>19} {'-next':>6}"
    )
    for name, rows in results.items():
        echo_row = rows["echo"]
        for i, server in enumerate(SERVERS):
            row = rows[server]
            below = rows[SERVERS[i + 1]][cpu] if 0 < i < len(SERVERS) - 1 else None  # its layer's own cost
            print(
                f"{name:10} {server:8} {row['p50_us']:>8,.0f} {row['p50_us'] / echo_row['p50_us']:>5.2f}x"
                f" {row[f'calls_per_s_{loaded}']:>14,.0f}"
                f" {row[f'calls_per_s_{loaded}'] / echo_row[f'calls_per_s_{loaded}']:>5.2f}x"
                f" {row[cpu]:>19,.1f} {'' if below is None else f'{row[cpu] - below:+.1f}':>6}"
            )
    write_json(args.out, {"pinned": pin, "seconds": args.seconds, "rounds": args.rounds, "batches": results})


if __name__ == "__main__":
    main()
