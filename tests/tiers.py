"""The test tiers, decided at collection from what each test does (tests/conftest.py applies them), so a new test
lands in its tier without anyone marking it; and the run lock that makes every other test beside an `exclusive` one
under pytest-xdist yield the CPU to it."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import inspect
import json
import os
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

# Markers applied at collection, so nobody has to remember them. A test "reaches" a module when its own code, its
# fixtures, or the helpers of tests/ and testkit/ they call (followed transitively) name something of it. Product code
# is not followed: what it spawns in process (ldconfig, ptxas) is part of a unit under test, not a separate program the
# test runs.
# `process`: reaches a way to start a process (servers, the CLI, compilers, other-language clients).
SPAWNING_MODULES = frozenset({"subprocess", "multiprocessing", "concurrent.futures.process", "asyncio.subprocess"})
SPAWNING_OS_CALLS = frozenset(
    {
        *("fork", "forkpty", "system", "popen"),
        *("posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnl"),
        *("execv", "execve", "execvp", "execl"),
    }
)
# `exclusive`: reaches the attack clients or the timing observers (victims, probes, the soak), whose figures a
# concurrent test of the same run would skew; such a test runs with nothing else of the run beside it.
TIMING_MODULES = frozenset(
    {"testkit.siege", "testkit.observe", "testkit.h2raw", "testkit.http1raw", "testkit.streams", "testkit.soak"}
)
FOLLOWED_PACKAGES = ("tests", "testkit")
# The `xdist_group` of the `exclusive` tests outside a module's group: one worker runs them one after the other
# (two at once would wait for each other's run lock, a worker idle meanwhile) while the other runs the rest beside
# them, yielding to them (run_lock). pytest-xdist hands out its largest groups first, this one among them.
EXCLUSIVE = "exclusive"


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _followed(value: object) -> bool:
    return (getattr(value, "__module__", None) or "").startswith(FOLLOWED_PACKAGES)


def functions_of(value: object) -> list[types.FunctionType]:
    """The Python functions behind a function, method, property or class of the followed packages."""
    if isinstance(value, type):
        members = [m for klass in value.__mro__ if _followed(klass) for m in vars(klass).values()]
        return [f for member in members for f in functions_of(member)]
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
    if value is None:  # `import subprocess` inside the function: a name that is not in its globals
        return {name} if name != "os" or SPAWNING_OS_CALLS & set(names) else set()
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
            for callee in functions_of(value):
                reached |= reached_modules(callee, seen)
    seen[function] = frozenset(reached)
    return seen[function]


def tier_marks(
    item: pytest.Function, seen: dict[types.FunctionType, frozenset[str]], xdist: bool
) -> list[pytest.MarkDecorator]:
    """The markers ``item`` gets: `process`, `exclusive`, and an `xdist_group` that keeps on one pytest-xdist worker
    (--dist loadgroup) the process tests of a module sharing a module-scoped fixture of ours (the deploy tests' pod
    and replicas, a fuzzed server), so that it starts once, and every other `exclusive` test together (EXCLUSIVE,
    where pytest-xdist is loaded, which defines that marker). ``seen`` caches what each function reaches."""
    definitions = [d for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    reached = {
        m
        for root in (item.function, *(d.func for d in definitions))
        for f in functions_of(root)
        for m in reached_modules(f, seen)
    }
    marks = []
    grouped = False
    if spawns(reached):
        marks.append(pytest.mark.process)
        if xdist and any(d.scope in ("module", "class", "package") and functions_of(d.func) for d in definitions):
            marks.append(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
            grouped = True
    exclusive = bool(reached & TIMING_MODULES)
    if exclusive:
        marks.append(pytest.mark.exclusive)
    if xdist and (exclusive or item.get_closest_marker("exclusive")) and not grouped:
        marks.append(pytest.mark.xdist_group(EXCLUSIVE))
    return marks


def spawns(modules: frozenset[str] | set[str]) -> bool:
    return bool(modules & SPAWNING_MODULES) or "os" in modules


def spread_exclusive(items: list[pytest.Item]) -> list[pytest.Item]:
    """The run's order for pytest-xdist: the `process` tests (the long ones) with the `exclusive` ones spread evenly
    among them, then the in-process tests (the run's short tail). While one worker runs an `exclusive` test, the
    other thus finds process tests to run beside it, each yielding to it (:func:`run_lock`), rather than
    waiting with nothing to do once the in-process tests are gone. Within each tier the collection order is kept;
    a module cut in two by an `exclusive` test sets its (in-process) module fixtures up twice, as a module spread
    over two workers already does."""
    exclusive = [i for i in items if i.get_closest_marker("exclusive")]
    process = [i for i in items if i.get_closest_marker("process") and not i.get_closest_marker("exclusive")]
    light = [i for i in items if not i.get_closest_marker("process") and not i.get_closest_marker("exclusive")]
    every = len(process) / max(1, len(exclusive))  # process tests between two `exclusive` ones
    ordered = []
    for k, item in enumerate(exclusive):
        ordered.append(item)
        ordered.extend(process[round(k * every) : round((k + 1) * every)])
    return [*ordered, *light] if exclusive else [*process, *light]


def worker_cpu(cpus: set[int]) -> set[int] | None:
    """The one CPU every worker confines a process test to beside an `exclusive` test where it cannot lower its
    priority instead (:func:`can_renice`; the last of the run's: all the workers' confined tests share it, so that
    they take one CPU together however many workers run), or None where the run has a single CPU (nothing to
    confine to: such a test waits its turn instead)."""
    return {max(cpus)} if len(cpus) > 1 else None


# Beside an `exclusive` test, a process test and every process it starts run at this niceness: weighed 110 against
# the exclusive test's 1024 (nice 0), they take the CPU time it leaves, on any CPU, and about a tenth of a CPU it
# wants too. Pinned to one CPU at nice 0 instead, they left half the other CPU idle behind the exclusive tests'
# timers, and took half of theirs from any exclusive process that ran on it.
BESIDE_NICENESS = 10


def _thread_niceness(change: int) -> bool:
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + change)
    except PermissionError:
        return False
    return True


def can_renice() -> bool:
    """Whether this process can lower a thread's niceness back once raised (CAP_SYS_NICE, or an RLIMIT_NICE that
    allows it): tried on a thread of its own, which ends with the try."""
    undone: list[bool] = []
    probe = threading.Thread(target=lambda: undone.append(_thread_niceness(1) and _thread_niceness(-1)))
    probe.start()
    probe.join()
    return undone == [True]


@contextlib.contextmanager
def confined(cpus: set[int], renice: bool) -> Iterator[None]:
    """Every thread of this process (and so every process it starts meanwhile, which inherits it) yielding to an
    `exclusive` test: at BESIDE_NICENESS (or above) where ``renice`` (:func:`can_renice`), else on ``cpus`` only;
    then back to where each was."""

    def tasks() -> list[int]:
        return [int(tid) for tid in os.listdir("/proc/self/task")]

    def apply(tid: int, setting: object) -> None:
        with contextlib.suppress(OSError):  # a thread that ended since it was listed
            if renice:
                os.setpriority(os.PRIO_PROCESS, tid, setting)
            else:
                os.sched_setaffinity(tid, setting)

    if renice:
        before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        beside = max(before, BESIDE_NICENESS)
    else:
        before, beside = os.sched_getaffinity(0), cpus
    for tid in tasks():
        apply(tid, beside)
    try:
        yield
    finally:
        for tid in tasks():
            apply(tid, before)


def _try_flock(file: object, operation: int) -> bool:
    try:
        fcntl.flock(file, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def run_lock(
    directory: str | None,
    exclusive: bool,
    process: bool = True,
    own_cpu: set[int] | None = None,
    all_cpus: bool = False,
    renice: bool = False,
) -> Iterator[None]:
    """Held by every `process` test of an xdist run from its setup to its teardown. An `exclusive` test holds it
    alone, so that no other test's servers, clients or compilers take CPU time it wants: a process test holds it
    shared where no `exclusive` test runs or waits for its turn; beside one, it runs at once, holding nothing,
    with itself and every process it starts at a lower priority (``renice``) or confined to ``own_cpu`` (the
    worker's CPU) where it cannot undo that (:func:`confined`); an in-process test (``process`` False, no lock)
    takes one CPU at most, by its one interpreter. ``own_cpu`` None (a single CPU) or ``all_cpus`` (a process test
    that needs every CPU: CPU pinning): it never runs beside one; it waits its turn for a shared hold. A test waiting
    to hold the lock alone holds the turnstile meanwhile, so that the other workers' next tests do not keep a
    shared hold forever. ``directory`` None (no workers): no lock."""
    if directory is None or not (process or exclusive):
        yield
        return
    with open(Path(directory) / "turnstile", "a") as turnstile, open(Path(directory) / "run", "a") as run:
        waits = exclusive or all_cpus or own_cpu is None
        if waits:
            fcntl.flock(turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            held = True
        elif _try_flock(turnstile, fcntl.LOCK_EX):  # no `exclusive` test waiting for its turn...
            try:
                held = _try_flock(run, fcntl.LOCK_SH)  # ...nor running
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            held = False
        if not held:
            assert own_cpu is not None
            with confined(own_cpu, renice):
                yield
            return
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)


def write_groups(items: list[pytest.Item], directory: Path, worker: str) -> None:
    """Each grouped test's `xdist_group`, for :func:`group_scheduling` (every worker writes the same). A module's
    group that holds an `exclusive` test joins EXCLUSIVE whole (its shared fixture still set up once): on the
    other worker, that test would wait for the exclusive tests' run lock while its worker stood idle."""
    groups = {item.nodeid: mark.args[0] for item in items if (mark := item.get_closest_marker("xdist_group"))}
    joining = {groups[item.nodeid] for item in items if item.get_closest_marker("exclusive") and item.nodeid in groups}
    groups = {nodeid: EXCLUSIVE if group in joining else group for nodeid, group in groups.items()}
    (directory / f"groups-{worker}.json").write_text(json.dumps(groups))


def read_groups(directory: Path) -> dict[str, str]:
    """What :func:`write_groups` wrote: node id -> group."""
    groups: dict[str, str] = {}
    for path in sorted(directory.glob("groups-*.json")):
        groups.update(json.loads(path.read_text()))
    return groups


def group_scheduling(config: pytest.Config, log: object, directory: Path) -> object:
    """pytest-xdist's --dist loadgroup scheduler, grouping by the groups the workers wrote into ``directory``
    (:func:`write_groups`). pytest-xdist itself appends each test's group to ``item._nodeid``, which pytest 9 no
    longer reads (a node id comes from its structured ``_id``): the groups never reached its scheduler, and each
    module's shared fixture (a pod, a fuzzed server, the light client's environments) was set up on both
    workers. Any test without a group here falls back to pytest-xdist's own reading of its node id."""
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if not getattr(self, "groups", None):  # read once the workers have collected (it asks only then)
                self.groups = read_groups(directory)
            group = self.groups.get(nodeid)
            return group if group is not None else super()._split_scope(nodeid)

    return GroupScheduling(config, log)
