"""Admission in process: the response budget and its per-connection share, the heavy lane, the shed log, the
drain watchdog, the plan-size limit and the order in which a request is judged (malformed, limits, policy)."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import weakref

import grpc
import numpy as np
import pytest

from indexer_service.kernels import planner
from indexer_service.kernels.planner import PlanTooLargeError, plan_prefill_chunks
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import codec, dataplane
from indexer_service.service.dataplane import DataPlane
from indexer_service.service.errors import ServiceError
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.overload import admission as admission_module
from indexer_service.service.overload import books
from indexer_service.service.overload.admission import (
    DEFAULT_BUDGET_BYTES,
    Admission,
    Caller,
    DrainWatchdog,
    Refused,
    ShedLog,
    default_response_budget,
)
from indexer_service.service.reasons import OVERLOAD_REASONS, Port, ShedReason
from indexer_service.service.transport.grpc_calls import GRPC_STATUS
from testkit.harness import poll, wait_for
from testkit.payloads import AMPLIFIER_PLAN_BATCH, one_row_chunks_plan_batch
from testkit.planes import make_plane


def admission(budget: int = 100, slots: int = 1, wait: float = 0.2, max_waiting: int = 4) -> Admission:
    return Admission(
        budget,
        heavy_request_bytes=10,
        heavy_lane_slots=slots,
        wait_seconds=wait,
        max_waiting=max_waiting,
        metrics=Metrics(),
    )


@pytest.fixture(params=["compiled", "python"])
def books_twin(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The budget's books as built (service/overload/budget.c), or their Python twin, which serves where the module
    was not built: the budget's tests run on both."""
    if request.param == "python":
        monkeypatch.setitem(sys.modules, books.COMPILED_MODULE, None)
    elif books.load_compiled() is None:
        pytest.skip("service/overload/_budget is not built")
    return request.param


def test_default_budget_is_an_eighth_of_the_memory_limit_at_most_256_mib() -> None:
    assert default_response_budget(None) == DEFAULT_BUDGET_BYTES
    assert default_response_budget(1 << 30) == (1 << 30) // 8
    assert default_response_budget(64 << 30) == DEFAULT_BUDGET_BYTES


@pytest.mark.usefixtures("books_twin")
def test_budget_grants_until_full_then_refuses_after_the_wait() -> None:
    budget = admission(budget=100).budget
    held = [budget.reserve(f"peer{i}", 40, Caller()) for i in range(2)]
    start = time.monotonic()
    with pytest.raises(Refused) as refused:
        budget.reserve("peer9", 40, Caller())
    assert refused.value.reason == "memory" and time.monotonic() - start >= 0.19
    assert "response_budget_bytes 100" in refused.value.message
    held[0].release()
    held[0].release()  # twice is once
    assert budget.held == 40
    budget.reserve("peer9", 40, Caller()).release()


@pytest.mark.usefixtures("books_twin")
def test_waiters_get_in_when_memory_comes_back_woken_by_the_release(monkeypatch) -> None:
    """Waiters are woken by the release (the books' notify), not found by their next look: with each look 30 s
    apart, three waiters for what one release frees get in within the 10 s the test allows."""
    monkeypatch.setattr(admission_module, "_WAIT_SLICE_SECONDS", 30.0)
    budget = admission(budget=100, wait=60.0).budget
    first = budget.reserve("a", 100, Caller())
    granted: list = []
    waiters = [
        threading.Thread(target=lambda peer=peer: granted.append(budget.reserve(peer, 30, Caller())), daemon=True)
        for peer in ("b", "c", "d")
    ]
    for waiter in waiters:
        waiter.start()
    assert poll(lambda: budget.books.waiters == 3, timeout=10)
    first.release()
    for waiter in waiters:
        waiter.join(10)
    assert [t.nbytes for t in granted] == [30, 30, 30] and budget.held == 90 and budget.books.waiters == 0


@pytest.mark.usefixtures("books_twin")
def test_one_connection_holds_at_most_a_quarter_once_it_holds_anything() -> None:
    budget = admission(budget=100, wait=0.05).budget
    big = budget.reserve("reader", 90, Caller())  # a connection holding nothing may take up to the budget
    with pytest.raises(Refused, match="this connection already holds 90 bytes") as refused:
        budget.reserve("reader", 5, Caller())
    assert refused.value.reason == ShedReason.CONNECTION_SHARE  # its own unread answers: its caller's doing
    big.release()
    small = budget.reserve("reader", 20, Caller())
    with pytest.raises(Refused, match="share 25"):
        budget.reserve("reader", 10, Caller())
    assert budget.reserve("other", 10, Caller()).nbytes == 10
    small.budget.give_back(small, 5)
    assert budget.held == 15
    small.budget.give_back(small, 10)  # never back up
    assert small.nbytes == 5 and budget.held == 15
    small.release()
    small.budget.give_back(small, 1)  # nor anything after its release
    assert budget.held == 10


