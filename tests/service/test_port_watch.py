"""Whether the RPC port takes new callers (service/transport/port_watch.py), and what health says of it: every place
held by callers makes the replica not ready and leaves it alive; no call finishing or no answer makes it not ready,
then not alive; the watch's own pauses are excused. On a real server, the health names follow within seconds."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from queue import SimpleQueue

import grpc
import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import codec
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.config import load_config
from indexer_service.service.transport import port_watch
from indexer_service.service.transport.gate import Lane
from indexer_service.service.transport.grpc_server import HEALTH_NAMES, create_grpc_server
from indexer_service.service.transport.health import NOT_SERVING, SERVING, HealthServicer
from indexer_service.service.transport.port_watch import RpcPortWatch
from testkit.harness import wait_for
from testkit.planes import make_plane


class Gate:
    """What the watch reads of a gate: the places held in a lane."""

    def __init__(self) -> None:
        self.live = 0

    def held(self, lane: Lane) -> int:
        return self.live


@pytest.fixture
def watched() -> tuple[Gate, Lane, RpcPortWatch]:
    gate, lane = Gate(), Lane("grpc", 2, 4, queue=SimpleQueue())
    return gate, lane, RpcPortWatch(gate, lane, lambda problem, broken: None)


def run_until(watch: RpcPortWatch, start: float, seconds: int) -> tuple[str, bool]:
    """The watch checked every second from ``start`` to ``start + seconds``; its last answer."""
    for second in range(1, seconds + 1):
        state = watch.check(start + second)
    return state


def test_places_all_held_make_the_port_not_ready_never_broken(watched) -> None:
    gate, _lane, watch = watched
    start = watch._last_run
    gate.live = 4
    assert run_until(watch, start, 1) == ("", False)
    problem, broken = run_until(watch, start, 3)
    assert "all 4 places held" in problem and not broken
    assert run_until(watch, start, 100)[1] is False
    gate.live = 3
    assert watch.check(start + 101) == ("", False)


def test_queued_calls_that_never_finish_are_not_ready_then_broken(watched) -> None:
    _gate, lane, watch = watched
    start = watch._last_run
    lane.queue.put("waiting for a thread")
    assert run_until(watch, start, 4) == ("", False)
    problem, broken = run_until(watch, start, 6)
    assert "none finished" in problem and not broken
    assert run_until(watch, start, 31)[1] is True
    lane.finished += 1  # a call finished: progress
    assert watch.check(start + 32) == ("", False)


def test_an_idle_lane_is_never_stuck(watched) -> None:
    _gate, _lane, watch = watched
    assert run_until(watch, watch._last_run, 60) == ("", False)


def test_time_the_watch_did_not_run_is_excused(watched) -> None:
    _gate, lane, watch = watched
    lane.queue.put("waiting for a thread")
    start = watch._last_run
    assert watch.check(start + 1) == ("", False)
    assert watch.check(start + 120) == ("", False)  # the process was stopped for two minutes
    assert run_until(watch, start + 120, 2) == ("", False)  # 4 s stuck in all, the pause not counted


# -- on a real server -----------------------------------------------------------------------------------------------


class Served:
    """A real RPC server with its watch, whose BuildChunk waits for ``release``, and its health's statuses."""

    def __init__(self, tmp_path: Path, probe: Path | None = None, **settings: str) -> None:
        config = load_config({"grpc_host": "127.0.0.1", "grpc_port": "0", "warmup_target": "none", **settings}, env={})
        self.plane = plane = make_plane(config)
        plane.readiness.refresh()
        self.release = threading.Event()
        call = plane.call

        def held_call(*args: object, **kwargs: object) -> bytes:
            self.release.wait(30)
            return call(*args, **kwargs)

        plane.call = held_call
        self.health = HealthServicer(HEALTH_NAMES)
        plane.readiness.add_listener(lambda ready: self.health.set_serving(ready, [SERVICE_NAME]))
        plane.readiness.add_alive_listener(lambda alive: self.health.set_serving(alive, [""]))
        socket = tmp_path / "rpc.sock"
        self.server = create_grpc_server(
            config, plane, self.health, probe_socket=socket, report=plane.readiness.set_rpc_port
        )
        if probe is not None:  # the watch asks elsewhere: a port that answers nothing
            self.server.watch.stop()
            self.server.watch = RpcPortWatch(self.server.gate, self.server.lane, plane.readiness.set_rpc_port, probe)
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")

    def status(self, name: str) -> int:
        return self.health._status[name]

    def close(self) -> None:
        self.release.set()
        self.channel.close()
        self.server.stop(1.0)
        self.health.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[list[Served]]:
    made: list[Served] = []
    yield made
    for server in made:
        server.close()


def test_callers_holding_every_place_turn_readiness_not_liveness(tmp_path: Path, served) -> None:
    server = Served(tmp_path, max_concurrent_rpcs="2", max_concurrent_rpcs_per_peer="0")
    served.append(server)
    assert server.status(SERVICE_NAME) == SERVING and server.status("") == SERVING
    request = codec.chunk_inputs_to_proto(ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3))
    stub = pb_grpc.PrefillMetadataStub(server.channel)
    held = [stub.BuildChunk.future(request, timeout=30) for _ in range(2)]
    wait_for(lambda: server.status(SERVICE_NAME) == NOT_SERVING, 10, "readiness to turn NOT_SERVING")
    assert server.status("") == SERVING
    assert "places held" in server.plane.readiness.not_ready_reason()
    server.release.set()
    for call in held:
        call.result(10)
    wait_for(lambda: server.status(SERVICE_NAME) == SERVING, 10, "readiness back once places are free")


def test_a_port_that_answers_nothing_turns_readiness_then_liveness(tmp_path: Path, served, monkeypatch) -> None:
    monkeypatch.setattr(port_watch, "STUCK_SECONDS", 2.0)
    monkeypatch.setattr(port_watch, "BROKEN_SECONDS", 4.0)
    server = Served(tmp_path, probe=tmp_path / "nobody.sock")
    served.append(server)
    wait_for(lambda: server.status(SERVICE_NAME) == NOT_SERVING, 10, "readiness to turn NOT_SERVING")
    wait_for(lambda: server.status("") == NOT_SERVING, 10, "liveness to turn NOT_SERVING")
    assert server.plane.readiness.rpc_port_broken
