"""Throughput of one replica with N worker processes, against N times the 1-worker replica of the same run.

    python -m benchmarks.bench_workers [--workers 1,2] [--batches small-8,medium-64] [--seconds 2] [--rounds 3]
        [--loadgen go|python] [--pin-workers on|off] [--in-flight 32] [--connections C]
        [--clients P] [--out workers.json]

One server per N (``serve --workers N --backend numpy --warmup-target none``, bench_rpc's flags), all started
up front and measured in turn, round after round (each figure is the median of its rounds). The load is the
same for every N: 32 calls in flight in all over ``--connections`` connections (default 4 per largest N; the
kernel's SO_REUSEPORT hands each to one worker), each call on the connection with the fewest in flight, raw
request bytes out and response bytes back (no parsing: client CPU goes to calls). ``--loadgen go`` (default):
one process of the Go load generator (benchmarks/loadgen, built with ``python -m benchmarks.loadgen``; where Go
is missing, a binary built elsewhere and carried here; neither: a warning and the Python one). ``--loadgen
python``: ``--clients`` Python client processes (one would be the bottleneck) sharing the connections, with the
project's client pool (indexer_service.client.ChannelPool). Recorded per batch and N: calls/s, p50 at that load and
with one client (one call at a time), the CPU the replica used (supervisor and workers) in cores, which is what
the HPA sees, the load generator's CPU in cores, and each worker's CPU seconds (their spread is the imbalance).

Pinning: where the machine has at least twice the largest N in CPUs, the server of N workers runs on CPUs
0..N-1 (as a pod with N CPUs; ``workers`` = N) and the load generator on the others; otherwise nothing is pinned
and it shares the servers' cores (this 2-core machine: the figures then include its CPU). Inside a replica each
worker has a CPU of its own (the service's ``pin_workers on``; ``--pin-workers off`` lets them share).
Target: calls/s at 32 in flight with N workers >= 0.8 x N x one worker's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil

from benchmarks import loadgen
from benchmarks.bench_rpc import METHOD, SERVICE_FLAGS
from indexer_service.client import ChannelPool
from testkit.batches import request_files
from testkit.harness import ServiceProcess, channel, closed_loop, merged_counts, percentile_us, start_all
from testkit.record import write_json

IN_FLIGHT = 32  # the target's load
TARGET = 0.8


def client_main(address: str, request_file: str, threads: int, seconds: float, connections: int, start: float) -> None:
    """One client process: warm its connections, wait for ``start`` (epoch), then a closed loop of ``threads``
    calls in flight for ``seconds``; prints its call count, elapsed seconds, failed calls by code and the OK
    calls' seconds as JSON."""
    request = Path(request_file).read_bytes()
    options = [("grpc.enable_retries", 0), ("grpc.max_receive_message_length", 64 * 2**20)]
    pool = ChannelPool(lambda extra: grpc.insecure_channel(address, options=options + extra), connections)
    calls = [c.unary_unary(METHOD, request_serializer=None, response_deserializer=None) for c in pool.channels]

    def one(_: int) -> tuple[grpc.StatusCode, str]:
        index = pool.acquire()
        try:
            calls[index](request, timeout=60)
        finally:
            pool.release(index)
        return grpc.StatusCode.OK, ""

    for call in calls:  # every connection up before the clock starts
        call(request, timeout=60)
    time.sleep(max(0.0, start - time.time()))
    run = closed_loop(one, threads, max_calls=10**9, max_seconds=seconds)
    errors = {code: n for code, n in run.codes().items() if code != "OK"}
    print(
        json.dumps(
            {"calls": len(run.records), "elapsed": run.elapsed, "errors": errors, "latencies": run.latencies().tolist()}
        )
    )


def go_loadgen() -> Path | None:
    """The Go load generator's binary (benchmarks/loadgen); None, with a warning, when there is none."""
    try:
        return loadgen.binary()
    except RuntimeError as exc:
        print(f"warning: no Go load generator ({exc}); falling back to --loadgen python", file=sys.stderr)
        return None


def cpu_seconds(processes: list[psutil.Process]) -> dict[int, float]:
    """User + system CPU seconds by pid, of those still running."""
    seconds = {}
    for process in processes:
        try:
            times = process.cpu_times()
            seconds[process.pid] = times.user + times.system
        except psutil.Error:
            pass
    return seconds


