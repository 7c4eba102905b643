"""The malloc settings do what they are for: with freed memory kept, allocating and filling an 8 MiB
response-sized buffer call after call costs no page faults; with glibc's defaults in a threaded server it
costs one per 4 KiB. An operator's MALLOC_* environment wins. Each case runs in a fresh interpreter: malloc
settings are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from indexer_service.service.allocator import configure_malloc

# Fill four fresh 8 MiB buffers 20 times, on worker threads like the gRPC server's; count minor page faults.
PROBE = """
import json, resource, sys, threading
import numpy as np
from indexer_service.service.allocator import configure_malloc

outcome = configure_malloc(int(sys.argv[1]), int(sys.argv[2]))

def serve_one():  # a large answer's arrays, its wire bytes, gRPC's copy: several live at once
    buffers = [np.empty(8 * 2**20, dtype=np.uint8) for _ in range(4)]
    for buffer in buffers:
        buffer.fill(1)

def call():
    worker = threading.Thread(target=serve_one)
    worker.start()
    worker.join()

call()  # the first call faults its pages in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    call()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"outcome": outcome, "faults_per_call": faults / 20}))
"""
PAGES_PER_CALL = 4 * 8 * 2**20 // 4096


def probe(arena_max: int, retain_bytes: int, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(arena_max), str(retain_bytes)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**clean, **env},
    )
    return json.loads(out.stdout)


needs_glibc = pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's mallopt")


@needs_glibc
def test_kept_memory_is_reused_without_page_faults() -> None:
    kept = probe(2, 256 * 2**20)
    assert kept["outcome"] == {"arena_max": "2", "retain_bytes": str(256 * 2**20)}
    defaults = probe(0, 0)
    assert defaults["outcome"] == {"arena_max": "glibc default", "retain_bytes": "glibc default"}
    # glibc's default trims the heap top once over 2x the largest block freed so far: those pages fault again.
    assert kept["faults_per_call"] < PAGES_PER_CALL * 0.02, kept
    assert defaults["faults_per_call"] > PAGES_PER_CALL * 0.15, defaults
    assert defaults["faults_per_call"] > 8 * max(kept["faults_per_call"], 1), (defaults, kept)


@needs_glibc
def test_an_operators_malloc_environment_wins() -> None:
    result = probe(2, 256 * 2**20, MALLOC_ARENA_MAX="4", MALLOC_TRIM_THRESHOLD_="131072")
    assert result["outcome"] == {
        "arena_max": "environment (MALLOC_ARENA_MAX=4)",
        "retain_bytes": "environment (MALLOC_TRIM_THRESHOLD_=131072)",
    }
    assert result["faults_per_call"] > PAGES_PER_CALL * 0.1, result  # a tiny trim threshold: faults again


def test_settings_are_c_ints_and_zeros_leave_glibc_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from indexer_service.service.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="malloc_retain_bytes"):
        load_config({"malloc_retain_bytes": str(2**31)}, env={})
    with pytest.raises(ConfigError, match="malloc_arena_max"):
        load_config({"malloc_arena_max": "-1"}, env={})
    # Zeros leave glibc alone (no mallopt call), so this can run in the test process itself.
    for name in ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    assert configure_malloc(0, 0) == {"arena_max": "glibc default", "retain_bytes": "glibc default"}
