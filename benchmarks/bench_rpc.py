"""End-to-end RPC latency and throughput of BuildChunk on 127.0.0.1, against a bare gRPC echo of the same bytes.

    python -m benchmarks.bench_rpc [--seconds 1] [--rounds 5] [--backend numpy|triton|auto[,...]] [--no-pin]
        [--loadgen-window BYTES] [--out rpc.json] [--plot rpc.png]

Batches: bench_kernel's small (8 requests, 352 query tokens), medium (64, 8,886) and large (256, 65,956) at ratio
4, each sent whole as one chunk (``--batches`` picks some). Per batch: p50 and p99 with one call at a time, then
calls/s and the server's CPU per call (user + system from /proc, microseconds) with 8 and 32 calls in flight over
4 connections, each phase ``--seconds`` long; echo and service alternate for ``--rounds`` rounds (their order turning
by one each round) and each figure is the median of its rounds (this machine is shared and noisy); the verdicts are
on those medians, and a ``rounds`` line under each service shows the same ratios round by round (the lowest, the
highest, and in how many rounds the target held), which the JSON keeps with every round's figures. The client is
the Go load generator (benchmarks/loadgen, ``python -m benchmarks.loadgen`` builds it), request bytes out and
response bytes back: a Python client saturated before either server did and hid the service's per-call cost
(0.9-1.1x the echo against 0.70x with Go on the H200 host). ``--loadgen-window BYTES`` gives its connections static
receive windows (BDP estimation off): Debian's grpc-go fails about one medium call in 10,000 on the GPU machine's
Xeon with a client-side "unexpected EOF" under its dynamic windows (benchmarks/loadgen/main.go says why), and a
latency benchmark allows no failed call.

Beside it, the stack's limit: a grpc-go echo of the same bytes (benchmarks/goecho, built like the load generator)
on the same CPU, printed with its ratios to the Python echo and no target.

Baseline, measured in the same run: an echo server with the service's gRPC settings (sync ``grpc.server``, the
same thread count, message size limits, concurrency limit, channel options and malloc settings) that answers
each request's bytes with the service's own response bytes for it, recorded beforehand: the floor for moving
exactly these bytes through gRPC in Python. Both are separate processes on CPU 0 (the load generator on the
other CPUs; ``--no-pin`` to let the OS schedule), started the same way; the client is the same for both.
Targets (issue 20): the service's p50 within 1.15x the echo's, its calls/s at least 0.9x. The service runs the
default config but for ``--max-num-batched-tokens 131072`` (the large batch has 65,956 query tokens; the default
allows 8,192), no warmup (nothing on the numpy request path compiles), ``--max-streams-per-connection 64`` (as
both echoes), and ``--heavy-lane-slots 8`` and ``--response-budget-bytes`` 4 GiB, so that the large batch at 32 in
flight is never shed (``service_flags``). ``--backend triton`` and ``auto`` (a CUDA
machine) keep the in-process warmup (auto measures its crossover there).

Several backends (``--backend numpy,triton,auto``): one server each, all alternating with the echo in the same
rounds. With ``auto`` and both others, each batch also prints auto against the better of numpy-only and
Triton-only (issue 12's target: p50 and calls/s at 8 in flight >= 0.95x the better, that is auto's p50 at most
1/0.95 of the lower p50), the crossover auto measured, and which backend served auto's calls (its metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import psutil

from benchmarks import goecho, loadgen
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service.codec import SERVICE_NAME, chunk_inputs_to_proto
from indexer_service.service.config import load_config
from indexer_service.service.overload.allocator import configure_malloc
from indexer_service.service.transport.grpc_options import server_options
from testkit.batches import make_inputs
from testkit.fuzzing import Limits, check_answer, judge
from testkit.harness import ServiceProcess, channel, clean_env
from testkit.record import write_json

BATCHES = ("small-8", "medium-64", "large-256")
# Streams per connection the servers allow: the load generator's connections carry up to 32 calls each, retries off,
# and at the default a stream opened before the server's SETTINGS arrive could be refused (RST_STREAM
# REFUSED_STREAM). The services and both echoes allow this many.
STREAMS_PER_CONNECTION = 64
SERVICE_FLAGS = ("--warmup-target", "none", "--max-num-batched-tokens", "131072")
METHOD = f"/{SERVICE_NAME}/BuildChunk"
P50_TARGET, THROUGHPUT_TARGET = 1.15, 0.9


def within(ratio_name: str, ratio: float) -> bool:
    """Whether a ratio to the echo meets its target: ``p50`` at most P50_TARGET, ``calls_per_s_*`` at least
    THROUGHPUT_TARGET."""
    return ratio <= P50_TARGET if ratio_name == "p50" else ratio >= THROUGHPUT_TARGET


AUTO_TARGET = 0.95
IN_FLIGHT = (8, 32)
# The loaded phases spread their calls over this many connections (loadgen's -connections), as a pool would.
LOADGEN_CONNECTIONS = 4


def serve_echo(canned: Path, port_file: Path) -> None:
    """The baseline server: each known request's bytes get their recorded response bytes, nothing else."""
    config = replace(load_config(env={}), max_streams_per_connection=STREAMS_PER_CONNECTION)
    configure_malloc(config.malloc_arena_max, config.malloc_retain_bytes)  # as serve() does
    answers = {
        (canned / f"{n}.request").read_bytes(): (canned / f"{n}.response").read_bytes()
        for n in range(len(list(canned.glob("*.request"))))
    }

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return answers[request]

    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.grpc_workers),
        options=server_options(config),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    handler = grpc.unary_unary_rpc_method_handler(echo)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"BuildChunk": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.write_text(json.dumps({"grpc_port": port}))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop(1).wait()


