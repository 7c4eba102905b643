"""Backend compute for the batches of the measured facts, each against a bound measured in the same run.

    python -m benchmarks.bench_kernel [--out results.json]

Without a GPU: the numpy backend against ``np.copyto`` of the same output bytes (the memory-copy floor), and so is the
compiled fast path that serves BuildChunk with the numpy backend (service/compute/fastpath.c), timed as the server calls
it: request bytes in, response bytes out (parse, validation and encoding included). With a GPU, also: the kernel alone
(CUDA-graph replay) against a device copy of its output bytes; the same kernel with Triton's default scalar
specialization (what ``do_not_specialize`` costs or saves); the service's host round trip (validation, one copy in,
launch, one copy out) against numpy; and a whole prefill plan built by one launch against vLLM's way (one launch and
several torch ops per chunk, ``benchmarks/vllm_baseline.py``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from indexer_service.kernels.inputs import ChunkInputs, chunk_host_part, chunk_host_parts
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.service.codec import chunk_inputs_to_proto
from indexer_service.service.compute import _fastpath
from indexer_service.service.config import load_config
from indexer_service.service.overload.allocator import configure_malloc
from indexer_service.service.overload.limits import fast_path_limits
from testkit.batches import BATCHES, RATIO, make_inputs
from testkit.record import write_json


def wall_median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def cpu_row(inputs: ChunkInputs) -> dict:
    result = build_chunk_metadata_numpy(inputs)
    out_bytes = sum(a.nbytes for a in (result.token_to_seq, result.cu_seqlen_ks, result.cu_seqlen_ke))
    src, dst = np.ones(out_bytes // 4, np.int32), np.empty(out_bytes // 4, np.int32)
    request = chunk_inputs_to_proto(inputs).SerializeToString()
    config = replace(load_config(env={}), max_num_batched_tokens=2**20)
    limits = fast_path_limits(config)
    if _fastpath.build_chunk(request, limits, None) is None:
        raise SystemExit("the fast path stepped aside on a benchmark batch")
    numpy_s = wall_median(lambda: build_chunk_metadata_numpy(inputs), 30)
    native_s = wall_median(lambda: _fastpath.build_chunk(request, limits, None), 30)
    copy_s = wall_median(lambda: np.copyto(dst, src), 30)
    return {
        "compressed_tokens": result.total_seq_lens,
        "output_bytes": out_bytes,
        "numpy_us": numpy_s * 1e6,
        "native_us": native_s * 1e6,
        "copyto_us": copy_s * 1e6,
        "numpy_vs_copy": numpy_s / copy_s,
        "native_vs_copy": native_s / copy_s,
    }


def gpu_row(inputs: ChunkInputs) -> dict:
    import torch
    import triton
    from triton.testing import do_bench_cudagraph

    from indexer_service.kernels.triton_kernel import (
        KERNEL_JIT_OPTIONS,
        _build_prefill_metadata_kernel_fn,
        launch_prefill_metadata_kernel,
    )
    from indexer_service.kernels.triton_launcher import TritonChunkBuilder, program_table

    host = chunk_host_part(inputs)
    cuda = torch.device("cuda")
    table, kv_bases, row_bases = program_table([host])
    device_table = torch.from_numpy(table).to(cuda)
    tts = torch.empty(kv_bases[-1], dtype=torch.int32, device=cuda)
    ks, ke = (torch.empty(row_bases[-1], dtype=torch.int32, device=cuda) for _ in range(2))
    ours = triton.jit(_build_prefill_metadata_kernel_fn, **KERNEL_JIT_OPTIONS)
    specialized = triton.jit(_build_prefill_metadata_kernel_fn)  # Triton's default: DCP scalars specialized

    def launch(kernel):
        return lambda: launch_prefill_metadata_kernel(
            device_table, tts, ks, ke, dcp=inputs.dcp, compress_ratio=host.ratio, kernel=kernel
        )

    out_elems = kv_bases[-1] + 2 * row_bases[-1]
    src = torch.ones(out_elems, dtype=torch.int32, device=cuda)
    dst = torch.empty(out_elems, dtype=torch.int32, device=cuda)
    # CUDA-graph replay: device time only, without the ~15 us of Python per launch.
    kernel_us = do_bench_cudagraph(launch(ours), rep=200) * 1e3
    specialized_us = do_bench_cudagraph(launch(specialized), rep=200) * 1e3
    copy_us = do_bench_cudagraph(lambda: dst.copy_(src), rep=200) * 1e3
    builder = TritonChunkBuilder(cuda)
    round_trip_us = wall_median(lambda: builder(inputs), 50) * 1e6
    numpy_us = wall_median(lambda: build_chunk_metadata_numpy(inputs), 50) * 1e6
    return {
        "kernel_us": kernel_us,
        "device_copy_us": copy_us,
        "kernel_vs_copy": kernel_us / copy_us,
        "specialized_kernel_us": specialized_us,
        "ours_vs_specialized": kernel_us / specialized_us,
        "round_trip_us": round_trip_us,
        "numpy_us": numpy_us,
        "round_trip_vs_numpy": round_trip_us / numpy_us,
    }


def plan_row(name: str) -> dict:
    """A whole prefill plan under the default budgets: one launch for every chunk against vLLM's way."""
    import torch

    from benchmarks.vllm_baseline import VllmStyleBatchBuilder, vllm_shaped_kernel
    from indexer_service.kernels.planner import BatchInputs, chunk_inputs_of_plan, plan_prefill_batch
    from indexer_service.kernels.triton_launcher import TritonChunkBuilder

    inputs = make_inputs(name)
    batch = BatchInputs(inputs.query_start_loc, inputs.seq_lens, RATIO, num_decodes=0, max_model_len=2**20)
    chunks = plan_prefill_batch(batch)
    baseline = VllmStyleBatchBuilder(inputs.query_start_loc, inputs.seq_lens, RATIO, vllm_shaped_kernel())
    spans = [(c.req_start, c.req_end, c.query_start, c.query_stop) for c in chunks]
    builder = TritonChunkBuilder("cuda")

    def ours():
        hosts = [h for h in chunk_host_parts(chunk_inputs_of_plan(batch, chunks)) if h is not None]
        builder.arrays_many(hosts, batch.dcp)  # returns host arrays: includes the copy back

    def vllm_style():
        baseline.build(spans)
        torch.cuda.synchronize()  # outputs stay on the device: no copy back

    ours_us, vllm_us = wall_median(ours, 30) * 1e6, wall_median(vllm_style, 30) * 1e6
    return {"chunks": len(chunks), "ours_us": ours_us, "vllm_style_us": vllm_us, "ours_vs_vllm": ours_us / vllm_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    results = {}
    config = load_config(env={})
    configure_malloc(config.malloc_arena_max, config.malloc_retain_bytes)  # as the server does
    print(
        f"{'batch':10} {'C tokens':>9} {'copyto us':>9} {'numpy us':>9} {'ratio':>6} {'native us':>9} {'ratio':>6}",
        end="",
    )
    print(
        f" | {'kernel us':>9} {'dcopy us':>8} {'ratio':>6} {'spec us':>8} {'ours/spec':>9} "
        f"{'trip us':>8} {'numpy us':>8} {'trip/np':>7}"
        if gpu
        else ""
    )
    for name in BATCHES:
        inputs = make_inputs(name)
        row = cpu_row(inputs)
        line = (
            f"{name:10} {row['compressed_tokens']:>9} {row['copyto_us']:>9.1f} {row['numpy_us']:>9.1f} "
            f"{row['numpy_vs_copy']:>6.2f} {row['native_us']:>9.1f} {row['native_vs_copy']:>6.2f}"
        )
        if gpu:
            g = gpu_row(inputs)
            row["gpu"] = g
            line += (
                f" | {g['kernel_us']:>9.2f} {g['device_copy_us']:>8.2f} {g['kernel_vs_copy']:>6.2f} "
                f"{g['specialized_kernel_us']:>8.2f} {g['ours_vs_specialized']:>9.3f} {g['round_trip_us']:>8.1f} "
                f"{g['numpy_us']:>8.1f} {g['round_trip_vs_numpy']:>7.2f}"
            )
        print(line)
        results[name] = row
    if gpu:
        print("\nwhole prefill plan, default budgets (512 MiB logits, max_model_len 2^20), ratio 4")
        print(f"{'batch':10} {'chunks':>6} {'ours us':>9} {'vllm-style us':>13} {'ours/vllm':>9}")
        for name in ("medium-64", "large-256"):
            row = plan_row(name)
            print(
                f"{name:10} {row['chunks']:>6} {row['ours_us']:>9.1f} {row['vllm_style_us']:>13.1f} "
                f"{row['ours_vs_vllm']:>9.2f}"
            )
            results[name]["plan"] = row
    write_json(args.out, results)


if __name__ == "__main__":
    main()
