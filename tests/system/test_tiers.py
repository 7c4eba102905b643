"""tests/tiers.py's scheduling rules under pytest-xdist: the order the workers run the tests in, and the run lock
that keeps an `exclusive` test away from every process test but not from in-process ones."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from tests.tiers import run_lock, spread_exclusive


@dataclass
class Item:
    """What spread_exclusive reads of a collected test: its node id and its tier markers."""

    nodeid: str
    marks: tuple[str, ...] = ()

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.marks else None


def test_process_tests_come_first_and_exclusive_ones_are_spread_among_the_in_process_ones() -> None:
    process = [Item(f"p{n}", ("process",)) for n in range(3)]
    exclusive = [Item(f"x{n}", ("process", "exclusive")) for n in range(3)]
    light = [Item(f"l{n}") for n in range(9)]
    items = [light[0], exclusive[0], process[0], *light[1:5], exclusive[1], process[1], *light[5:], exclusive[2]]
    items.append(process[2])
    order = [i.nodeid for i in spread_exclusive(items)]
    assert order == ["p0", "p1", "p2", "x0", "l0", "l1", "l2", "x1", "l3", "l4", "l5", "x2", "l6", "l7", "l8"]
    no_exclusive = [process[0], light[0], process[1]]
    assert [i.nodeid for i in spread_exclusive(no_exclusive)] == ["p0", "p1", "l0"]


def _holds_while(directory: Path, held: dict[str, bool], exclusive: bool, process: bool) -> bool:
    """Whether a test of this kind gets the run lock while another test holds it as ``held`` says. A lock that
    should have been granted is granted at once (10 s is for a loaded machine); a refused one is still refused
    after half a second, and a wrongly granted one would have been granted at once."""
    got = threading.Event()

    def take() -> None:
        with run_lock(str(directory), exclusive=exclusive, process=process):
            got.set()

    with run_lock(str(directory), **held):
        thread = threading.Thread(target=take)
        thread.start()
        compatible = not process or not (exclusive or held["exclusive"])  # the rule under test, for the wait only
        acquired = got.wait(10.0 if compatible else 0.5)
    thread.join(10)
    return acquired


def test_an_exclusive_test_shuts_out_process_tests_but_not_in_process_ones(tmp_path: Path) -> None:
    exclusive = {"exclusive": True, "process": True}
    assert _holds_while(tmp_path, exclusive, exclusive=False, process=False)
    assert not _holds_while(tmp_path, exclusive, exclusive=False, process=True)
    assert not _holds_while(tmp_path, exclusive, exclusive=True, process=True)
    shared = {"exclusive": False, "process": True}
    assert _holds_while(tmp_path, shared, exclusive=False, process=True)
    assert not _holds_while(tmp_path, shared, exclusive=True, process=True)