def record_responses(service: ServiceProcess, canned: Path) -> None:
    """Each batch's request bytes and the service's response bytes, checked against numpy, saved for the echo and
    the load generator."""
    limits = Limits(
        max_num_seqs=1024,
        max_num_batched_tokens=131072,
        max_model_len=2**20,
        max_message_bytes=64 * 2**20,
        max_logits_bytes=512 * 2**20,
    )
    with channel(service.address) as chan:
        raw = chan.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
        for n, name in enumerate(BATCHES):
            message = chunk_inputs_to_proto(make_inputs(name))
            request = message.SerializeToString()
            response = raw(request, timeout=60)
            problems = check_answer(
                judge("BuildChunk", message, limits),
                message,
                grpc.StatusCode.OK,
                "",
                pb.BuildChunkResponse.FromString(response),
            )
            if problems:
                raise SystemExit(f"the service answered {name} wrongly: {problems}")
            (canned / f"{n}.request").write_bytes(request)
            (canned / f"{n}.response").write_bytes(response)


def run_loadgen(
    binary: Path, server: ServiceProcess, request_file: Path, in_flight: int, seconds: float, window: int = 0
) -> dict:
    """One run of the Go load generator (pinned where this process is: off the servers' CPU; ``window``: its
    static receive windows, 0 grpc-go's dynamic ones); its JSON row. A latency benchmark allows no failed call."""
    connections = 1 if in_flight == 1 else LOADGEN_CONNECTIONS
    return loadgen.run(
        binary, [server], METHOD, request_file, in_flight, connections, seconds, failures_allowed=0.0, window=window
    )


def measure(
    binary: Path, server: ServiceProcess, request_file: Path, seconds: float, window: int = 0
) -> dict[str, float]:
    """p50/p99 with one call at a time, then calls/s and the server's CPU per call (user + system, microseconds:
    what a shared machine's neighbours disturb least) at each IN_FLIGHT, all from the Go load generator."""
    single = run_loadgen(binary, server, request_file, 1, seconds, window)
    row = {"calls": single["calls"], "p50_us": single["p50_us"], "p99_us": single["p99_us"]}
    process = psutil.Process(server.pid)
    for k in IN_FLIGHT:
        before = sum(process.cpu_times()[:2])
        loaded = run_loadgen(binary, server, request_file, k, seconds, window)
        used = sum(process.cpu_times()[:2]) - before
        row[f"calls_per_s_{k}"] = loaded["calls"] / loaded["elapsed"]
        row[f"server_cpu_us_per_call_{k}"] = used / loaded["calls"] * 1e6
    return row