@pytest.mark.usefixtures("books_twin")
def test_an_answer_larger_than_the_budget_is_refused_at_once_as_a_work_limit() -> None:
    with pytest.raises(Refused, match="above response_budget_bytes 100") as refused:
        admission(budget=100, wait=5.0).budget.reserve("a", 101, Caller())
    assert refused.value.reason == ShedReason.WORK_LIMIT


def past_its_deadline(peer: str) -> Caller:
    """A caller whose deadline has passed, as a transport that can tell sets it."""
    caller = Caller(peer)
    caller.deadline = 0.0
    return caller


def cancelled(peer: str) -> Caller:
    """A caller that cancelled its call, as a transport that learns of it marks it."""
    caller = Caller(peer)
    caller.ended = True
    return caller


@pytest.mark.usefixtures("books_twin")
def test_a_caller_that_leaves_while_waiting_is_shed_as_queue_deadline() -> None:
    budget = admission(budget=10, wait=5.0).budget
    budget.reserve("a", 10, Caller())
    gone = past_its_deadline("b")
    with pytest.raises(Refused) as refused:
        budget.reserve("b", 10, gone)
    assert refused.value.reason == "queue_deadline" and refused.value.gone
    assert "DEADLINE_EXCEEDED" in refused.value.message


@pytest.mark.usefixtures("books_twin")
def test_a_caller_that_waits_on_its_own_connections_share_is_shed_as_its_own_doing() -> None:
    """The server's budget has room; the caller's connection holds its share in answers it has not read: whether
    the wait runs out or the caller's deadline passes meanwhile, it is connection_share (a caller's reason), not
    memory or queue_deadline (overload, which pages)."""
    budget = admission(budget=100, wait=0.05).budget
    budget.reserve("reader", 20, Caller())
    with pytest.raises(Refused) as refused:
        budget.reserve("reader", 10, Caller())
    assert refused.value.reason == ShedReason.CONNECTION_SHARE and not refused.value.gone
    with pytest.raises(Refused) as refused:
        budget.reserve("reader", 10, past_its_deadline("reader"))
    assert refused.value.reason == ShedReason.CONNECTION_SHARE and refused.value.gone
    assert ShedReason.CONNECTION_SHARE not in OVERLOAD_REASONS


@pytest.mark.usefixtures("books_twin")
def test_a_caller_that_cancels_while_waiting_is_shed_as_its_own_doing() -> None:
    # Issue 37: a cancel is the caller's (caller_cancelled, info at most), never overload like an expiry in the queue
    budget = admission(budget=10, wait=5.0).budget
    budget.reserve("a", 10, Caller())
    with pytest.raises(Refused) as refused:
        budget.reserve("b", 10, cancelled("b"))
    assert refused.value.reason == ShedReason.CALLER_CANCELLED and refused.value.gone
    assert "CANCELLED" in refused.value.message
    gate = admission(slots=1, wait=5.0)
    with gate.lane.slot(Caller()), pytest.raises(Refused) as refused, gate.lane.slot(cancelled("c")):
        pass
    assert refused.value.reason == ShedReason.CALLER_CANCELLED


def test_heavy_lane_runs_slots_at_a_time_and_bounds_its_waiters() -> None:
    gate = admission(slots=1, wait=1.0, max_waiting=1)
    with gate.lane.slot(Caller()):
        results: list[str] = []

        def wait_for_slot() -> None:
            try:
                with gate.lane.slot(Caller()):
                    results.append("ran")
            except Refused as exc:
                results.append(exc.reason)

        waiting = threading.Thread(target=wait_for_slot)
        waiting.start()
        wait_for(lambda: gate.lane._waiting.count == 1, 5, "the first caller in the waiting room")
        with pytest.raises(Refused, match="already wait for admission"), gate.lane.slot(Caller()):
            pass  # the waiting room (1) is full
        waiting.join()
    assert results == ["heavy_lane"]
    with gate.lane.slot(Caller()):
        pass


