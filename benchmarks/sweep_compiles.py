"""After warmup, does any live request make Triton compile? A randomised sweep against a real server.

    python -m benchmarks.sweep_compiles [--requests 10000] [--out results.json]

Starts ``indexer-service serve`` on its default config (on a GPU: the Triton backend, warmed in process),
waits for ready, then sends random valid ``BuildChunk`` and ``PlanBatch`` requests over every ratio of the
model's warmup set (0 included: it means 1), with query slices, zero-length queries and DCP at ratio 1.
Prints the server's own count of compiles after ready (Triton's post-compile hook) before and after.
The baseline is the same sweep with one ratio the model does not have, which must compile exactly once.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from indexer_service.client import IndexerClient
from indexer_service.kernels.inputs import DcpConfig
from indexer_service.kernels.planner import BatchInputs
from indexer_service.kernels.specialization import ModelConfig
from testkit.batches import BatchShape, random_batch, random_chunk_inputs
from testkit.harness import ServiceProcess
from testkit.record import write_json

FLASH = ModelConfig((0, 0, *([4, 128] * 20), 4, 0))


def sweep(client: IndexerClient, requests: int, ratios: tuple[int, ...], seed: int) -> int:
    rng = np.random.default_rng(seed)
    for i in range(requests):
        ratio = ratios[i % len(ratios)]
        shape = BatchShape(int(rng.integers(1, 48)), int(rng.integers(1, 120)), int(rng.integers(0, 4000)))
        # DCP only at ratio 0/1: the service refuses DCP with compression (FAILED_PRECONDITION).
        world = int(rng.choice([1, 2, 4])) if ratio <= 1 else 1
        dcp = DcpConfig(int(rng.integers(0, world)), world, int(rng.choice([1, 2])))
        if i % 5 == 0:
            qsl, seq = random_batch(rng, shape)
            client.plan_batch(BatchInputs(qsl, seq, ratio, int(rng.integers(0, shape.num_requests)), 2**20, dcp=dcp))
        else:
            client.build_chunk(random_chunk_inputs(rng, shape, ratio, dcp), omit_token_to_seq=bool(i % 2))
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with ServiceProcess() as server:
        startup = server.wait_ready()
        with IndexerClient([server.address], timeout=60) as client:
            status = client.warmup_status()
            before = status.compiles_after_ready
            start = time.perf_counter()
            sweep(client, args.requests, (0, 1, 4, 128), seed=10_000)
            seconds = time.perf_counter() - start
            after = client.warmup_status().compiles_after_ready
            sweep(client, 20, (7,), seed=7)  # the baseline: a ratio outside the warmup set
            unwarmed = client.warmup_status().compiles_after_ready - after
    result = {
        "backend": status.backend,
        "target": status.target,
        "keys": len(status.keys),
        "ready_seconds": startup,
        "requests": args.requests,
        "sweep_seconds": seconds,
        "compiles_after_ready": after - before,
        "compiles_for_an_unwarmed_ratio": unwarmed,
    }
    print(f"backend={status.backend} target={status.target} warmup keys={len(status.keys)} ready after {startup:.2f} s")
    print(f"{args.requests} random requests in {seconds:.1f} s: compiles after ready = {after - before}")
    print(f"baseline, 20 requests at unwarmed ratio 7: compiles = {unwarmed} (1 expected on a GPU, 0 on numpy)")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