def load(
    server: ServiceProcess,
    request_file: Path,
    seconds: float,
    connections: int,
    cpus,
    go: Path | None,
    clients: int,
    in_flight: int = IN_FLIGHT,
) -> dict:
    """One loaded phase: calls/s, p50, and the CPU of the replica, of each of its workers and of the load
    generator over the phase."""
    start = time.time() + 2.0
    if go:
        commands = [loadgen.command(go, [server.address], METHOD, request_file, in_flight, connections, seconds, start)]
    else:
        each = [request_file, in_flight // clients, seconds, max(1, connections // clients), start]
        commands = [
            [sys.executable, "-m", "benchmarks.bench_workers", "--client", server.address, *map(str, each)]
        ] * clients
    processes = [loadgen.start(c, cpus) for c in commands]
    cpu = {}

    def sample() -> None:  # CPU over the load's window
        time.sleep(max(0.0, start - time.time()) + 0.1)
        replica = psutil.Process(server.pid)
        workers = replica.children(recursive=True) or [replica]  # one worker: the server process serves
        generators = [psutil.Process(p.pid) for p in processes]
        begin, t0 = cpu_seconds([replica, *workers, *generators]), time.monotonic()
        time.sleep(seconds - 0.2)
        end, t1 = cpu_seconds([replica, *workers, *generators]), time.monotonic()
        used = {p: end[p] - begin[p] for p in begin.keys() & end.keys()}
        cpu["pod_cpu_cores"] = sum(used.get(p, 0.0) for p in {replica.pid, *(w.pid for w in workers)}) / (t1 - t0)
        cpu["loadgen_cpu_cores"] = sum(used.get(g.pid, 0.0) for g in generators) / (t1 - t0)
        cpu["worker_cpu_s"] = [used.get(w.pid, 0.0) for w in workers]

    sampler = threading.Thread(target=sample)
    sampler.start()
    results = [loadgen.result(process, seconds) for process in processes]
    sampler.join()
    calls = sum(r["calls"] for r in results)
    why = [r["error_messages"] for r in results if r.get("error_messages")]  # the Go load generator's
    errors = loadgen.judge_failures(
        calls, merged_counts(r["errors"] for r in results), why, [server], loadgen.STRAY_FAILURES
    )
    loaded_p50 = results[0]["p50_us"] if go else percentile_us(np.concatenate([r["latencies"] for r in results]), 50)
    rate = sum(r["calls"] / r["elapsed"] for r in results)
    return {"calls_per_s": rate, "loaded_p50_us": loaded_p50, "failed_calls": errors, **cpu}


def load_separate(
    servers: list[ServiceProcess],
    request_file: Path,
    seconds: float,
    connections: int,
    cpus,
    go,
    clients: int,
    in_flight: int,
) -> dict:
    """The issue's baseline layout, in the same run: N single-process servers, one CPU each, each loaded by its own
    load generator with its share of the calls in flight and of the connections; calls/s and CPU summed."""
    rows: list[dict] = [{} for _ in servers]

    def one(i: int) -> None:
        share = max(1, connections // len(servers))
        rows[i] = load(servers[i], request_file, seconds, share, cpus, go, clients, max(1, in_flight // len(servers)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(servers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "calls_per_s": sum(row["calls_per_s"] for row in rows),
        "pod_cpu_cores": sum(row["pod_cpu_cores"] for row in rows),
        "loadgen_cpu_cores": sum(row["loadgen_cpu_cores"] for row in rows),
        "failed_calls": sum(row["failed_calls"] for row in rows),
    }


def failed_calls(row: dict) -> int:
    """Calls of a measured phase that failed, the separate servers' included."""
    return row["failed_calls"] + row.get("separate", {}).get("failed_calls", 0)


def p50_one_client(address: str, request: bytes, seconds: float) -> float:
    with channel(address) as chan:
        call = chan.unary_unary(METHOD, request_serializer=None, response_deserializer=None)

        def one(_: int) -> tuple[grpc.StatusCode, str]:
            call(request, timeout=60)
            return grpc.StatusCode.OK, ""

        closed_loop(one, 1, max_calls=50, max_seconds=seconds)
        return percentile_us(closed_loop(one, 1, max_calls=5_000, max_seconds=seconds).latencies(), 50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts; 1 is always measured")
    parser.add_argument("--batches", default="small-8,medium-64", help="bench_kernel batches, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each loaded phase")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every N; figures are medians")
    parser.add_argument("--loadgen", choices=("go", "python"), default="go", help="the load generator")
    parser.add_argument(
        "--pin-workers", choices=("on", "off"), default="on", help="the servers' pin_workers (on: a CPU per worker)"
    )
    parser.add_argument(
        "--separate", action="store_true", help="also N single-process servers, a CPU and a load generator each"
    )
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="calls in flight in all (the target: 32)")
    parser.add_argument("--connections", type=int, default=0, help="connections in all (0: 4 per largest N)")
    parser.add_argument("--clients", type=int, default=0, help="python client processes (0: 8 pinned, else 2)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--client", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        address, request_file, threads, seconds, connections, start = args.client
        client_main(address, request_file, int(threads), float(seconds), int(connections), float(start))
        return

    counts = sorted({1, *(int(n) for n in args.workers.split(","))})
    cpus = sorted(os.sched_getaffinity(0))
    pin = len(cpus) >= 2 * max(counts)
    client_cpus = set(cpus[max(counts) :]) if pin else None
    connections = args.connections or 4 * max(counts)
    go = go_loadgen() if args.loadgen == "go" else None
    clients = 1 if go else args.clients or (min(8, len(client_cpus)) if pin else 2)
    batches = args.batches.split(",")
    results: dict[str, dict] = {b: {n: [] for n in counts} for b in batches}
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as scratch:
        requests = request_files(batches, Path(scratch))
        flags = (*SERVICE_FLAGS, "--backend", "numpy", "--pin-workers", args.pin_workers)
        servers = {n: ServiceProcess(*flags, "--workers", str(n), cpus=set(cpus[:n]) if pin else None) for n in counts}
        separate = {
            n: [ServiceProcess(*flags, "--workers", "1", cpus={cpus[i]} if pin else None) for i in range(n)]
            for n in (counts[1:] if args.separate else [])
        }
        every = [*servers.values(), *(s for group in separate.values() for s in group)]
        try:
            start_all(every)
            for r in range(args.rounds):
                for b in batches:
                    for n in counts:
                        row = load(
                            servers[n], requests[b], args.seconds, connections, client_cpus, go, clients, args.in_flight
                        )
                        row["p50_us"] = p50_one_client(servers[n].address, requests[b].read_bytes(), 1.0)
                        if n in separate:
                            row["separate"] = load_separate(
                                separate[n],
                                requests[b],
                                args.seconds,
                                connections,
                                client_cpus,
                                go,
                                clients,
                                args.in_flight,
                            )
                        results[b][n].append(row)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            for server in every:
                server.kill()

    generator = "the Go load generator" if go else f"{clients} Python client processes"
    where = (
        f"servers on CPUs 0..N-1, {generator} on the other {len(client_cpus)}"
        if pin
        else f"unpinned, {generator} sharing the servers' {len(cpus)} CPUs"
    )
    print(f"BuildChunk, numpy backend, {args.in_flight} in flight over {connections} connections; {where}")
    print(
        f"{'batch':10} {'workers':>7} {'calls/s':>10} {'x 1 worker':>10} {'/ (N x 1)':>10} {'p50 us':>8} "
        f"{'p50 1 cl':>8} {'pod cores':>9} {'gen cores':>9} {'spread (min..max calls/s)':>26}  worker CPU s"
    )
    summary: dict[str, dict] = {}
    for b in batches:
        base = float(np.median([row["calls_per_s"] for row in results[b][1]]))
        base_p50 = float(np.median([row["p50_us"] for row in results[b][1]]))
        summary[b] = {}
        for n in counts:
            rows = results[b][n]
            rate = float(np.median([row["calls_per_s"] for row in rows]))
            p50 = float(np.median([row["p50_us"] for row in rows]))
            loaded_p50 = float(np.median([row["loaded_p50_us"] for row in rows]))
            cores = float(np.median([row["pod_cpu_cores"] for row in rows]))
            generator_cores = float(np.median([row["loadgen_cpu_cores"] for row in rows]))
            low, high = min(row["calls_per_s"] for row in rows), max(row["calls_per_s"] for row in rows)
            workers_cpu = sorted(rows, key=lambda row: row["calls_per_s"])[len(rows) // 2]["worker_cpu_s"]
            efficiency = rate / (n * base)
            separate_rate = (
                float(np.median([row["separate"]["calls_per_s"] for row in rows])) if n in separate else None
            )
            summary[b][n] = {
                "calls_per_s": rate,
                "ratio": rate / base,
                "efficiency": efficiency,
                "p50_us": p50,
                "p50_ratio": p50 / base_p50,
                "loaded_p50_us": loaded_p50,
                "pod_cpu_cores": cores,
                "loadgen_cpu_cores": generator_cores,
                "worker_cpu_s": workers_cpu,
                "rounds": rows,
                "target_met": efficiency >= TARGET,
                "separate_calls_per_s": separate_rate,
                "failed_calls": sum(failed_calls(row) for row in rows),
            }
            verdict = "" if n == 1 else f"  target >= {TARGET}: {'met' if efficiency >= TARGET else 'MISSED'}"
            if separate_rate:
                verdict += (
                    f"; {n} separate servers {separate_rate:,.0f} calls/s ({separate_rate / (n * base):.2f} of Nx)"
                )
            print(
                f"{b:10} {n:>7} {rate:>10,.0f} {rate / base:>9.2f}x {efficiency:>9.2f}  {loaded_p50:>8,.0f} "
                f"{p50:>8,.0f} {cores:>9.2f} {generator_cores:>9.2f} {f'{low:,.0f}..{high:,.0f}':>26}  "
                f"{' '.join(f'{s:.2f}' for s in workers_cpu)}{verdict}"
            )
    meta = {"pinned": pin, "loadgen": "go" if go else "python", "clients": clients, "connections": connections}
    write_json(
        args.out, {**meta, "seconds": args.seconds, "rounds": args.rounds, "cpus": len(cpus), "batches": summary}
    )


if __name__ == "__main__":
    main()
