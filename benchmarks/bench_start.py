"""Where a start's time goes: ``indexer-service serve`` as ``make serve`` runs it (the default config: one worker
process), from ``Popen`` to its first log line, to listening (the port file) and to ready (/readyz 200, polled every
10 ms), with a warm Triton cache (a first, unreported start fills it); and ``indexer-service keys``.

    python -m benchmarks.bench_start [--rounds 3] [--before TREE] [--out start.json]

Baselines, in the same run: a fresh interpreter that only imports torch (the import that sat before the first
log line until the configuration check stopped importing the compile engine); with ``--before TREE``, the same
measures of an earlier version, rounds interleaved with this one's so that both see the same machine load.
TREE holds that version as ``TREE/indexer_service`` (``git archive COMMIT | tar -x -C TREE/indexer_service``,
plus a copy of the built ``service/compute/_fastpath*.so``); it is put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testkit.harness import INDEXER_SERVICE, ServiceProcess, clean_env
from testkit.record import write_json


def first_line_seconds(server: ServiceProcess, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while not server.log_path.exists() or not server.log_path.read_text():
        assert time.monotonic() < deadline, "no log line"
        time.sleep(0.005)
    return time.perf_counter() - server.started_at


def environment(cache: Path, tree: Path | None) -> dict[str, str]:
    """``make serve``'s: the default config (one worker, as clean_env also sets), this version or ``tree``."""
    env = clean_env(TRITON_CACHE_DIR=str(cache))
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    return env


def one_start(env: dict[str, str]) -> dict[str, float]:
    server = ServiceProcess(env=env)
    try:
        server.start()
        first = first_line_seconds(server)
        server.wait_listening()
        listening = time.perf_counter() - server.started_at
        ready = server.wait_ready(poll=0.01)
        return {"first_log_line_s": first, "listening_s": listening, "ready_s": ready}
    finally:
        server.kill()


def seconds_of(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=env, timeout=300)
    return time.perf_counter() - start


def one_round(env: dict[str, str]) -> dict[str, float]:
    return one_start(env) | {"keys_s": seconds_of([INDEXER_SERVICE, "keys"], env)}


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, metavar="TREE", help="an earlier version to compare with")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    versions = {"this": None} | ({"before": args.before} if args.before else {})
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
    torch = []
    with tempfile.TemporaryDirectory(prefix="bench-start-") as scratch:
        envs = {name: environment(Path(scratch, f"cache-{name}"), tree) for name, tree in versions.items()}
        for env in envs.values():
            one_start(env)  # fills the cache: later starts load their kernels, as a pod's prebuilt cache does
        for _ in range(args.rounds):
            for name, env in envs.items():
                rounds[name].append(one_round(env))
            torch.append(seconds_of([sys.executable, "-c", "import torch"], envs["this"]))
    result = {name: medians(r) for name, r in rounds.items()}
    result["baseline_import_torch_s"] = statistics.median(torch)
    result["rounds"] = args.rounds
    print(f"{'seconds (median of ' + str(args.rounds) + ')':26} " + " ".join(f"{n:>8}" for n in versions))
    for measure in result["this"]:
        print(f"{measure:26} " + " ".join(f"{result[n][measure]:8.2f}" for n in versions))
    print(f"{'import torch alone':26} {result['baseline_import_torch_s']:8.2f}")
    if args.before:
        for measure in result["this"]:
            print(f"{measure}: {result['before'][measure] / result['this'][measure]:.1f}x faster than before")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
