"""What every benchmark writes beside its figures: the run record (commit, date, host, CPU model, the CPUs the
benchmark and each process it pinned ran on, GPUs, package versions), and the JSON file that carries both.

Light on purpose (no gRPC, numpy or torch): the GPU benchmarks write through it on a machine that has no more than
their own needs. benchmarks/RESULTS.md cites the records; tests/system/test_results_summary.py holds it to them."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from testkit.paths import REPO

# The packages whose versions a figure depends on, recorded with every benchmark's result.
RECORDED_PACKAGES = (
    "indexer-service",
    "grpcio",
    "protobuf",
    "numpy",
    "uvicorn",
    "prometheus-client",
    "torch",
    "triton",
)

# The processes this process started pinned to CPUs (testkit.harness.ServiceProcess notes each), in start order.
_pinned: list[dict[str, object]] = []


def process_name(command: Sequence[str]) -> str:
    """A started process's name for the record: the program and its words before the first flag (``indexer-service
    serve``, ``python3 -m benchmarks.bench_rpc``, ``goecho``), with a ``--serve*`` flag and its word kept (the echo
    baselines and the ablation's cut servers are their benchmark started so), paths dropped."""
    words, rest = [Path(command[0]).name], list(command[1:])
    while rest and "/" not in rest[0]:
        word = rest.pop(0)
        if word.startswith("-") and word != "-m" and not word.startswith("--serve"):
            break
        words.append(word)
        if word == "-m" or word.startswith("--serve"):  # with the module or the server it names
            words += [rest.pop(0)] if rest and "/" not in rest[0] and not rest[0].startswith("-") else []
            if word != "-m":
                break
    return " ".join(words)


def note_pinned(command: Sequence[str], cpus: Iterable[int]) -> None:
    """Record that ``command`` was started pinned to ``cpus`` (once per name and CPU set)."""
    entry = {"process": process_name(command), "cpus": sorted(cpus)}
    if entry not in _pinned:
        _pinned.append(entry)


def run_record() -> dict[str, object]:
    """Where and on what a benchmark ran: the commit (``+dirty`` with uncommitted changes; ``COMMIT`` in the
    environment where no checkout is there), the UTC date, the host, its CPU model and count, ``affinity``: the CPUs
    this process may use when it writes (the load generators and Python clients it starts run there), ``pinned``:
    each process it started pinned and its CPUs (empty: nothing pinned), its GPUs (from the NVIDIA driver's /proc
    files, without importing torch) and the packages' versions."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    commit = (commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) if commit else ""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    gpus = [
        next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("Model")), "")
        for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    ]
    versions = {}
    for package in RECORDED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = ""
    return {
        "commit": commit or os.environ.get("COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "pinned": list(_pinned),
        "gpus": gpus,
        "packages": versions,
    }


def write_json(path: Path | None, payload: object) -> None:
    """``payload`` as JSON at ``path`` (nothing when None); a dict gets the :func:`run_record` under ``run``."""
    if path is not None:
        if isinstance(payload, dict):
            payload = {"run": run_record(), **payload}
        path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print(f"wrote {path}")