def median_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds."""
    return {key: float(np.median([row[key] for row in rows])) for key in rows[0]}


def pin_servers(pin: bool) -> set[int] | None:
    """The CPU the servers run on (the lowest this process may use; this process, and the load generator it starts,
    moved to the others), or None: not pinned (``pin`` False, or a single CPU)."""
    if not pin or len(os.sched_getaffinity(0)) < 2:
        return None
    server_cpus = {min(os.sched_getaffinity(0))}
    os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - server_cpus)
    return server_cpus


def check_same_answers(server: ServiceProcess, canned: Path, name: str) -> None:
    """``server``'s answers to the recorded requests, recorded beside them, are the recorded response bytes; or exit
    naming ``name`` and the batch: figures of a server answering other bytes would mean nothing."""
    answers = canned / name
    answers.mkdir()
    record_responses(server, answers)
    for n in range(len(BATCHES)):
        if (answers / f"{n}.response").read_bytes() != (canned / f"{n}.response").read_bytes():
            raise SystemExit(f"{name} answered {BATCHES[n]} with other bytes than the recorded responses")


def start_echo(stack: ExitStack, canned: Path, cpus: set[int] | None) -> ServiceProcess:
    """The Python echo of the recorded responses (:func:`serve_echo`), stopped with ``stack``."""
    command = [sys.executable, "-m", "benchmarks.bench_rpc", "--serve-echo", str(canned)]
    return stack.enter_context(ServiceProcess(command=command, cpus=cpus, env=clean_env()))


Rounds = dict[str, list[dict[str, float]]]  # each server's measure() rows, one per round


def alternate(
    binary: Path,
    servers: dict[str, ServiceProcess],
    request_file: Path,
    rounds: int,
    seconds: float,
    window: int = 0,
) -> tuple[dict[str, dict[str, float]], Rounds]:
    """Each server's :func:`measure` figures, the servers alternating in ``rounds`` short rounds: each figure the
    median of its rounds (a noisy neighbour hits every server, not one whole phase), and the rounds themselves. The
    servers' order turns by one each round, so none always runs first or right after the same neighbour."""
    rows: Rounds = {server: [] for server in servers}
    names = list(servers)
    for turn in range(rounds):
        first = turn % len(names)
        for server in names[first:] + names[:first]:
            rows[server].append(measure(binary, servers[server], request_file, seconds, window))
    return {server: median_row(figures) for server, figures in rows.items()}, rows


def round_ratios(rounds: Rounds, server: str, key: str) -> list[float]:
    """``server``'s figure ``key`` over the echo's, round by round (the two measured minutes apart at most)."""
    return [row[key] / echo[key] for row, echo in zip(rounds[server], rounds["echo"], strict=True)]