def test_shed_log_counts_every_call_and_logs_once_per_interval(caplog) -> None:
    metrics = Metrics()
    shed = ShedLog(metrics, interval=60.0)
    with caplog.at_level(logging.WARNING, logger="indexer_service.service.overload.admission"):
        for _ in range(5):
            shed.record("BuildChunk", "memory", "full")
    lines = [r.getMessage() for r in caplog.records if "shed reason=memory" in r.getMessage()]
    assert len(lines) == 1 and "count=1" in lines[0]
    assert metrics.requests_shed_total.labels("BuildChunk", "memory")._value.get() == 5


def test_shed_log_writes_one_line_per_reason_and_port_per_interval(caplog) -> None:
    # The same reason flooding two ports: a line for each port, so the flood on one does not hide the other's
    # refusals; the next interval's line per port counts what came meanwhile.
    shed = ShedLog(Metrics(), interval=60.0)
    on_grpc, on_health = shed.on(Port.GRPC), shed.on(Port.HEALTH)
    with caplog.at_level(logging.WARNING, logger="indexer_service.service.overload.admission"):
        for n in range(50):
            on_grpc("Check", ShedReason.UNDECODABLE, f"grpc {n}")
            on_health("Check", ShedReason.UNDECODABLE, f"health {n}")
        first = [r.getMessage() for r in caplog.records]
        assert shed.log.flush(time.monotonic() + 60.0) == 2  # the interval has passed: one held line per port
    assert first == [
        "shed reason=undecodable count=1 method=Check port=grpc last='grpc 0'",
        "shed reason=undecodable count=1 method=Check port=health last='health 0'",
    ]
    assert sorted(r.getMessage() for r in caplog.records[2:]) == [
        "shed reason=undecodable count=49 method=Check port=grpc last='grpc 49'",
        "shed reason=undecodable count=49 method=Check port=health last='health 49'",
    ]
    assert not [r for r in caplog.records if r.exc_info]


def test_drain_watchdog_acts_on_unreleased_tickets_only() -> None:
    budget = admission(budget=100).budget
    watchdog = DrainWatchdog(0.1)
    unread, read = budget.reserve("a", 10, Caller()), budget.reserve("b", 10, Caller())
    fired: list[str] = []
    watchdog.watch(unread, lambda: fired.append("unread"))
    watchdog.watch(read, lambda: fired.append("read"))
    read.release()
    wait_for(lambda: fired, 5, "the watchdog to act")
    time.sleep(0.3)  # three more scans: the released ticket must not fire in any of them
    watchdog.stop()
    assert fired == ["unread"]


def test_drain_watchdog_keeps_nothing_it_acted_on() -> None:
    """What the watchdog cancelled must go once it has acted: a gRPC call kept by its thread held the call's
    unsent answer in gRPC core (64 MiB resident after a stalled-streams attack, for good)."""

    class Cancel:  # stands for the gRPC call that on_unread cancels
        def __init__(self) -> None:
            self.done = threading.Event()

        def __call__(self) -> None:
            self.done.set()

    budget = admission(budget=100).budget
    watchdog = DrainWatchdog(0.05)
    try:
        cancel, ticket = Cancel(), budget.reserve("a", 10, Caller())
        watchdog.watch(ticket, cancel)
        assert cancel.done.wait(5.0)
        gone = weakref.ref(cancel)
        del cancel, ticket
        # The watchdog's thread lets go once its scan returns.
        poll(lambda: gc.collect() >= 0 and gone() is None, 5.0, watchdog.scan_seconds)
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    finally:
        watchdog.stop()


@pytest.mark.parametrize("watch", ["watch", "watch_ticket"])
@pytest.mark.parametrize("release", ["ticket", "budget", "before-watch"])
@pytest.mark.usefixtures("books_twin")
def test_a_released_ticket_lets_go_of_what_it_watched_at_once(release: str, watch: str) -> None:
    """Released, a ticket drops its watchdog entry at once, not at the next scan: the entry holds the gRPC call (its
    HTTP/2 stream counts against the connection's limit while referenced). Released as GrpcCaller.end does (its
    books' give_back), as the other transports do (Ticket.release), or before the watch was made."""

    class Cancel:  # stands for the gRPC call's cancel_unread
        def __call__(self) -> None:
            raise AssertionError("a released ticket's call was cancelled")

    budget = admission(budget=100).budget
    watchdog = DrainWatchdog(3600.0)  # no scan acts meanwhile
    try:
        cancel, ticket = Cancel(), budget.reserve("a", 10, Caller())
        if release == "before-watch":
            ticket.release()
        getattr(watchdog, watch)(ticket, cancel)  # the general watch, or the budget ticket's own
        if release == "ticket":
            ticket.release()
        elif release == "budget":
            ticket.budget.give_back(ticket, None)  # as GrpcCaller.end does
        gone = weakref.ref(cancel)
        del cancel
        assert gone() is None and budget.held == 0
    finally:
        watchdog.stop()


