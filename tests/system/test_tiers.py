"""tests/tiers.py's scheduling rules under pytest-xdist: the order the workers run the tests in, and the run lock
that lets beside an `exclusive` test only in-process tests and process tests that yield to it (at a lower priority,
or confined to one CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from testkit.paths import REPO
from tests.tiers import (
    BESIDE_NICENESS,
    can_renice,
    read_groups,
    run_lock,
    spread_exclusive,
    write_groups,
)


@dataclass
class Item:
    """What spread_exclusive reads of a collected test: its node id and its tier markers."""

    nodeid: str
    marks: tuple[str, ...] = ()

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.marks else None


def test_exclusive_tests_are_spread_among_the_process_tests_and_the_in_process_ones_come_last() -> None:
    process = [Item(f"p{n}", ("process",)) for n in range(6)]
    exclusive = [Item(f"x{n}", ("process", "exclusive")) for n in range(3)]
    light = [Item(f"l{n}") for n in range(4)]
    items = [light[0], exclusive[0], process[0], *light[1:3], exclusive[1], *process[1:5], light[3], exclusive[2]]
    items.append(process[5])
    order = [i.nodeid for i in spread_exclusive(items)]
    assert order == ["x0", "p0", "p1", "x1", "p2", "p3", "x2", "p4", "p5", "l0", "l1", "l2", "l3"]
    no_exclusive = [process[0], light[0], process[1]]
    assert [i.nodeid for i in spread_exclusive(no_exclusive)] == ["p0", "p1", "l0"]


def _holds_while(directory: Path, held: dict[str, object], expected: bool, **wants: object) -> bool:
    """Whether a test of the kind ``wants`` says gets past the run lock while another test holds it as ``held``
    says. ``expected`` sets the wait only: one expected to get past is given 10 s (a loaded machine), one expected
    to be refused half a second (a wrongly admitted one would get past at once)."""
    got = threading.Event()

    def take() -> None:
        with run_lock(str(directory), **wants):
            got.set()

    with run_lock(str(directory), **held):
        thread = threading.Thread(target=take)
        thread.start()
        acquired = got.wait(10.0 if expected else 0.5)
    thread.join(10)
    return acquired


def test_beside_an_exclusive_test_only_in_process_tests_and_confined_process_tests_run(tmp_path: Path) -> None:
    own_cpu = {min(os.sched_getaffinity(0))}
    exclusive = {"exclusive": True, "process": True, "own_cpu": own_cpu}
    cases = [
        (exclusive, True, {"exclusive": False, "process": False}),
        (exclusive, True, {"exclusive": False, "process": True, "own_cpu": own_cpu}),  # confined
        (exclusive, False, {"exclusive": False, "process": True, "own_cpu": None}),  # nowhere to confine it
        (exclusive, False, {"exclusive": False, "process": True, "own_cpu": own_cpu, "all_cpus": True}),
        (exclusive, False, {"exclusive": True, "process": True, "own_cpu": own_cpu}),
    ]
    shared = {"exclusive": False, "process": True, "own_cpu": own_cpu}
    cases += [
        (shared, True, {"exclusive": False, "process": True, "own_cpu": own_cpu}),
        (shared, False, {"exclusive": True, "process": True, "own_cpu": own_cpu}),
    ]
    for held, expected, wants in cases:
        assert _holds_while(tmp_path, held, expected, **wants) is expected, (held, wants)


def test_a_process_test_beside_an_exclusive_one_and_what_it_starts_yield_to_it(tmp_path: Path) -> None:
    """At a lower priority where the worker can undo it, else on its CPU only; in both, back after the test."""
    everywhere = os.sched_getaffinity(0)
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    own_cpu = {max(everywhere)}
    beside = max(niceness, BESIDE_NICENESS)
    where = "import os; print(sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0))"

    def process_test(renice: bool, seen: dict[str, object]) -> None:
        with run_lock(str(tmp_path), exclusive=False, process=True, own_cpu=own_cpu, renice=renice):
            seen["test"] = os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, 0)
            child = subprocess.run(
                [sys.executable, "-c", where], capture_output=True, text=True, timeout=60, check=True
            ).stdout.split("]")
            seen["child"] = set(json.loads(child[0] + "]")), int(child[1])
        seen["after"] = os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, 0)

    expected = {
        True: {"test": (everywhere, beside), "child": (everywhere, beside), "after": (everywhere, niceness)},
        False: {"test": (own_cpu, niceness), "child": (own_cpu, niceness), "after": (everywhere, niceness)},
    }
    for renice in {can_renice(), False}:  # this run's way, and the one it falls back to
        seen: dict[str, object] = {}
        with run_lock(str(tmp_path), exclusive=True, process=True, own_cpu=own_cpu):
            thread = threading.Thread(target=process_test, args=(renice, seen))
            thread.start()
            thread.join(60)
        assert seen == expected[renice], renice
    # Beside no exclusive test, nothing yields.
    with run_lock(str(tmp_path), exclusive=False, process=True, own_cpu=own_cpu, renice=True):
        assert (os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, 0)) == (everywhere, niceness)


def test_the_groups_the_workers_write_are_the_ones_the_scheduler_reads(tmp_path: Path) -> None:
    @dataclass
    class Mark:
        args: tuple[str, ...]

    @dataclass
    class Grouped(Item):
        group: str | None = None

        def get_closest_marker(self, name: str) -> object:
            return Mark((self.group,)) if name == "xdist_group" and self.group else super().get_closest_marker(name)

    items = [
        Grouped("a.py::t1", ("process", "exclusive"), group="exclusive"),
        Grouped("b.py::t2"),
        Grouped("c.py::t3", ("process",), group="c.py"),
        Grouped("d.py::t4", ("process",), group="d.py"),
        Grouped("d.py::t5", ("process", "exclusive"), group="d.py"),  # d.py's group joins the exclusive one
    ]
    write_groups(items, tmp_path, "gw0")
    write_groups(items, tmp_path, "gw1")
    groups = {"a.py::t1": "exclusive", "c.py::t3": "c.py", "d.py::t4": "exclusive", "d.py::t5": "exclusive"}
    assert read_groups(tmp_path) == groups


def test_a_modules_group_runs_on_one_worker() -> None:
    """Under `--dist loadgroup`, the tests sharing a module-scoped server (tests/service/test_http_trailers.py's)
    run on one worker, which starts it once: pytest-xdist's own grouping is lost under pytest 9 (tests/tiers.py's
    group_scheduling)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v",
         "tests/service/test_http_trailers.py", "-k", "within_the_limit or count"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    workers = set(re.findall(r"^\[(gw\d+)\] .* PASSED tests/service/test_http_trailers.py", run.stdout, re.M))
    assert len(re.findall(r" PASSED ", run.stdout)) >= 4 and len(workers) == 1, run.stdout[-3000:]
