"""Where a BuildChunk call's server CPU goes beyond grpcio's own: the real service with its per-call parts cut away,
layer by layer, beside bench_rpc's echo, in the same alternating rounds.

    python -m benchmarks.bench_ablation [--batches small-8,medium-64] [--rounds 6] [--seconds 2] [--out f.json]

The servers, each a process of its own on CPU 0 (the Go load generator on the other CPUs), measured as bench_rpc
measures (p50 with one call at a time; calls/s and server CPU per call at 8 and 32 in flight over 4 connections;
each figure the median of its rounds, the order turning by one each round; the JSON keeps every round):

- ``echo``: bench_rpc's baseline, grpcio's sync server with the service's settings and its stock thread pool,
  answering each request with the service's recorded response bytes;
- ``service``: the service as shipped (numpy backend, the compiled fast path serving these calls);
- ``unbudgeted``: the service with the compiled fast path's admission doing nothing, so its answers take no response
  budget ticket (nor the drain watch and the release that come with one): beside the layers below, what the ticket's
  life costs a call;
- ``plane``: the service's program with each PrefillMetadata call's gRPC behaviour only the data plane's call: no
  request id (nor its trailer), no caller (deadline, cancel callback), no drain watch; the answer's budget ticket
  is released as the data plane returns;
- ``compute``: BuildChunk's behaviour only the compiled fast path's answer: no data plane (metrics, admission,
  readiness);
- ``cached``: the behaviour returns the answer recorded for the request: the service's own server (its RPC pool,
  registered handlers, listeners and threads) with nothing done per call.

So ``cached`` against ``echo`` is the server around the calls (the RPC pool, registered rather than generic
handlers, the service's concurrency limit in its pool rather than grpcio's), ``compute`` against ``cached`` the
answer's computation, ``plane`` against ``compute`` the data plane's bookkeeping, ``service`` against ``plane`` the
gRPC transport's, and ``service`` against ``unbudgeted`` the budget ticket's life: the table's last column. Every
server but the echo runs this module's server mode (``--serve``:
``indexer-service serve`` with the named behaviours put in before the server is built; one process, as
``clean_env`` asks), so they differ only in their behaviours, and each answers the service's bytes (checked before
the rounds). No target: it says where to look (benchmarks/history.md: the runs of 2026-12-06).
tests/system/test_loadgen.py runs one short round.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

# The server mode imports only what `indexer-service serve` does: the benchmark's own imports (bench_rpc, testkit)
# are made in main(), so the servers compared differ in their behaviours alone.

# The layers, each server the one above with a layer cut away, then the one cut across them.
LAYERS = ("plane", "compute", "cached")
CUTS = (*LAYERS, "unbudgeted")
SERVERS = ("echo", "service", *CUTS)


def cut_behaviours(cut: str) -> None:
    """Replace the gRPC behaviour of the PrefillMetadata methods (``compute``: BuildChunk's only) with ``cut``'s, for
    the servers built after this in this process; refusing twins and unknown methods stay as shipped.
    ``unbudgeted`` keeps the shipped behaviours and gives the data plane a fast-path admission that admits without
    a ticket."""
    from indexer_service.service.transport import grpc_calls

    shipped = grpc_calls.served

    def admit_without_ticket(response_bytes: int, answer_bytes: int) -> None:
        return None

    def served(plane, method: str, serve: Callable, watchdog, started) -> Callable:
        if cut == "unbudgeted" and plane._build_chunk_fast is not None:
            plane._admit_fast = admit_without_ticket
        if serve != plane.call or cut == "unbudgeted" or (cut == "compute" and method != "BuildChunk"):
            return shipped(plane, method, serve, watchdog, started)
        if cut == "plane":
            call = plane.call

            def behavior(request: bytes, context: object) -> bytes:
                started.value = True  # the RPC pool's "started" flag, as the shipped behaviour sets it
                return call(method, request)

        elif cut == "compute":
            build, limits = plane._build_chunk_fast, plane._fast_limits
            if build is None:
                raise SystemExit("--serve compute: this server has no compiled fast path")

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

    grpc_calls.served = served


def serve(server: str, serve_args: list[str]) -> int:
    """``indexer-service serve SERVE_ARGS`` with ``server``'s behaviours (``service``: as shipped)."""
    from indexer_service.service.process.cli import main

    if server != "service":
        cut_behaviours(server)
    return main(["serve", *serve_args])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="bound of each measured phase of a round")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per batch")
    parser.add_argument("--batches", default="small-8,medium-64", help="which batches, comma-separated")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--serve", choices=SERVERS[1:], help=argparse.SUPPRESS)
    parser.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        sys.exit(serve(args.serve, args.serve_args))

    from benchmarks import loadgen
    from benchmarks.bench_rpc import (
        BATCHES,
        IN_FLIGHT,
        alternate,
        check_same_answers,
        pin_servers,
        record_responses,
        service_flags,
        start_echo,
    )
    from testkit.harness import ServiceProcess, clean_env, listen_flags
    from testkit.record import write_json

    def start(server: str) -> ServiceProcess:
        command = [sys.executable, "-m", "benchmarks.bench_ablation", "--serve", server, "--", *listen_flags()]
        return stack.enter_context(
            ServiceProcess(*service_flags("numpy"), command=command, cpus=server_cpus, env=clean_env())
        )

    server_cpus = pin_servers(True)
    results: dict[str, dict] = {}
    per_round: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ablation-") as scratch, ExitStack() as stack:
        canned = Path(scratch)
        service = start("service")
        record_responses(service, canned)
        cuts = {cut: start(cut) for cut in CUTS}
        for cut, process in cuts.items():
            check_same_answers(process, canned, cut)
        servers = {"echo": start_echo(stack, canned, server_cpus), "service": service, **cuts}
        binary = loadgen.binary()
        for name in args.batches.split(","):
            request_file = canned / f"{BATCHES.index(name)}.request"
            results[name], per_round[name] = alternate(binary, servers, request_file, args.rounds, args.seconds)
            print(f"measured {name}", file=sys.stderr)

    loaded = IN_FLIGHT[-1]
    cpu = f"server_cpu_us_per_call_{loaded}"
    print(f"BuildChunk over gRPC on 127.0.0.1: the service with its per-call parts cut away ({args.rounds} rounds)")
    print(
        f"{'batch':10} {'server':10} {'p50 us':>8} {'/echo':>6} {f'calls/s @{loaded}':>14} {'/echo':>6}"
        f" {f'cpu us/call @{loaded}':>19} {'layer':>7}"
    )
    layer_below = dict(zip(("service", *LAYERS), (*LAYERS, "echo"), strict=True))
    for name, rows in results.items():
        echo_row = rows["echo"]
        for server in SERVERS:
            row = rows[server]
            # the layer's own CPU per call: this server's less the next one down's (cached: less the echo's); for
            # unbudgeted, the service's less its own (what the ticket costs)
            if server == "unbudgeted":
                own = rows["service"][cpu] - row[cpu]
            elif server == "echo":
                own = None
            else:
                own = row[cpu] - rows[layer_below[server]][cpu]
            print(
                f"{name:10} {server:10} {row['p50_us']:>8,.0f} {row['p50_us'] / echo_row['p50_us']:>5.2f}x"
                f" {row[f'calls_per_s_{loaded}']:>14,.0f}"
                f" {row[f'calls_per_s_{loaded}'] / echo_row[f'calls_per_s_{loaded}']:>5.2f}x"
                f" {row[cpu]:>19,.1f} {'' if own is None else f'{own:+.1f}':>7}"
            )
    write_json(
        args.out,
        {
            "pinned": server_cpus is not None,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "batches": results,
            "per_round": per_round,
        },
    )


if __name__ == "__main__":
    main()
