"""Fixtures of every layer, the test tiers' markers and the hypothesis profiles. Nothing here imports the service
(tests/kernels/ runs without its compiled extension); the service layer's fixtures, real server processes among
them, are tests/service/conftest.py's."""

from __future__ import annotations

import builtins
import inspect
import os
import types
from collections.abc import Iterator

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


# The `process` marker, applied at collection (nobody has to remember it): a test whose own code, fixtures, or
# the helpers of tests/, testkit/ and benchmarks/ they call (followed transitively) name one of these starts
# processes: servers, the CLI, compilers, other-language clients. Product code is not followed: what it spawns
# in process (ldconfig, ptxas) is part of a unit under test, not a separate program the test runs.
SPAWNING_MODULES = frozenset({"subprocess", "multiprocessing", "concurrent.futures.process", "asyncio.subprocess"})
SPAWNING_OS_CALLS = frozenset({"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv",
                               "spawnve", "spawnl", "execv", "execve", "execvp", "execl"})  # fmt: skip
FOLLOWED_PACKAGES = ("tests", "testkit", "benchmarks")


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _functions_of(value: object) -> list[types.FunctionType]:
    """The Python functions behind a function, method, property or class of the followed packages."""
    if isinstance(value, type):
        if not value.__module__.startswith(FOLLOWED_PACKAGES):
            return []
        members = [m for klass in value.__mro__ if klass.__module__.startswith(FOLLOWED_PACKAGES)
                   for m in vars(klass).values()]  # fmt: skip
        return [f for member in members for f in _functions_of(member)]
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset) if isinstance(f, types.FunctionType)]
    if isinstance(value, staticmethod | classmethod):
        value = value.__func__
    value = inspect.unwrap(value) if callable(value) else value
    if isinstance(value, types.FunctionType) and (value.__module__ or "").startswith(FOLLOWED_PACKAGES):
        return [value]
    return []


def _names_a_spawner(name: str, value: object, names: tuple[str, ...]) -> bool:
    if name in SPAWNING_MODULES:  # also `import subprocess` inside the function, not in its globals
        return True
    if isinstance(value, types.ModuleType):
        return value.__name__ in SPAWNING_MODULES or (value is os and bool(SPAWNING_OS_CALLS & set(names)))
    return (getattr(value, "__module__", None) or "") in SPAWNING_MODULES


def starts_processes(function: types.FunctionType, seen: dict[types.FunctionType, bool]) -> bool:
    """Whether ``function``, or what it calls among the followed packages, names a way to start a process."""
    if function in seen:
        return seen[function]
    seen[function] = False  # a cycle adds nothing
    found = False
    for code in _code_objects(function.__code__):
        for name in code.co_names:
            value = function.__globals__.get(name, getattr(builtins, name, None))
            if _names_a_spawner(name, value, code.co_names) or any(
                starts_processes(f, seen) for f in _functions_of(value)
            ):
                found = True
                break
        if found:
            break
    seen[function] = found
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: dict[types.FunctionType, bool] = {}
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        if any(starts_processes(f, seen) for candidate in (item.function, *fixtures) for f in _functions_of(candidate)):
            item.add_marker(pytest.mark.process)


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
