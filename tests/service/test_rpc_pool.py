"""The RPC server's own thread pool (service/transport/grpc_server.py, RpcThreadPool): what grpcio needs of a pool
(submit, one completion callback per call, each run exactly once), the calls it counts for ``max_concurrent_rpcs``,
the calls that end before their handler starts, an exception that escapes a call, and its shutdown with the
server."""

from __future__ import annotations

import logging
import threading

import grpc
import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import codec
from indexer_service.service.config import load_config
from indexer_service.service.transport.grpc_server import (
    HEALTH_NAMES,
    CallDone,
    RpcThreadPool,
    create_grpc_server,
)
from indexer_service.service.transport.health import HealthServicer
from testkit.harness import wait_for
from testkit.planes import make_plane


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
