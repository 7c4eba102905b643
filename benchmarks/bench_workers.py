"""Throughput of one replica with N worker processes, against N times the 1-worker replica of the same run.

    python -m benchmarks.bench_workers [--workers 1,2] [--batches small-8,medium-64] [--seconds 2] [--rounds 3]
        [--clients P] [--connections 8] [--out workers.json]

One server per N (``serve --workers N --backend numpy --warmup-target none``, bench_rpc's flags), all started
up front and measured in turn, round after round (each figure is the median of its rounds). The load is the
same for every N: ``--clients`` client processes (the client is Python too, and one would be the bottleneck),
32 calls in flight in all, each process spreading its calls over ``--connections`` connections with the
project's client pool (service.client.ChannelPool: fewest in flight first), raw request bytes out and response
bytes back (no parsing: client CPU goes to calls). Also p50 with one client, one call at a time, and the CPU
the replica used (supervisor and workers) while loaded, in cores: what the HPA sees.

Pinning: where the machine has at least twice the largest N in CPUs, the server of N workers runs on CPUs
0..N-1 (as a pod with N CPUs; ``workers`` = N) and the clients on the others; otherwise nothing is pinned and the
clients share the servers' cores (this 2-core machine: the figures then include the client's CPU).
Target: calls/s at 32 in flight with N workers >= 0.8 x N x one worker's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil

from benchmarks.bench_rpc import METHOD, SERVICE_FLAGS
from indexer_service.service.client import ChannelPool
from indexer_service.service.codec import chunk_inputs_to_proto
from testkit.batches import make_inputs
from testkit.harness import ServiceProcess, channel, closed_loop, percentile_us, write_json

IN_FLIGHT = 32
TARGET = 0.8


def client_main(address: str, request_file: str, threads: int, seconds: float, connections: int, start: float) -> None:
    """One client process: warm its connections, wait for ``start`` (epoch), then a closed loop of ``threads``
    calls in flight for ``seconds``; prints its call count and elapsed seconds as JSON."""
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
    problems = run.problems()
    print(
        json.dumps(
            {
                "calls": len(run.records),
                "elapsed": run.elapsed,
                "problems": len(problems),
                "first_problem": problems[0].problem if problems else "",
            }
        )
    )


def pod_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its children (the supervisor and its workers)."""
    total = 0.0
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def load(address: str, request_file: Path, clients: int, seconds: float, connections: int, cpus, pid: int) -> dict:
    threads = IN_FLIGHT // clients
    start = time.time() + 2.0
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_workers",
        "--client",
        address,
        str(request_file),
        str(threads),
        str(seconds),
        str(connections),
        str(start),
    ]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=pin) for _ in range(clients)]
    cpu = {}

    def sample() -> None:  # the replica's CPU over the clients' window
        time.sleep(max(0.0, start - time.time()) + 0.1)
        cpu["begin"], cpu["t0"] = pod_cpu_seconds(pid), time.monotonic()
        time.sleep(seconds - 0.2)
        cpu["end"], cpu["t1"] = pod_cpu_seconds(pid), time.monotonic()

    sampler = threading.Thread(target=sample)
    sampler.start()
    results = [json.loads(p.communicate(timeout=seconds + 120)[0].strip().splitlines()[-1]) for p in processes]
    sampler.join()
    bad = [r for r in results if r["problems"]]
    if bad:
        raise SystemExit(f"calls failed: {bad[0]['first_problem']}")
    return {
        "calls_per_s": sum(r["calls"] / r["elapsed"] for r in results),
        "pod_cpu_cores": (cpu["end"] - cpu["begin"]) / (cpu["t1"] - cpu["t0"]),
    }


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
    parser.add_argument("--clients", type=int, default=0, help="client processes (0: 8 pinned, else 2)")
    parser.add_argument("--connections", type=int, default=8, help="connections per client process")
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
    clients = args.clients or (min(8, len(client_cpus)) if pin else 2)
    batches = args.batches.split(",")
    results: dict[str, dict] = {b: {n: [] for n in counts} for b in batches}
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as scratch:
        requests = {}
        for b in batches:
            requests[b] = Path(scratch) / f"{b}.request"
            requests[b].write_bytes(chunk_inputs_to_proto(make_inputs(b)).SerializeToString())
        flags = (*SERVICE_FLAGS, "--backend", "numpy")
        servers = {n: ServiceProcess(*flags, "--workers", str(n), cpus=set(cpus[:n]) if pin else None) for n in counts}
        try:
            for server in servers.values():
                server.start()
            for server in servers.values():
                server.wait_listening()
                server.wait_ready()
            for r in range(args.rounds):
                for b in batches:
                    for n in counts:
                        row = load(
                            servers[n].address,
                            requests[b],
                            clients,
                            args.seconds,
                            args.connections,
                            client_cpus,
                            servers[n].pid,
                        )
                        row["p50_us"] = p50_one_client(servers[n].address, requests[b].read_bytes(), 1.0)
                        results[b][n].append(row)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            for server in servers.values():
                server.kill()

    where = (
        f"servers on CPUs 0..N-1, {clients} client processes on the other {len(client_cpus)}"
        if pin
        else (f"unpinned, {clients} client processes sharing the servers' {len(cpus)} CPUs")
    )
    print(f"BuildChunk, numpy backend, {IN_FLIGHT} in flight, {args.connections} connections per client; {where}")
    print(
        f"{'batch':10} {'workers':>7} {'calls/s':>10} {'x 1 worker':>10} {'/ (N x 1)':>10} {'p50 us':>8} "
        f"{'pod cores':>9} {'spread (min..max calls/s)':>28}"
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
            cores = float(np.median([row["pod_cpu_cores"] for row in rows]))
            low, high = min(row["calls_per_s"] for row in rows), max(row["calls_per_s"] for row in rows)
            efficiency = rate / (n * base)
            summary[b][n] = {
                "calls_per_s": rate,
                "ratio": rate / base,
                "efficiency": efficiency,
                "p50_us": p50,
                "p50_ratio": p50 / base_p50,
                "pod_cpu_cores": cores,
                "rounds": rows,
                "target_met": efficiency >= TARGET,
            }
            verdict = "" if n == 1 else f"  target >= {TARGET}: {'met' if efficiency >= TARGET else 'MISSED'}"
            print(
                f"{b:10} {n:>7} {rate:>10,.0f} {rate / base:>9.2f}x {efficiency:>9.2f}  {p50:>8,.0f} "
                f"{cores:>9.2f} {f'{low:,.0f}..{high:,.0f}':>28}{verdict}"
            )
    meta = {"pinned": pin, "clients": clients, "connections": args.connections, "seconds": args.seconds}
    write_json(args.out, {**meta, "rounds": args.rounds, "cpus": len(cpus), "batches": summary})


if __name__ == "__main__":
    main()
