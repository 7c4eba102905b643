"""The Triton backend's host round trip under concurrency, in process, against the design before it and numpy.

    python -m benchmarks.bench_triton [--seconds 1] [--threads 8] [--switch-intervals 0.005,0.0005] [--out triton.json]

Per batch (bench_kernel's small-8, medium-64, large-256; ratio 4), each variant is called back to back by one
thread, then by ``--threads`` threads at once (like the gRPC pool), each phase bounded by ``--seconds``; the figure
is the per-call median (and calls/s in all). Variants, measured in the same run:

* ``before``: the launcher as it was (pageable host memory, a fresh output per call, the default stream, the copy
  back synchronous): the baseline.
* ``pooled-spin`` / ``pooled-block``: the service's builder (``kernels.triton_launcher.TritonChunkBuilder``): a stream,
  event and device buffers per thread, page-locked staging and pooled page-locked outputs viewed without a copy,
  the wait on an event with the GIL released; spinning or sleeping in the driver while waiting; concurrent
  calls share launches (``LaunchCombiner``).
* ``solo-block``: the same builder with ``combine=False``: every call launches alone (the design before the
  combiner).
* ``numpy``: the numpy backend (``chunk_arrays_numpy_many``).

Each variant runs once per ``--switch-intervals`` value (``sys.setswitchinterval``: how long a thread that holds
the GIL keeps it while another asks). A thread back from a wait with the GIL released (the GPU event) must take
the GIL back from threads busy in Python, which give it up only at the interval: the convoy that this measures.

Targets (issue 12): with ``--threads`` threads the per-call median <= 2x the one-thread median; the large batch's
one-thread round trip below numpy's.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from indexer_service.kernels.inputs import chunk_host_part
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy_many
from indexer_service.kernels.triton_kernel import launch_prefill_metadata_kernel
from indexer_service.kernels.triton_launcher import TritonChunkBuilder, _output_segments, program_table
from testkit.batches import make_inputs
from testkit.record import write_json

BATCHES = ("small-8", "medium-64", "large-256")
CONCURRENCY_TARGET = 2.0


def before_arrays_many(hosts, dcp, with_token_to_seq=True):
    """The launcher before issue 12: pageable copies, a fresh output per call, the default stream."""
    (host,) = hosts
    table, kv_bases, row_bases = program_table(hosts, with_token_to_seq)
    tokens, rows = kv_bases[-1], row_bases[-1]
    device_table = torch.from_numpy(table).to("cuda")
    size, segments = _output_segments(tokens, rows)
    out = torch.empty(size, dtype=torch.int32, device="cuda")
    launch_prefill_metadata_kernel(device_table, *(out[w] for w in segments), dcp=dcp, compress_ratio=host.ratio)
    host_out = out.cpu().numpy()
    return [tuple(host_out[w] for w in segments)]


def run_threads(fn, threads: int, seconds: float, max_calls: int = 200_000) -> dict[str, float]:
    """Each thread calls ``fn`` back to back until ``seconds`` pass; per-call median and calls/s in all."""
    barrier = threading.Barrier(threads + 1)
    latencies: list[list[float]] = [[] for _ in range(threads)]
    stop_at = [0.0]

    def worker(i: int) -> None:
        mine = latencies[i]
        barrier.wait()
        while time.perf_counter() < stop_at[0] and len(mine) < max_calls // threads:
            start = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - start)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    stop_at[0] = time.perf_counter() + seconds
    began = time.perf_counter()
    barrier.wait()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - began
    every = np.concatenate([np.asarray(x) for x in latencies])
    return {
        "calls": int(every.size),
        "median_us": float(np.median(every)) * 1e6,
        "p99_us": float(np.percentile(every, 99)) * 1e6,
        "calls_per_s": every.size / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--switch-intervals", default="0.005", help="sys.setswitchinterval values, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    intervals = [float(v) for v in args.switch_intervals.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton needs a CUDA GPU")
    builders = {
        "before": before_arrays_many,
        "pooled-spin": TritonChunkBuilder("cuda", blocking_wait=False).arrays_many,
        "pooled-block": TritonChunkBuilder("cuda", blocking_wait=True).arrays_many,
        "solo-block": TritonChunkBuilder("cuda", blocking_wait=True, combine=False).arrays_many,
        "numpy": chunk_arrays_numpy_many,
    }
    # The first interval keeps the plain names (the baseline figures); the others are suffixed "@seconds".
    variants = {
        (name if i == 0 else f"{name}@{interval:g}"): (fn, interval)
        for i, interval in enumerate(intervals)
        for name, fn in builders.items()
    }
    pooled = [v for v in variants if v.startswith("pooled")]
    results: dict[str, dict] = {}
    for name in BATCHES:
        inputs = make_inputs(name)
        host = chunk_host_part(inputs)
        expected = chunk_arrays_numpy_many([host], inputs.dcp)[0]
        row: dict[str, dict] = {}
        for variant, (arrays_many, interval) in variants.items():
            sys.setswitchinterval(interval)
            got = arrays_many([host], inputs.dcp)[0]  # compile, first touches, and a check
            assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True)), (name, variant)
            del got

            def call(arrays_many=arrays_many, host=host, dcp=inputs.dcp):
                arrays_many([host], dcp)

            run_threads(call, 1, 0.1)
            one = run_threads(call, 1, args.seconds)
            combiner = getattr(getattr(arrays_many, "__self__", None), "combiner", None)
            launched = combiner.launches if combiner else 0
            many = run_threads(call, args.threads, args.seconds)
            if combiner:  # how many calls a launch carried at once
                many["calls_per_launch"] = many["calls"] / max(1, combiner.launches - launched)
            row[variant] = {"one": one, "many": many, "many_vs_one": many["median_us"] / one["median_us"]}
        results[name] = row
    sys.setswitchinterval(intervals[0])

    print(f"Triton backend round trip in process, ratio 4, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'batch':10} {'variant':20} {'1 thread us':>11} {f'{args.threads} threads us':>13} {'ratio':>6} "
        f"{'calls/s 1':>10} {f'calls/s {args.threads}':>10}"
    )
    verdicts = {}
    for name, row in results.items():
        for variant, r in row.items():
            per_launch = r["many"].get("calls_per_launch")
            print(
                f"{name:10} {variant:20} {r['one']['median_us']:>11.1f} {r['many']['median_us']:>13.1f} "
                f"{r['many_vs_one']:>5.2f}x {r['one']['calls_per_s']:>10,.0f} {r['many']['calls_per_s']:>10,.0f}"
                + (f"  {per_launch:.1f} calls a launch" if per_launch else "")
            )
        best = min(pooled, key=lambda v: row[v]["many_vs_one"])
        verdicts[f"{name} {best} {args.threads} threads <= {CONCURRENCY_TARGET}x one"] = (
            row[best]["many_vs_one"] <= CONCURRENCY_TARGET
        )
        for variant in ("pooled-spin", "pooled-block"):
            row[variant]["vs_before_one"] = row[variant]["one"]["median_us"] / row["before"]["one"]["median_us"]
            row[variant]["vs_numpy_one"] = row[variant]["one"]["median_us"] / row["numpy"]["one"]["median_us"]
        print(
            f"{'':10} one thread vs before: spin {row['pooled-spin']['vs_before_one']:.2f}x, block "
            f"{row['pooled-block']['vs_before_one']:.2f}x; vs numpy: spin {row['pooled-spin']['vs_numpy_one']:.2f}x, "
            f"block {row['pooled-block']['vs_numpy_one']:.2f}x"
        )
    large = results["large-256"]
    verdicts["large-256 one-thread round trip below numpy's"] = (
        min(large[v]["one"]["median_us"] for v in pooled) < large["numpy"]["one"]["median_us"]
    )
    for k, v in verdicts.items():
        print(f"target {k}: {'met' if v else 'MISSED'}")
    write_json(
        args.out,
        {
            "threads": args.threads,
            "seconds": args.seconds,
            "switch_intervals": intervals,
            "batches": results,
            "targets": verdicts,
        },
    )


if __name__ == "__main__":
    main()
