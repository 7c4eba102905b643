"""The one gate every gRPC call passes (service/transport/gate.py): what grpcio needs of a pool (submit, one completion
callback per call, each run exactly once), lanes and their places, the per-peer shares, the calls that wait for their
request (holding no thread and no place, ended after ``request_seconds``), refusals, an exception on gRPC's polling
thread, and the shutdown; the calls held to grpcio's own answers on real servers on loopback."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import codec
from indexer_service.service.adapters import grpcio
from indexer_service.service.config import load_config
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.reasons import ShedReason
from indexer_service.service.transport.gate import (
    Accounting,
    CallDone,
    CallGate,
    Lane,
    never_started_reason,
    peer_key,
)
from indexer_service.service.transport.grpc_server import HEALTH_NAMES, create_grpc_server
from indexer_service.service.transport.health import HealthServicer
from testkit.harness import wait_for
from testkit.planes import make_plane
from testkit.streams import sends_nothing

SERVICE, METHOD = "test.Gate", "Echo"
PATH = f"/{SERVICE}/{METHOD}"


class Sheds(list):
    """Every shed the gate counted: (method, reason, detail)."""

    def __call__(self, method: str, reason: ShedReason, detail: str) -> None:
        self.append((method, reason, detail))

    def reasons(self) -> list[ShedReason]:
        return [reason for _, reason, _ in self]


@pytest.fixture
def sheds() -> Sheds:
    return Sheds()


@pytest.fixture
def make_gate(sheds: Sheds) -> Iterator[Callable[..., CallGate]]:
    gates = []

    def make(request_seconds: float = 30.0) -> CallGate:
        gates.append(CallGate(Accounting(Metrics(), sheds), request_seconds))
        return gates[-1]

    yield make
    for gate in gates:
        assert gate.shutdown(5.0) == 0


def test_peer_key_is_the_address_without_the_port() -> None:
    assert peer_key("ipv4:127.0.0.1:5000") == peer_key("ipv4:127.0.0.1:6000") == "127.0.0.1"
    assert peer_key("ipv6:[2001:db8::1]:5000") == peer_key("ipv6:[2001:db8::2]:7") != peer_key("ipv6:[::1]:1")
    assert peer_key("unix:/tmp/probe.sock") == "unix:/tmp/probe.sock"


# -- the pool grpcio sees -------------------------------------------------------------------------------------------


def routed(gate: CallGate, lane: Lane) -> Callable[[], None]:
    """A behaviour routed to ``lane``, submitted below as grpcio would submit a call's behaviour among its
    arguments (searched for, these not being grpcio's own arguments)."""

    def behaviour() -> None:
        gate.started.value = True

    gate.route(behaviour, METHOD, lane, unary_request=False, count_never_started=True)
    return behaviour


def test_a_call_runs_on_its_lanes_thread_and_holds_its_place_until_it_ends(make_gate) -> None:
    gate = make_gate()
    lane = gate.lane("work", 2, 10)
    behaviour, release, ran_on, ended = routed(gate, lane), threading.Event(), [], []

    def call(behaviour: Callable[[], None]) -> None:
        behaviour()
        ran_on.append(threading.current_thread().name)
        release.wait(10)

    done = gate.submit(call, behaviour)
    done.add_done_callback(ended.append)
    wait_for(lambda: ran_on, 5, "the call to start")
    assert gate.held(lane) == 1 and not ended and ran_on[0].startswith("work_")
    release.set()
    wait_for(lambda: ended, 5, "the call's completion callback")
    assert ended == [done] and done.done and gate.held(lane) == 0


def test_each_completion_callback_runs_exactly_once_however_it_races_the_end(make_gate) -> None:
    gate = make_gate()
    lane = gate.lane("work", 2, 10_000)
    behaviour = routed(gate, lane)
    runs: dict[int, int] = {}

    def count(index: int) -> None:
        runs[index] = runs.get(index, 0) + 1

    for index in range(2000):
        gate.submit(lambda b: b(), behaviour).add_done_callback(lambda done, index=index: count(index))
    wait_for(lambda: len(runs) == 2000 and gate.held(lane) == 0, 10, "every call's callback")
    assert set(runs.values()) == {1}
    done = gate.submit(lambda b: b(), behaviour)
    wait_for(lambda: done.done, 5, "the call to end")
    added_on = []
    done.add_done_callback(lambda _: added_on.append(threading.current_thread()))
    assert added_on == [threading.current_thread()]


def test_a_failing_completion_callback_is_logged_and_the_others_still_run(caplog) -> None:
    done, ran = CallDone(), []
    done.add_done_callback(lambda _: ran.append("first"))
    done.add_done_callback(lambda _: 1 / 0)
    with caplog.at_level(logging.ERROR):
        done.finish()
    assert ran == ["first"]
    assert any("completion callback failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_an_exception_escaping_a_call_is_logged_and_its_thread_serves_on(make_gate, caplog) -> None:
    gate = make_gate()
    lane = gate.lane("work", 1, 10)
    behaviour, ended = routed(gate, lane), []

    def explode(behaviour: Callable[[], None]) -> None:
        behaviour()
        raise RuntimeError("past grpcio's handling")

    with caplog.at_level(logging.ERROR):
        gate.submit(explode, behaviour).add_done_callback(ended.append)
        wait_for(lambda: ended, 5, "the failed call to end")
    logged = [r for r in caplog.records if "raised past gRPC's own handling" in r.getMessage()]
    assert logged and "past grpcio's handling" in str(logged[0].exc_info[1])
    gate.submit(lambda b: b(), behaviour).add_done_callback(ended.append)  # the one thread is still there
    wait_for(lambda: len(ended) == 2, 5, "the next call on the same thread")


def test_a_call_whose_behaviour_never_started_is_reported_with_its_method(make_gate) -> None:
    gate = make_gate()
    lane = gate.lane("work", 1, 10)
    behaviour, never_started, ended = routed(gate, lane), [], []
    gate.on_never_started = lambda method, reason, peer: never_started.append((method, reason))
    for fn in (lambda b: None, lambda b: b()):  # gRPC's wrapper, when the caller went away meanwhile; then served
        gate.submit(fn, behaviour).add_done_callback(ended.append)
    wait_for(lambda: len(ended) == 2, 5, "the two calls to end")
    # Not grpcio's own arguments: no deadline to tell whose doing it was, so counted as the service's
    assert never_started == [(METHOD, ShedReason.QUEUE_DEADLINE)]


def test_whose_doing_a_call_that_never_started_was() -> None:
    queued_at, now = 100.0, 105.0
    assert never_started_reason(99.0, queued_at, now) is ShedReason.DEADLINE_ON_ARRIVAL  # expired before it was in
    assert never_started_reason(100.0, queued_at, now) is ShedReason.DEADLINE_ON_ARRIVAL
    assert never_started_reason(100.004, queued_at, now) is ShedReason.DEADLINE_ON_ARRIVAL  # a 1 us budget, in ms
    assert never_started_reason(102.0, queued_at, now) is ShedReason.QUEUE_DEADLINE  # expired while it waited here
    assert never_started_reason(110.0, queued_at, now) is ShedReason.CALLER_CANCELLED  # its deadline still ahead
    assert never_started_reason(None, queued_at, now) is ShedReason.QUEUE_DEADLINE


def test_past_its_places_a_call_runs_its_refusing_twin_on_the_refusal_lane(make_gate) -> None:
    gate = make_gate()
    lane = gate.lane("work", 1, 1)
    release, ran, ended = threading.Event(), [], []

    def behaviour() -> None:
        ran.append(("served", threading.current_thread().name))
        release.wait(10)

    def refusing() -> None:
        ran.append(("refused", threading.current_thread().name))

    gate.route(behaviour, METHOD, lane, False, {ShedReason.CONCURRENCY: refusing})
    try:
        gate.submit(lambda b: b(), behaviour).add_done_callback(ended.append)
        wait_for(lambda: ran, 5, "the first call to start")
        gate.submit(lambda b: b(), behaviour).add_done_callback(ended.append)  # swapped for its refusing twin
        wait_for(lambda: len(ended) == 1, 5, "the refusal, while the first call still runs")
        assert ran[1][0] == "refused" and ran[1][1].startswith("refusals_")
        assert gate.held(lane) == 1
    finally:
        release.set()
    wait_for(lambda: len(ended) == 2, 5, "the first call")


def test_shutdown_waits_for_running_calls_and_reports_the_stuck(make_gate) -> None:
    gate = make_gate()
    lane = gate.lane("work", 2, 10)
    behaviour, stuck, started = routed(gate, lane), threading.Event(), threading.Event()

    def hang(behaviour: Callable[[], None]) -> None:
        started.set()
        stuck.wait(30)

    gate.submit(hang, behaviour)
    started.wait(5)
    assert gate.shutdown(0.2) == 1  # one thread still in its call; every other has stopped
    stuck.set()


def test_stopping_the_server_ends_its_threads() -> None:
    config = load_config({"grpc_host": "127.0.0.1", "grpc_port": "0", "warmup_target": "none"}, env={})
    plane = make_plane(config)
    plane.readiness.refresh()
    server = create_grpc_server(config, plane, HealthServicer(HEALTH_NAMES))
    server.server.start()
    request = codec.chunk_inputs_to_proto(ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            pb_grpc.PrefillMetadataStub(channel).BuildChunk(request, timeout=5)
    finally:
        server.stop(1.0)
    assert not any(thread.is_alive() for thread in server.gate._threads)


# -- on a real server -----------------------------------------------------------------------------------------------


class EchoServer:
    """A real server on a gate whose one unary method runs ``before(request)`` and answers the request's bytes, on
    a lane of ``threads`` threads and ``places`` places (``peer_share`` each), listening on 127.0.0.1 and [::1]
    (two peers)."""

    def __init__(
        self,
        gate: CallGate,
        threads: int = 2,
        places: int = 100,
        peer_share: int | None = None,
        before: Callable[[bytes], None] = lambda request: None,
    ) -> None:
        def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
            gate.started.value = True
            before(request)
            return request

        self.gate = gate
        self.lane = gate.lane("echo", threads, places, peer_share)
        gate.route(echo, METHOD, self.lane, unary_request=True, count_never_started=True)
        self.server = grpc.server(gate)
        self.server.add_registered_method_handlers(SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(echo)})
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.port6 = self.server.add_insecure_port("[::1]:0")
        self.server.start()
        self.channels: list[grpc.Channel] = []

    def channel(self, ipv6: bool = False) -> grpc.Channel:
        address = f"[::1]:{self.port6}" if ipv6 else f"127.0.0.1:{self.port}"
        self.channels.append(grpc.insecure_channel(address))
        return self.channels[-1]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.server.stop(None).wait(5)


@pytest.fixture
def echo_server(make_gate) -> Iterator[Callable[..., EchoServer]]:
    servers = []

    def start(request_seconds: float = 30.0, **kwargs: object) -> EchoServer:
        servers.append(EchoServer(make_gate(request_seconds), **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def echo(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(PATH, _registered_method=True)


def silent(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    return channel.stream_unary(PATH, _registered_method=True)


def test_a_call_is_queued_once_its_request_is_in_and_each_call_answers_its_own(echo_server, monkeypatch) -> None:
    ahead, receive_ahead = [], grpcio.receive_ahead

    def spied(args: tuple, queue: Callable[[tuple], None], on_error: object) -> bool:
        def queued(received: tuple) -> None:
            assert received[2].request is not None  # the call's state: its request is in before it is queued
            ahead.append(threading.current_thread().name)
            queue(received)

        return receive_ahead(args, queued, on_error)

    monkeypatch.setattr(grpcio, "receive_ahead", spied)
    server = echo_server()
    futures = [echo(server.channel()).future(b"request %d" % n, timeout=10) for n in range(40)]
    assert [future.result() for future in futures] == [b"request %d" % n for n in range(40)]
    # Queued by gRPC's polling thread: never one of the lane's own threads.
    assert len(ahead) == 40 and not any(name.startswith("echo_") for name in ahead)


def test_calls_that_never_send_their_request_hold_no_thread_nor_place_and_are_ended_in_time(echo_server, sheds) -> None:
    # Four silent calls on a lane of one thread and two places: a behaving caller is still answered at once; the
    # silent ones are ended DEADLINE_EXCEEDED once request_seconds have passed, each counted.
    server = echo_server(request_seconds=1.0, threads=1, places=2)
    leave = threading.Event()
    try:
        calls = [silent(server.channel()).future(sends_nothing(leave), timeout=30) for _ in range(4)]
        wait_for(lambda: len(server.lane.waiting) == 4, 5, "the four silent calls to reach the gate")
        assert server.gate.held(server.lane) == 0
        assert echo(server.channel())(b"behaving", timeout=5) == b"behaving"
        started = time.monotonic()
        for call in calls:
            error = call.exception(10)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no request message" in error.details()
        assert time.monotonic() - started < 3.0
    finally:
        leave.set()
    assert sheds.reasons().count(ShedReason.REQUEST_TIMEOUT) == 4 and not server.lane.waiting


@pytest.mark.parametrize("pool", ["gate", "grpcio"])
def test_a_caller_that_closes_without_a_request_gets_what_grpcio_answers(echo_server, pool) -> None:
    if pool == "gate":
        channel = echo_server().channel()
    else:
        executor = ThreadPoolExecutor(max_workers=2)
        server = grpc.server(executor)
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        server.add_registered_method_handlers(SERVICE, {METHOD: handler})
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.RpcError) as failed:
            silent(channel)(iter(()), timeout=10)
        assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "requires exactly one request message" in failed.value.details()
    finally:
        if pool == "grpcio":
            channel.close()
            server.stop(None).wait(5)
            executor.shutdown()


def test_a_call_cancelled_while_it_waits_for_a_thread_never_runs_its_behaviour(echo_server) -> None:
    release, ran = threading.Event(), []

    def hold_the_only_thread(request: bytes) -> None:
        ran.append(request)
        if request == b"first":
            release.wait(10)

    server = echo_server(threads=1, before=hold_the_only_thread)
    channel = server.channel()
    first = echo(channel).future(b"first", timeout=30)
    wait_for(lambda: ran, 5, "the first call to hold the lane's only thread")
    second = echo(channel).future(b"second", timeout=30)
    wait_for(lambda: server.gate.held(server.lane) == 2, 5, "the second call's request to be in and queued")
    second.cancel()
    time.sleep(0.2)  # the server sees the cancel
    release.set()
    assert first.result() == b"first"
    wait_for(lambda: server.gate.held(server.lane) == 0, 5, "the cancelled call to leave its place")
    assert ran == [b"first"] and second.cancelled()


def test_calls_that_never_started_say_whose_doing_with_their_peer_and_every_call_is_timed_from_arrival(
    echo_server,
) -> None:
    """Issue 37: on a real server whose one thread is held, a queued call its caller cancels is the caller's
    (caller_cancelled) and one whose deadline passes while it waits in the server is overload (queue_deadline),
    each reported with its peer; every call's wait for a thread and its time from arrival to its end are timed
    (indexer_call_wait_seconds and indexer_call_seconds)."""
    release, ran = threading.Event(), []
    server = echo_server(threads=1, peer_share=10, before=lambda request: ran.append(request) or release.wait(10))
    never_started, timed = [], []
    server.gate.on_never_started = lambda method, reason, peer: never_started.append((method, reason, peer))
    server.gate.timed = lambda method, wait, total: timed.append((method, wait, total))
    channel = server.channel()
    first = echo(channel).future(b"first", timeout=30)
    wait_for(lambda: ran, 5, "the first call to hold the lane's only thread")
    cancelled = echo(channel).future(b"cancelled", timeout=30)
    expiring = echo(channel).future(b"expiring", timeout=0.5)
    wait_for(lambda: server.gate.held(server.lane) == 3, 5, "both calls' requests in and queued")
    cancelled.cancel()
    with pytest.raises(grpc.RpcError) as expired:
        expiring.result()
    assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.6)  # the first call holds the thread well past the expiry
    release.set()
    assert first.result() == b"first"
    # the thread times a call before it reports it as never started: wait for both
    wait_for(lambda: len(timed) == 3 and len(never_started) == 2, 5, "the three calls timed, two reported")
    assert ran == [b"first"]
    assert sorted(reason for _, reason, _ in never_started) == [ShedReason.CALLER_CANCELLED, ShedReason.QUEUE_DEADLINE]
    # gRPC forgets an expired call's peer; the gate still knows the address its per-peer share counted
    addresses = {peer.removeprefix("ipv4:").rsplit(":", 1)[0] for _, _, peer in never_started}
    assert addresses == {"127.0.0.1"}, never_started
    assert all(method == METHOD for method, _, _ in never_started)
    (first_timing, *queued) = timed
    assert first_timing[1] < 0.5 and first_timing[2] >= 1.0  # took the idle thread at once, then was held
    # Both were queued before the expiry, which the held thread outlasted by 0.6 s: each waited that at least, and
    # ended as the thread took it up
    for method, wait, total in queued:
        assert method == METHOD and wait >= 0.6 and wait <= total < wait + 0.5, timed


def test_one_peer_past_its_share_of_places_is_refused_and_another_peer_is_served(echo_server, sheds) -> None:
    release = threading.Event()
    server = echo_server(threads=4, places=10, peer_share=2, before=lambda request: release.wait(10))
    ipv4 = server.channel()
    try:
        held = [echo(ipv4).future(b"held", timeout=30) for _ in range(2)]
        wait_for(lambda: server.gate.held(server.lane) == 2, 5, "the peer's two calls to hold their places")
        with pytest.raises(grpc.RpcError) as refused:
            echo(ipv4)(b"third", timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        other = echo(server.channel(ipv6=True)).future(b"other peer", timeout=10)
        wait_for(lambda: server.gate.held(server.lane) == 3, 5, "the other peer's call to take a place")
    finally:
        release.set()
    assert other.result() == b"other peer" and [call.result() for call in held] == [b"held", b"held"]
    assert ShedReason.PEER_SHARE in sheds.reasons()


def test_one_peer_past_its_share_of_waiting_calls_is_refused_at_once(echo_server, sheds) -> None:
    server = echo_server(places=10, peer_share=2)
    leave = threading.Event()
    try:
        waiting = [silent(server.channel()).future(sends_nothing(leave), timeout=30) for _ in range(2)]
        wait_for(lambda: len(server.lane.waiting) == 2, 5, "the peer's two silent calls")
        third = silent(server.channel()).future(sends_nothing(leave), timeout=30)
        assert third.exception(5).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert echo(server.channel(ipv6=True))(b"other peer", timeout=5) == b"other peer"
    finally:
        leave.set()
    for call in waiting:
        assert call.exception(10).code() == grpc.StatusCode.UNIMPLEMENTED
    assert sheds.reasons() == [ShedReason.PEER_SHARE]


class FailingOnce:
    """A lane's queue whose first put raises (our code on gRPC's polling thread failing), then puts as the queue."""

    def __init__(self, queue: object) -> None:
        self.queue, self.failed = queue, 0

    def put(self, item: object) -> None:
        if not self.failed:
            self.failed += 1
            raise RuntimeError("injected")
        self.queue.put(item)


def test_an_exception_of_ours_on_the_polling_thread_is_counted_and_the_port_serves_on(echo_server, caplog) -> None:
    server = echo_server()
    server.lane.queue = FailingOnce(server.lane.queue)  # the threads keep taking from the queue they started on
    channel = server.channel()
    with caplog.at_level(logging.ERROR), pytest.raises(grpc.RpcError):  # nobody took it: it ends at its deadline
        echo(channel)(b"lost", timeout=1)
    assert echo(channel)(b"next", timeout=5) == b"next"
    metrics = server.gate.accounting.metrics
    assert metrics.registry.get_sample_value("indexer_library_callback_errors_total", {"where": "receive_ahead"}) == 1
    wait_for(lambda: server.gate.held(server.lane) == 0, 5, "every place back, the lost call's too")
    assert any("library_callback_error where=receive_ahead" in r.getMessage() for r in caplog.records)


def test_stop_ends_calls_waiting_for_their_request_without_waiting_out_the_grace(echo_server, sheds) -> None:
    server = echo_server()
    leave = threading.Event()
    try:
        calls = [silent(server.channel()).future(sends_nothing(leave), timeout=30) for _ in range(3)]
        wait_for(lambda: len(server.lane.waiting) == 3, 5, "the silent calls")
        started = time.monotonic()
        assert server.gate.end_waiting() == 3
        server.server.stop(10).wait(15)
        assert time.monotonic() - started < 2.0
        for call in calls:
            assert call.exception(5).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        leave.set()
    assert sheds.reasons() == [ShedReason.SHUTDOWN] * 3
