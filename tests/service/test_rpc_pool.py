"""The RPC server's own thread pool (service/transport/grpc_server.py, RpcThreadPool): what grpcio needs of a pool
(submit, one completion callback per call, each run exactly once), the calls it counts for ``max_concurrent_rpcs``,
the calls that end before their handler starts, an exception that escapes a call, its shutdown with the server, and
the request it receives ahead for a unary call (``receive_ahead``), held to grpcio's own answers on a real server."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc import _server as grpc_server_internals
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import codec
from indexer_service.service.config import load_config
from indexer_service.service.transport import grpc_server
from indexer_service.service.transport.grpc_server import (
    HEALTH_NAMES,
    Behavior,
    CallDone,
    RpcThreadPool,
    create_grpc_server,
    create_health_server,
)
from indexer_service.service.transport.health import HealthServicer
from testkit.harness import wait_for
from testkit.planes import make_plane
from testkit.streams import sends_nothing


@pytest.fixture
def pool() -> RpcThreadPool:
    pool = RpcThreadPool(2, 100)
    yield pool
    assert pool.shutdown(5.0) == 0


def test_a_call_runs_on_a_pool_thread_and_counts_until_it_ends(pool: RpcThreadPool) -> None:
    release, ran_on, ended = threading.Event(), [], []

    def call() -> None:
        ran_on.append(threading.current_thread().name)
        release.wait(10)

    done = pool.submit(call)
    done.add_done_callback(ended.append)
    wait_for(lambda: ran_on, 5, "the call to start")
    assert len(pool.live) == 1 and not ended
    release.set()
    wait_for(lambda: ended, 5, "the call's completion callback")
    assert ended == [done] and done.done and len(pool.live) == 0
    assert ran_on[0].startswith("grpc_")


def test_each_completion_callback_runs_exactly_once_however_it_races_the_end(pool: RpcThreadPool) -> None:
    # Added right after submit, a callback races the call's end on the pool thread (either side may run it).
    runs: dict[int, int] = {}

    def count(index: int) -> None:
        runs[index] = runs.get(index, 0) + 1

    for index in range(2000):
        pool.submit(lambda: None).add_done_callback(lambda done, index=index: count(index))
    wait_for(lambda: len(runs) == 2000 and len(pool.live) == 0, 10, "every call's callback")
    assert set(runs.values()) == {1}
    # Added once the call has ended, it runs at once, on the adding thread.
    done = pool.submit(lambda: None)
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


def test_an_exception_escaping_a_call_is_logged_and_its_thread_serves_on(caplog) -> None:
    pool = RpcThreadPool(1, 100)
    try:
        ended = []

        def explode() -> None:
            raise RuntimeError("past grpcio's handling")

        with caplog.at_level(logging.ERROR):
            pool.submit(explode).add_done_callback(ended.append)
            wait_for(lambda: ended, 5, "the failed call to end")
        logged = [r for r in caplog.records if "raised past gRPC's own handling" in r.getMessage()]
        assert logged and "past grpcio's handling" in str(logged[0].exc_info[1])
        pool.submit(lambda: None).add_done_callback(ended.append)  # the one thread is still there
        wait_for(lambda: len(ended) == 2, 5, "the next call on the same thread")
        assert len(pool.live) == 0
    finally:
        assert pool.shutdown(5.0) == 0


def test_a_call_whose_behaviour_never_started_is_reported_with_its_method(pool: RpcThreadPool) -> None:
    # grpcio submits a call with its handler's behaviour among the arguments; the behaviour flags its start.
    never_started, ended = [], []
    pool.on_never_started = never_started.append

    def behavior() -> None:
        pool.started.value = True

    pool.watch(behavior, "BuildChunk", lambda: None)

    def cancelled_first(behaviour, request) -> None:  # gRPC's wrapper, when the caller went away meanwhile
        pass

    def served(behaviour, request) -> None:
        behaviour()

    for fn, args in ((cancelled_first, (behavior, b"")), (served, (behavior, b"")), (cancelled_first, (len, b""))):
        pool.submit(fn, *args).add_done_callback(ended.append)
    wait_for(lambda: len(ended) == 3, 5, "the three calls to end")
    assert never_started == ["BuildChunk"]  # not the served one, nor a call of a behaviour nobody watches


def test_past_max_calls_a_call_runs_its_refusing_twin_on_the_refusal_pool() -> None:
    pool = RpcThreadPool(1, max_calls=1)
    try:
        release, ran = threading.Event(), []

        def behavior() -> None:
            pool.started.value = True
            ran.append(("served", threading.current_thread().name))
            release.wait(10)

        def refusing() -> None:
            ran.append(("refused", threading.current_thread().name))

        pool.watch(behavior, "BuildChunk", refusing)

        def grpc_wrapper(event: str, behaviour) -> None:  # gRPC's, with the behaviour among its arguments
            behaviour()

        ended = []
        pool.submit(grpc_wrapper, "first", behavior).add_done_callback(ended.append)
        wait_for(lambda: ran, 5, "the first call to start")
        # Full: a watched behaviour is swapped for its refusing twin, run apart (never queued behind the first).
        pool.submit(grpc_wrapper, "second", behavior).add_done_callback(ended.append)
        # A behaviour nobody watches (health has a pool of its own) is never refused here.
        pool.submit(lambda: ran.append(("unwatched", threading.current_thread().name))).add_done_callback(ended.append)
        wait_for(lambda: len(ended) == 1, 5, "the refusal, while the first call still runs")
        assert ran[1][0] == "refused" and ran[1][1].startswith("grpc-refuse")
        assert len(pool.live) == 2  # the first and the unwatched one, queued behind it; not the refused call
        release.set()
        wait_for(lambda: len(ended) == 3, 5, "the first call and the unwatched one")
        assert [what for what, _ in ran] == ["served", "refused", "unwatched"]
    finally:
        release.set()
        assert pool.shutdown(5.0) == 0


def test_shutdown_waits_for_running_calls_and_reports_the_stuck() -> None:
    stuck, started = threading.Event(), threading.Event()

    def hang() -> None:
        started.set()
        stuck.wait(30)

    hung = RpcThreadPool(2, 100)
    hung.submit(hang)
    started.wait(5)
    assert hung.shutdown(0.2) == 1  # one thread still in its call; the idle one has stopped
    stuck.set()
    assert hung.shutdown(5.0) == 0
    assert not any(thread.is_alive() for thread in hung._threads)


def test_stopping_the_server_ends_its_rpc_threads() -> None:
    config = load_config({"grpc_host": "127.0.0.1", "grpc_port": "0", "warmup_target": "none"}, env={})
    plane = make_plane(config)
    plane.readiness.refresh()
    server = create_grpc_server(config, plane, HealthServicer(HEALTH_NAMES, plane.shed))
    server.server.start()
    request = codec.chunk_inputs_to_proto(ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            pb_grpc.PrefillMetadataStub(channel).BuildChunk(request, timeout=5)
    finally:
        server.stop(1.0)
    threads = server.pool._threads
    assert len(threads) == config.grpc_workers and not any(thread.is_alive() for thread in threads)


SERVICE, METHOD = "test.Pool", "Echo"
RECEIVE_MESSAGE_TOKEN = grpc_server_internals._RECEIVE_MESSAGE_TOKEN


@pytest.fixture
def echo_server() -> Iterator[Callable[..., grpc.Channel]]:
    """A real server on ``executor`` (an RpcThreadPool, or grpcio's own pool to compare with) whose one unary
    method runs ``before(request)`` and answers the request's bytes, or ``refusing`` past the pool's max_calls."""
    servers, channels = [], []

    def start(
        executor: object, before: Callable[[bytes], None] = lambda request: None, refusing: Behavior | None = None
    ) -> grpc.Channel:
        def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
            before(request)
            return request

        if refusing is not None:  # what the RpcThreadPool runs instead past its max_calls
            executor.watch(echo, METHOD, refusing)

        server = grpc.server(executor)
        server.add_registered_method_handlers(SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(echo)})
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, executor))
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return channels[-1]

    yield start
    for channel in channels:
        channel.close()
    for server, executor in servers:
        server.stop(None).wait(5)
        if isinstance(executor, RpcThreadPool):
            assert executor.shutdown(5.0) == 0
        else:
            executor.shutdown(wait=True)


def test_a_unary_call_is_queued_once_its_request_is_in_and_each_call_answers_its_own(echo_server, monkeypatch) -> None:
    ahead, receive_ahead = [], grpc_server.receive_ahead

    def spied(args: tuple, queue: Callable[[tuple], None]) -> bool:
        def queued(received: tuple) -> None:
            assert received[2].request is not None  # the call's state: its request is in before it is queued
            ahead.append((threading.current_thread().name, received[4] is not args[4]))
            queue(received)

        return receive_ahead(args, queued)

    monkeypatch.setattr(grpc_server, "receive_ahead", spied)
    channel = echo_server(RpcThreadPool(2, 100))
    echo = channel.unary_unary(f"/{SERVICE}/{METHOD}", _registered_method=True)
    futures = [echo.future(b"request %d" % n, timeout=10) for n in range(40)]
    assert [future.result() for future in futures] == [b"request %d" % n for n in range(40)]
    assert len(ahead) == 40
    # Queued with grpcio's thunk swapped, by gRPC's polling thread: never one of the pool's own threads.
    assert all(swapped and not thread.startswith("grpc_") for thread, swapped in ahead)


def test_other_arguments_than_a_unary_calls_are_left_to_the_pool() -> None:
    def wrapper() -> None:
        pass

    queued = []
    for args in ((), (wrapper, 1, 2, 3, 4, 5, 6), (wrapper,)):
        assert grpc_server.receive_ahead(args, queued.append) is False
    assert queued == []


def test_calls_that_never_send_their_request_hold_no_thread(echo_server) -> None:
    # A caller that opens unary calls and never sends the message: four of them on a pool of two threads, and a
    # behaving caller is still answered at once; the stalled calls count under max_calls until they leave.
    pool = RpcThreadPool(2, 100)
    channel = echo_server(pool)
    leave = threading.Event()

    stalled = channel.stream_unary(f"/{SERVICE}/{METHOD}", _registered_method=True)
    calls = [stalled.future(sends_nothing(leave), timeout=30) for _ in range(4)]
    wait_for(lambda: len(pool.live) == 4, 5, "the four stalled calls to reach the pool")
    echo = channel.unary_unary(f"/{SERVICE}/{METHOD}", _registered_method=True)
    assert echo(b"behaving", timeout=5) == b"behaving"
    leave.set()
    for call in calls:  # closed without a message: what grpcio answers
        assert call.exception(10).code() == grpc.StatusCode.UNIMPLEMENTED
    wait_for(lambda: not pool.live, 5, "the stalled calls to leave the pool")


@pytest.mark.parametrize("executor", [RpcThreadPool, ThreadPoolExecutor], ids=["rpc-pool", "grpcio-pool"])
def test_a_caller_that_closes_without_a_request_gets_what_grpcio_answers(echo_server, executor) -> None:
    # A client streaming no message to a unary method: grpcio's own thunk answers UNIMPLEMENTED, and so must ours.
    channel = echo_server(executor(2, 100) if executor is RpcThreadPool else executor(max_workers=2))
    none = channel.stream_unary(f"/{SERVICE}/{METHOD}", _registered_method=True)
    with pytest.raises(grpc.RpcError) as failed:
        none(iter(()), timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "requires exactly one request message" in failed.value.details()


def test_a_call_cancelled_while_it_waits_for_a_thread_never_runs_its_behaviour(echo_server, monkeypatch) -> None:
    # Its request was received ahead; the cancel still reaches the waiting thunk, which gives grpcio None.
    states, receive_ahead = [], grpc_server.receive_ahead

    def spied(args: tuple, queue: Callable[[tuple], None]) -> bool:
        states.append(args[2])  # grpcio's state of the call, to know when the server has seen the cancel
        return receive_ahead(args, queue)

    monkeypatch.setattr(grpc_server, "receive_ahead", spied)
    pool = RpcThreadPool(1, 100)
    release, ran = threading.Event(), []

    def hold_the_only_thread(request: bytes) -> None:
        ran.append(request)
        if request == b"first":
            release.wait(10)

    channel = echo_server(pool, hold_the_only_thread)
    echo = channel.unary_unary(f"/{SERVICE}/{METHOD}", _registered_method=True)
    first = echo.future(b"first", timeout=30)
    wait_for(lambda: ran, 5, "the first call to hold the pool's only thread")
    second = echo.future(b"second", timeout=30)
    wait_for(lambda: len(states) == 2, 5, "the second call to reach the pool")
    # received ahead (its receive no longer due), then cancelled while it waits for the thread
    wait_for(lambda: RECEIVE_MESSAGE_TOKEN not in states[1].due, 5, "the second call's request to be in")
    second.cancel()
    wait_for(lambda: not grpc_server_internals._is_rpc_state_active(states[1]), 5, "the server to see the cancel")
    release.set()
    assert first.result() == b"first"
    wait_for(lambda: not pool.live, 5, "the cancelled call to leave the pool")
    assert ran == [b"first"] and second.cancelled()


def test_past_max_calls_a_call_is_refused_without_waiting_for_its_request(echo_server) -> None:
    # Two places, both held by calls whose request never comes, and two more such calls refused: the refusals run
    # at once (grpcio's thunk would hold both refusal threads until the requests came), so a behaving caller past
    # the limit hears RESOURCE_EXHAUSTED, not its deadline.
    def refusing(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")

    pool = RpcThreadPool(1, max_calls=2)
    channel = echo_server(pool, refusing=refusing)
    leave = threading.Event()

    stalled = channel.stream_unary(f"/{SERVICE}/{METHOD}", _registered_method=True)
    holding = []
    try:
        holding += [stalled.future(sends_nothing(leave), timeout=30) for _ in range(2)]
        wait_for(lambda: len(pool.live) == 2, 5, "two stalled calls to hold both places")
        refused = [stalled.future(sends_nothing(leave), timeout=30) for _ in range(2)]
        for call in refused:
            assert call.exception(5).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as behaving:
            channel.unary_unary(f"/{SERVICE}/{METHOD}", _registered_method=True)(b"behaving", timeout=5)
        assert behaving.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        leave.set()
    for call in holding:
        assert call.exception(10).code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_checks_that_never_send_their_request_leave_the_probes_answered() -> None:
    # Check and List run on two threads of their own; a Check whose request never came held one until its caller
    # left, so two of them stopped the kubelet's probes on the health port (and the liveness restart followed).
    config = load_config({"grpc_host": "127.0.0.1", "health_port": "0", "warmup_target": "none"}, env={})
    servicer = HealthServicer(HEALTH_NAMES, lambda method, reason, detail: None)
    servicer.set_serving(True)
    server, port = create_health_server(config, servicer)
    server.start()
    leave = threading.Event()

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as silent, grpc.insecure_channel(f"127.0.0.1:{port}") as probe:
            stalled = silent.stream_unary("/grpc.health.v1.Health/Check")
            calls = [stalled.future(sends_nothing(leave), timeout=30) for _ in range(4)]
            # grpcio's own count of the calls the server holds: the four must be in before the probes are sent
            wait_for(lambda: len(server._state.rpc_states) >= 4, 5, "the silent Checks to reach the server")
            check = health_pb2_grpc.HealthStub(probe).Check
            for _ in range(3):
                answer = check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            leave.set()
            for call in calls:
                assert call.exception(10).code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        leave.set()
        server.stop(None).wait(5)
        servicer.close()