def _plot(results: dict, path: Path, backends: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("p50_us", "p50, one client (us)"),
        *((f"calls_per_s_{k}", f"calls/s, {k} in flight") for k in IN_FLIGHT),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8))
    batches = list(results)
    x = np.arange(len(batches))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        servers = ["echo", *backends]
        width = 0.8 / len(servers)
        for i, server in enumerate(servers):
            ax.bar(
                x + (i - (len(servers) - 1) / 2) * width,
                [results[b][server][key] for b in batches],
                width,
                label=server,
            )
        ax.set_xticks(x, batches)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("BuildChunk over gRPC on 127.0.0.1: the service's backends against an echo of the same bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def service_flags(backend: str) -> tuple[str, ...]:
    # A heavy-lane slot per gRPC thread (8): the large batch is a heavy request, and with the default 2 slots the
    # calls beyond 2 + 4 waiting would be shed (issue 10, by design); this benchmark measures the compute paths.
    # A response budget no phase can reach, whatever this machine's memory limit: one client connection carries
    # every phase, a connection may hold a quarter of the budget, and the large batch at 32 in flight holds up to
    # 32 x 8.8 MB of answers (past a quarter of 1 GiB: the calls beyond it were shed, by design).
    streams = (
        "--max-streams-per-connection",
        str(STREAMS_PER_CONNECTION),
        "--heavy-lane-slots",
        "8",
        "--response-budget-bytes",
        str(4 << 30),
        "--backend",
        backend,
    )
    if backend == "numpy":
        return (*SERVICE_FLAGS, *streams)
    return (*SERVICE_FLAGS[2:], *streams)  # the in-process warmup stays: auto measures its crossover there


def auto_report(services: dict[str, ServiceProcess]) -> dict:
    """Auto's crossover (GetWarmupStatus) and the backend label of its calls (metrics)."""
    from testkit.harness import http_get

    with channel(services["auto"].address) as chan:
        ask = chan.unary_unary(
            f"/{SERVICE_NAME}/GetWarmupStatus",
            request_serializer=None,
            response_deserializer=pb.GetWarmupStatusResponse.FromString,
        )
        status = ask(b"", timeout=10)
    served = {}
    for line in http_get(f"{services['auto'].http_url}/metrics")[1].splitlines():
        if line.startswith("indexer_backend_duration_seconds_count{") and 'method="BuildChunk"' in line:
            served[line.split('backend="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return {"crossover_elements": status.auto_crossover_elements, "calls_by_backend": served}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="bound of each measured phase of a round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating echo/service rounds per batch")
    parser.add_argument(
        "--backend", default="numpy", help="the service's backend(s): numpy, triton, auto, comma-separated"
    )
    parser.add_argument("--batches", default=",".join(BATCHES), help="which batches, comma-separated")
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin the servers to CPU 0 and the client to the other CPUs"
    )
    parser.add_argument(
        "--loadgen-window",
        type=int,
        default=0,
        help="the load generator's static receive windows in bytes (its -window), 0: grpc-go's dynamic ones",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG of the figures here")
    parser.add_argument("--serve-echo", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        serve_echo(args.serve_echo, args.port_file)
        return
    backends = args.backend.split(",")
    if (
        not backends
        or any(b not in ("numpy", "triton", "auto") for b in backends)
        or len(set(backends)) < len(backends)
    ):
        parser.error(f"--backend: numpy, triton or auto, comma-separated, each once; got {args.backend!r}")

    server_cpus = pin_servers(not args.no_pin)
    pin = server_cpus is not None
    results: dict[str, dict] = {}
    per_round: dict[str, Rounds] = {}
    auto = None
    with tempfile.TemporaryDirectory(prefix="bench-rpc-") as scratch, ExitStack() as stack:
        canned = Path(scratch)
        services = {b: stack.enter_context(ServiceProcess(*service_flags(b), cpus=server_cpus)) for b in backends}
        binary = loadgen.binary()
        record_responses(services[backends[0]], canned)
        for backend in backends[1:]:  # every backend answers the same bytes, checked against numpy too
            check_same_answers(services[backend], canned, backend)
        echo = start_echo(stack, canned, server_cpus)
        go_echo_command = [str(goecho.binary()), "-canned", str(canned), "-streams", str(STREAMS_PER_CONNECTION)]
        go_echo = stack.enter_context(ServiceProcess(command=go_echo_command, cpus=server_cpus, env=clean_env()))
        servers = {"echo": echo, "go-echo": go_echo, **services}
        for name in args.batches.split(","):
            request_file = canned / f"{BATCHES.index(name)}.request"
            results[name], per_round[name] = alternate(
                binary, servers, request_file, args.rounds, args.seconds, args.loadgen_window
            )
            print(f"measured {name}", file=sys.stderr)
        if "auto" in services:
            auto = auto_report(services)

    where = "on CPU 0, client on the rest" if pin else "unpinned"
    print(f"BuildChunk over gRPC on 127.0.0.1, ratio 4, backends {','.join(backends)}, servers {where}")
    header = (
        f"{'batch':10} {'server':8} {'p50 us':>9} {'p99 us':>9}"
        + "".join(f" {f'calls/s @{k}':>13}" for k in IN_FLIGHT)
        + "".join(f" {f'cpu us/call @{k}':>17}" for k in IN_FLIGHT)
    )
    print(header)
    verdicts = {}
    for name in results:
        echo_row = results[name]["echo"]
        print(
            f"{name:10} {'echo':8} {echo_row['p50_us']:>9,.0f} {echo_row['p99_us']:>9,.0f}"
            + "".join(f" {echo_row[f'calls_per_s_{k}']:>13,.0f}" for k in IN_FLIGHT)
            + "".join(f" {echo_row[f'server_cpu_us_per_call_{k}']:>17,.0f}" for k in IN_FLIGHT)
        )
        results[name]["ratios"], results[name]["targets"], results[name]["round_ratios"] = {}, {}, {}
        for backend in ("go-echo", *backends):
            row = results[name][backend]
            print(
                f"{name:10} {backend:8} {row['p50_us']:>9,.0f} {row['p99_us']:>9,.0f}"
                + "".join(f" {row[f'calls_per_s_{k}']:>13,.0f}" for k in IN_FLIGHT)
                + "".join(f" {row[f'server_cpu_us_per_call_{k}']:>17,.0f}" for k in IN_FLIGHT)
            )
            ratios = {"p50": row["p50_us"] / echo_row["p50_us"], "p99": row["p99_us"] / echo_row["p99_us"]}
            ratios |= {f"calls_per_s_{k}": row[f"calls_per_s_{k}"] / echo_row[f"calls_per_s_{k}"] for k in IN_FLIGHT}
            for k in IN_FLIGHT:
                cpu = f"server_cpu_us_per_call_{k}"
                ratios[cpu] = row[cpu] / echo_row[cpu]
            met = {f"p50 <= {P50_TARGET}x echo": within("p50", ratios["p50"])}
            met |= {
                f"calls/s @{k} >= {THROUGHPUT_TARGET}x echo": within(f"calls_per_s_{k}", ratios[f"calls_per_s_{k}"])
                for k in IN_FLIGHT
            }
            print(
                f"{name:10} {'  /echo':8} {ratios['p50']:>8.2f}x {ratios['p99']:>8.2f}x"
                + "".join(f" {ratios[f'calls_per_s_{k}']:>12.2f}x" for k in IN_FLIGHT)
                + "".join(f" {ratios[f'server_cpu_us_per_call_{k}']:>16.2f}x" for k in IN_FLIGHT)
                + (
                    ""
                    if backend == "go-echo"
                    else "   " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in met.items())
                )
            )
            if backend == "go-echo":  # the stack's limit, beside the Python echo: no target of its own
                results[name]["ratios"][backend] = ratios
                continue
            results[name]["ratios"][backend], results[name]["targets"][backend] = ratios, met
            # The verdict is on the medians; the rounds show how far one round's comparison strays from it.
            spread = {"p50": round_ratios(per_round[name], backend, "p50_us")}
            spread |= {
                f"calls_per_s_{k}": round_ratios(per_round[name], backend, f"calls_per_s_{k}") for k in IN_FLIGHT
            }
            results[name]["round_ratios"][backend] = spread
            print(
                f"{name:10} {'  rounds':8} "
                + ", ".join(
                    f"{key.replace('calls_per_s_', 'calls/s @')} {min(values):.2f}-{max(values):.2f}x "
                    f"(within target in {sum(within(key, v) for v in values)}/{len(values)})"
                    for key, values in spread.items()
                )
            )
            if backend == backends[0] or backend == "auto":
                verdicts |= {f"{name} {backend} {k}": v for k, v in met.items()}
        if {"numpy", "triton", "auto"} <= set(backends):
            best_p50 = min(results[name][b]["p50_us"] for b in ("numpy", "triton"))
            best_rate = max(results[name][b]["calls_per_s_8"] for b in ("numpy", "triton"))
            vs_best = {
                "p50": best_p50 / results[name]["auto"]["p50_us"],
                "calls_per_s_8": results[name]["auto"]["calls_per_s_8"] / best_rate,
            }
            met = {
                f"auto p50 >= {AUTO_TARGET}x the better": vs_best["p50"] >= AUTO_TARGET,
                f"auto calls/s @8 >= {AUTO_TARGET}x the better": vs_best["calls_per_s_8"] >= AUTO_TARGET,
            }
            print(
                f"{name:10} {'auto/best':8} p50 {vs_best['p50']:.2f}x (best {best_p50:,.0f} us), calls/s @8 "
                f"{vs_best['calls_per_s_8']:.2f}x (best {best_rate:,.0f})   "
                + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in met.items())
            )
            results[name]["auto_vs_best"] = vs_best
            verdicts |= {f"{name} {k}": v for k, v in met.items()}
    if auto is not None:
        print(
            f"auto: crossover {auto['crossover_elements']} output elements; BuildChunk calls by backend "
            f"{auto['calls_by_backend']}"
        )
    missed = [k for k, v in verdicts.items() if not v]
    print(f"targets met: {len(verdicts) - len(missed)}/{len(verdicts)}" + (f"; missed: {missed}" if missed else ""))
    write_json(
        args.out,
        {
            "backends": backends,
            "pinned": pin,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "loadgen_window": args.loadgen_window,
            "auto": auto,
            "batches": results,
            "per_round": per_round,
        },
    )
    if args.plot:
        _plot(results, args.plot, backends)


if __name__ == "__main__":
    main()
