"""Fixtures of every layer, the test tiers' markers and the hypothesis profiles. Nothing here imports the service
(tests/kernels/ runs without its compiled extension); the service layer's fixtures, real server processes among
them, are tests/service/conftest.py's."""

from __future__ import annotations

import os
import shutil
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.tiers import (
    can_renice,
    group_scheduling,
    run_lock,
    spread_exclusive,
    tier_marks,
    worker_cpu,
    write_groups,
)
from tests.tools import missing_tool

# Hypothesis: every example in CI (which sets CI=true, as do most CI systems), a fifth of them elsewhere so that
# `make test-quick` stays a one-minute loop; HYPOTHESIS_PROFILE picks one by name. Tests that set max_examples
# themselves scale it with examples().
settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=20)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI", "").lower() == "true" else "dev")
settings.load_profile(PROFILE)


def examples(full: int) -> int:
    """A test's own max_examples under the active hypothesis profile: ``full`` in CI, a fifth (at least 10)
    elsewhere."""
    return full if PROFILE == "ci" else max(10, full // 5)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[types.FunctionType, frozenset[str]] = {}
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if isinstance(item, pytest.Function):
            for mark in tier_marks(item, seen, xdist):
                item.add_marker(mark)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: each computes the same order from the same items
        items[:] = spread_exclusive(items)
        write_groups(items, Path(config.workerinput["indexer_lock_dir"]), config.workerinput["workerid"])


# `exclusive` under pytest-xdist: tests/tiers.py's run_lock (process tests share it, or run beside an exclusive
# test, which holds it alone, at a lower priority or else confined to their worker's CPU; in-process tests take
# none) and spread_exclusive's order. The controller makes the locks' folder and hands it to its workers; a run
# without workers takes no lock.
LOCK_DIR = pytest.StashKey[Path]()
OWN_CPU = pytest.StashKey["set[int] | None"]()
RENICE = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        config.stash[LOCK_DIR] = Path(tempfile.mkdtemp(prefix="indexer-tests-lock-"))
    else:  # a worker: how its process tests yield to an exclusive test beside them (before any test runs)
        config.stash[OWN_CPU] = worker_cpu(os.sched_getaffinity(0))
        config.stash[RENICE] = can_renice()


def pytest_unconfigure(config: pytest.Config) -> None:
    if LOCK_DIR in config.stash:
        shutil.rmtree(config.stash[LOCK_DIR], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # pytest-xdist's hook: a worker is about to start
    node.workerinput["indexer_lock_dir"] = str(node.config.stash[LOCK_DIR])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """--dist loadgroup with the groups the workers' collection wrote (tests/tiers.py's group_scheduling)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return group_scheduling(config, log, config.stash[LOCK_DIR])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    directory = getattr(item.config, "workerinput", {}).get("indexer_lock_dir")
    exclusive, process, all_cpus = (
        item.get_closest_marker(m) is not None for m in ("exclusive", "process", "all_cpus")
    )
    own_cpu, renice = item.config.stash.get(OWN_CPU, None), item.config.stash.get(RENICE, False)
    with run_lock(directory, exclusive, process, own_cpu, all_cpus, renice):
        return (yield)


# A test marked needs_tool (tests/tools.py) whose tool is missing: skipped with the reason, or failed where
# REQUIRE_TEST_TOOLS=1 (`make test`), before any of its fixtures is set up.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    missing_tool(item)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def triton_cpu():
    """The Triton kernel through Triton's CPU interpreter, behind the service's builder; a skip where this
    Triton's interpreter cannot run it."""
    import numpy as np
    import triton
    from triton.runtime.errors import InterpreterError

    from indexer_service.kernels.inputs import ChunkInputs
    from indexer_service.kernels.triton_kernel import interpreted_kernel
    from indexer_service.kernels.triton_launcher import TritonChunkBuilder

    builder = TritonChunkBuilder("cpu", kernel=interpreted_kernel())
    try:
        builder(ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3))
    except InterpreterError as exc:
        # Triton 3.6's interpreter calls int() on a one-element array for a loop bound loaded from memory,
        # which numpy 2.5 refuses (seen on the H200 image); Triton 3.9's does not. The compiled kernel is
        # unaffected (tests/kernels/test_gpu.py).
        if "only 0-dimensional arrays" not in str(exc):
            raise
        pytest.skip(f"this Triton {triton.__version__} interpreter cannot run with numpy {np.__version__}: {exc}")
    return builder
