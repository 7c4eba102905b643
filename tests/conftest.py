"""Fixtures of every layer, the test tiers' markers and the hypothesis profiles. Nothing here imports the service
(tests/kernels/ runs without its compiled extension); the service layer's fixtures, real server processes among
them, are tests/service/conftest.py's."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import inspect
import os
import shutil
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

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


# Markers applied at collection, so nobody has to remember them. A test "reaches" a module when its own code, its
# fixtures, or the helpers of tests/, testkit/ and benchmarks/ they call (followed transitively) name something of
# it. Product code is not followed: what it spawns in process (ldconfig, ptxas) is part of a unit under test, not a
# separate program the test runs.
# `process`: reaches a way to start a process (servers, the CLI, compilers, other-language clients).
SPAWNING_MODULES = frozenset({"subprocess", "multiprocessing", "concurrent.futures.process", "asyncio.subprocess"})
SPAWNING_OS_CALLS = frozenset({"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv",
                               "spawnve", "spawnl", "execv", "execve", "execvp", "execl"})  # fmt: skip
# `exclusive`: reaches the attack clients or the timing observers (victims, probes, the soak), whose figures a
# concurrent test of the same run would skew; such a test runs with nothing else of the run beside it.
TIMING_MODULES = frozenset({"testkit.siege", "testkit.observe", "testkit.h2raw", "testkit.http1raw", "testkit.soak"})
FOLLOWED_PACKAGES = ("tests", "testkit", "benchmarks")


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _followed(value: object) -> bool:
    return (getattr(value, "__module__", None) or "").startswith(FOLLOWED_PACKAGES)


def _functions_of(value: object) -> list[types.FunctionType]:
    """The Python functions behind a function, method, property or class of the followed packages."""
    if isinstance(value, type):
        members = [m for klass in value.__mro__ if _followed(klass) for m in vars(klass).values()]
        return [f for member in members for f in _functions_of(member)]
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset) if isinstance(f, types.FunctionType)]
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    value = inspect.unwrap(value) if callable(value) else value
    return [value] if isinstance(value, types.FunctionType) and _followed(value) else []


def _modules_named(name: str, value: object, names: tuple[str, ...]) -> set[str]:
    """The modules that the global ``name`` (resolved to ``value``) of a code object naming ``names`` stands for."""
    if isinstance(value, types.ModuleType):
        if value is os:
            return {"os"} if SPAWNING_OS_CALLS & set(names) else set()
        return {value.__name__}
    if value is None:
        return {name}  # `import subprocess` inside the function: a name that is not in its globals
    return {getattr(value, "__module__", None) or ""}


def reached_modules(function: types.FunctionType, seen: dict[types.FunctionType, frozenset[str]]) -> frozenset[str]:
    """Every module ``function``, or what it calls among the followed packages, names something of."""
    if function in seen:
        return seen[function]
    seen[function] = frozenset()  # a cycle adds nothing
    reached: set[str] = set()
    for code in _code_objects(function.__code__):
        for name in code.co_names:
            value = function.__globals__.get(name, getattr(builtins, name, None))
            reached |= _modules_named(name, value, code.co_names)
            for callee in _functions_of(value):
                reached |= reached_modules(callee, seen)
    seen[function] = frozenset(reached)
    return seen[function]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[types.FunctionType, frozenset[str]] = {}
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        definitions = [d for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        reached = {
            m
            for root in (item.function, *(d.func for d in definitions))
            for f in _functions_of(root)
            for m in reached_modules(f, seen)
        }
        if spawns(reached):
            item.add_marker(pytest.mark.process)
        if reached & TIMING_MODULES:
            item.add_marker(pytest.mark.exclusive)
        # pytest-xdist (--dist loadgroup) spreads tests one by one, but keeps on one worker the process tests of a
        # module that share a module-scoped fixture of ours (the deploy tests' pod and replicas, a fuzzed server),
        # so that it starts once.
        shared = [d for d in definitions if d.scope in ("module", "class", "package") and _functions_of(d.func)]
        if shared and spawns(reached):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def spawns(modules: frozenset[str] | set[str]) -> bool:
    return bool(modules & SPAWNING_MODULES) or "os" in modules


# `exclusive` under pytest-xdist: every test holds the run lock, shared, from its setup to its teardown, and an
# exclusive one holds it alone. A test waiting for it alone holds the turnstile, so that the other workers' next
# tests queue behind it instead of keeping a shared hold forever. The controller makes the locks' folder and hands
# it to its workers; a run without workers takes no lock.
LOCK_DIR = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        config.stash[LOCK_DIR] = Path(tempfile.mkdtemp(prefix="indexer-tests-lock-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    if LOCK_DIR in config.stash:
        shutil.rmtree(config.stash[LOCK_DIR], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # pytest-xdist's hook: a worker is about to start
    node.workerinput["indexer_lock_dir"] = str(node.config.stash[LOCK_DIR])


@contextlib.contextmanager
def run_lock(directory: str | None, exclusive: bool) -> Iterator[None]:
    if directory is None:
        yield
        return
    with open(Path(directory) / "turnstile", "a") as turnstile, open(Path(directory) / "run", "a") as run:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    directory = getattr(item.config, "workerinput", {}).get("indexer_lock_dir")
    with run_lock(directory, exclusive=item.get_closest_marker("exclusive") is not None):
        return (yield)


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
    from indexer_service.kernels.triton_kernel import TritonChunkBuilder, interpreted_kernel

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
