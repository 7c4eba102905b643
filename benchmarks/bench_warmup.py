"""Warmup time of the default config: this project's key set against vLLM-style one-by-one warmup.

    python -m benchmarks.bench_warmup [--workers N] [--out results.json]

Each measurement runs in a fresh process (nothing warm in memory) with either a fresh Triton cache
directory (cold) or the one the cold run filled (warm). With a GPU the kernel is JIT-warmed in process;
without one it is compiled ahead of time for ``cuda:90``.

Baseline, measured in the same run: vLLM's warmup key space (spec section 4: query-slice start and stop
classes x ratios x seq_lens pointer alignment = 54 keys for DeepSeek-V4-Flash) on the same kernel with
its scalars specialized, compiled one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit.record import write_json

REPO = Path(__file__).resolve().parent.parent
FLASH_RATIOS = (0, 0, *([4, 128] * 20), 4, 0)


def vllm_style_warmup(target: str | None) -> dict:
    """vLLM's 54 keys (spec section 4), compiled one by one on the fully specialized kernel."""
    import torch

    from benchmarks.vllm_baseline import vllm_shaped_kernel, warmup_one_by_one
    from indexer_service.kernels.compile_engine import compile_only_driver, parse_target, start_compiler
    from indexer_service.kernels.specialization import ModelConfig

    start_compiler()  # Triton's own start-up is outside both sides' figures
    with compile_only_driver(parse_target(target) if target else None):
        start = time.perf_counter()
        keys = warmup_one_by_one(vllm_shaped_kernel(), ModelConfig(FLASH_RATIOS), 8192, "cpu" if target else "cuda")
        if not target:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"keys": keys, "seconds": seconds}


def service_warmup(target: str | None, workers: int) -> dict:
    from indexer_service.kernels.compile_engine import compile_keys, start_compiler
    from indexer_service.kernels.specialization import ModelConfig, warmup_keys

    keys = warmup_keys(ModelConfig(FLASH_RATIOS))
    start_compiler()
    start = time.perf_counter()
    outcomes = compile_keys(keys, keys, target=target, workers=workers)
    seconds = time.perf_counter() - start
    assert all(o.ok for o in outcomes), outcomes
    return {"keys": len(keys), "seconds": seconds, "per_key": [round(o.seconds, 4) for o in outcomes]}


def child(mode: str, target: str | None, workers: int) -> None:
    started = time.perf_counter()
    import torch  # noqa: F401  (import cost reported apart from compile time)
    import triton  # noqa: F401

    imported = time.perf_counter() - started
    result = vllm_style_warmup(target) if mode == "vllm" else service_warmup(target, workers)
    result["import_seconds"] = imported
    print(json.dumps(result))


def measure(mode: str, cache: str, target: str | None, workers: int) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=str(REPO))
    command = [sys.executable, __file__, "--child", mode, "--workers", str(workers)]
    if target:
        command += ["--target", target]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=["vllm", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--target", default=None, help="AOT target; default: cuda:90 without a GPU, JIT with one")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.target, args.workers)
        return

    import torch

    target = args.target or (None if torch.cuda.is_available() else "cuda:90")
    where = "in-process JIT on " + torch.cuda.get_device_name() if target is None else f"ahead of time for {target}"
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, mode, workers in (
            ("vllm-style one by one", "vllm", 1),
            ("ours sequential", "ours", 1),
            (f"ours parallel x{args.workers}", "ours", args.workers),
        ):
            cache = tempfile.mkdtemp(dir=scratch)
            rows[name] = {"cold": measure(mode, cache, target, workers), "warm": measure(mode, cache, target, workers)}
    baseline = rows["vllm-style one by one"]["cold"]["seconds"]
    print(f"warmup of the DeepSeek-V4-Flash config, {where}")
    print(f"{'variant':28} {'keys':>5} {'cold s':>8} {'warm s':>8} {'cold speed-up vs baseline':>26}")
    for name, row in rows.items():
        cold, warm = row["cold"], row["warm"]
        print(
            f"{name:28} {cold['keys']:>5} {cold['seconds']:>8.3f} {warm['seconds']:>8.3f} "
            f"{baseline / cold['seconds']:>25.1f}x"
        )
    write_json(args.out, {"where": where, "rows": rows})


if __name__ == "__main__":
    main()
