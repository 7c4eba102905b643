"""An attacker run in a process of its own, so that its threads do not share the observers' interpreter.

A flood of many client threads (testkit.streams) in the process that also runs the probes and the victim takes
their GIL: the probes then measure the flood's own client, late by up to seconds while the server answers in
milliseconds. :class:`Apart` runs the attacker in a spawned child from ``with`` to its end, as another machine
would, and brings back the attributes it names once the attacker has stopped. The child starts (its interpreter
and imports, a CPU-second) when the :class:`Apart` is made, so that this costs the siege nothing: make it before
the siege's quiet run."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Self

START_SECONDS = 60.0  # the child's interpreter start and imports, on a loaded 2-CPU machine
STOP_SECONDS = 30.0


def _attack(
    make: Callable[..., AbstractContextManager],
    args: tuple,
    keep: tuple[str, ...],
    go: multiprocessing.synchronize.Event,
    started: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
    kept: multiprocessing.Queue,
) -> None:
    go.wait()
    attacker = make(*args)
    with attacker:
        started.set()
        stop.wait()
    kept.put({name: getattr(attacker, name) for name in keep})


class Apart:
    """``make(*args)`` (a context manager: an attacker) entered in a child process, started now, from ``with`` to
    its end; ``kept``: its attributes named in ``keep`` once it has stopped. ``make`` and ``args`` must pickle (a
    class and plain values)."""

    def __init__(self, make: Callable[..., AbstractContextManager], *args: object, keep: tuple[str, ...] = ()) -> None:
        context = multiprocessing.get_context("spawn")
        self._go, self._started, self._stop = context.Event(), context.Event(), context.Event()
        self._kept = context.Queue()
        self._process = context.Process(
            target=_attack, args=(make, args, keep, self._go, self._started, self._stop, self._kept), daemon=True
        )
        self._process.start()
        self.kept: dict[str, object] = {}

    @property
    def pid(self) -> int:
        """The attacker's process."""
        return self._process.pid

    def __enter__(self) -> Self:
        self._go.set()
        if not self._started.wait(START_SECONDS):
            self._process.kill()
            raise RuntimeError(f"the attacker's process did not start within {START_SECONDS:g} s")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        try:
            self.kept = self._kept.get(timeout=STOP_SECONDS)
        finally:
            self._process.join(STOP_SECONDS)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