def test_plan_size_is_refused_before_the_plan_is_made() -> None:
    # One request of 8,192 queries over 2^20 compressed tokens with a one-element logits budget: 8,192 chunks.
    with pytest.raises(PlanTooLargeError):
        plan_prefill_chunks([2**20], [8192], workspace_size=2**26, max_logits_elems=1, max_chunks=1024)
    assert len(plan_prefill_chunks([2**20], [8192], 2**26, 1, max_chunks=8192)) == 8192


def call_code(plane: DataPlane, method: str, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(ServiceError) as failed:
        plane.call(method, request.SerializeToString())
    return GRPC_STATUS[failed.value.code], failed.value.message


def test_cpu_amplifying_plan_is_refused_as_work_limit_and_counted(plane: DataPlane) -> None:
    start = time.perf_counter()
    code, message = call_code(plane, "PlanBatch", AMPLIFIER_PLAN_BATCH)
    assert time.perf_counter() - start < 1.0  # it was 1.2 s of CPU before the limit
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and message.startswith("max_logits_bytes:")
    assert plane.metrics.requests_shed_total.labels("PlanBatch", "work_limit")._value.get() == 1


def test_a_plan_of_many_chunks_takes_the_heavy_lane_before_its_per_chunk_work(monkeypatch) -> None:
    """A small request can plan into many chunks; the chunk count is its first known cost, so it queues for
    the heavy lane (and is shed there) before any per-chunk host work, which is most of such a call."""
    plane = make_plane(max_plan_chunks=8192, heavy_lane_slots=1, admission_wait_seconds=0.05)
    plane.readiness.refresh()
    per_chunk_work, chunks_made = [], []
    monkeypatch.setattr(dataplane, "chunk_host_parts", lambda *a: per_chunk_work.append(a) or [])
    # Not even the chunks: thousands of small objects made and dropped per refused call fragment pymalloc's
    # arenas (RSS 1.86x idle 60 s after 10 such callers, with max_plan_chunks 8192).
    monkeypatch.setattr(planner, "ChunkSpec", lambda *a: chunks_made.append(a))
    with plane.admission.lane.slot(Caller()):
        code, message = call_code(plane, "PlanBatch", one_row_chunks_plan_batch(4096))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "heavy" in message
    assert per_chunk_work == [] and chunks_made == []
    assert plane.metrics.requests_shed_total.labels("PlanBatch", "heavy_lane")._value.get() == 1


def test_malformed_input_is_named_before_limits_and_policy(plane: DataPlane) -> None:
    garbage = pb.BuildChunkRequest(
        query_start_loc=codec.encode_int32([0, 2**30, 5]), seq_lens=codec.encode_int32([2**30, 5]), req_end=2
    )
    assert call_code(plane, "BuildChunk", garbage)[0] is grpc.StatusCode.INVALID_ARGUMENT
    dcp = pb.BuildChunkRequest(
        query_start_loc=codec.encode_int32([0, 1]),
        seq_lens=codec.encode_int32([4]),
        compress_ratio=4,
        req_end=1,
        dcp_world_size=65537,
    )
    code, message = call_code(plane, "BuildChunk", dcp)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.startswith("dcp_world_size")


def test_a_served_answer_holds_its_bytes_until_released(plane: DataPlane) -> None:
    request = pb.BuildChunkRequest(
        query_start_loc=codec.encode_int32([0, 3]), seq_lens=codec.encode_int32([4096]), compress_ratio=1, req_end=1
    )
    caller = Caller("peer")
    answer = plane.call("BuildChunk", request.SerializeToString(), caller=caller)
    assert caller.ticket is not None and caller.ticket.nbytes == len(answer)
    assert plane.admission.budget.held == len(answer)
    caller.ticket.release()
    assert plane.admission.budget.held == 0
    plane.call("BuildChunk", request.SerializeToString())  # without a caller nothing stays held
    assert plane.admission.budget.held == 0
    assert np.isfinite(plane.last_call_end)
