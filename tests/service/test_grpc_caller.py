"""GrpcCaller (service/transport/grpc_calls.py) reads and writes grpcio's own call state rather than calling the
context's public methods: against a real server, it learns what those methods would tell (peer, deadline, whether the
call has ended), its trailers reach the caller, and its end runs once the call is over, however the call ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from indexer_service.service.errors import Code
from indexer_service.service.overload.admission import Caller
from indexer_service.service.transport.grpc_calls import GrpcCaller

SERVICE, METHOD = "test.Caller", "Make"
TRAILERS = (("x-request-id", "req-7"),)


class Seen:
    """What a behaviour saw of its call: the GrpcCaller it made and what the public methods said at that moment."""

    def __init__(self) -> None:
        self.caller: GrpcCaller | None = None
        self.open_calls: set[object] = set()  # the gate's, for the callers made here
        self.open_while_running = False
        self.peer = ""
        self.remaining = 0.0
        self.at = 0.0
        self.made = threading.Event()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[grpc.ServicerContext], None]], tuple[grpc.Channel, Seen]]]:
    """A real server whose one method runs ``before(context)``, then makes a GrpcCaller and answers b"ok"."""
    servers, channels = [], []

    def start(before: Callable[[grpc.ServicerContext], None]) -> tuple[grpc.Channel, Seen]:
        seen = Seen()

        def behavior(request: bytes, context: grpc.ServicerContext) -> bytes:
            before(context)
            seen.peer, seen.remaining, seen.at = context.peer(), context.time_remaining(), time.time()
            seen.caller = GrpcCaller(context, None, METHOD, TRAILERS, seen.open_calls)
            seen.open_while_running = seen.caller in seen.open_calls
            seen.made.set()
            return b"ok"

        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        server.add_registered_method_handlers(SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(behavior)})
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return channels[-1], seen

    yield start
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(None)


def make(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(f"/{SERVICE}/{METHOD}", _registered_method=True)


def ended_within(caller: GrpcCaller, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not caller.ended and time.monotonic() < end:
        time.sleep(0.01)
    return caller.ended


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-deadline", "deadline-30s"])
def test_a_caller_learns_what_the_public_methods_say_and_its_trailers_and_end_follow(serve, timeout) -> None:
    channel, seen = serve(lambda context: None)
    answer, call = make(channel).with_call(b"q", timeout=timeout)
    caller = seen.caller
    assert answer == b"ok" and tuple(call.trailing_metadata()) == TRAILERS
    assert caller.peer == seen.peer
    assert caller.deadline == pytest.approx(seen.at + seen.remaining, abs=0.5)  # the same deadline, read once
    assert caller.gone_at_start is None
    assert ended_within(caller)  # its end ran once the call was over
    # open from its making until gRPC ended the call, answer sent: what the server's stop waits for
    assert seen.open_while_running and not seen.open_calls
    # Caller's fields, set by GrpcCaller itself: each as Caller's own __init__ sets it, but what the call told
    plain = Caller(caller.peer)
    own = {"peer", "deadline", "ended"}
    assert {n: getattr(caller, n) for n in Caller.__slots__ if n not in own} == {
        n: getattr(plain, n) for n in Caller.__slots__ if n not in own
    }


def test_a_caller_made_past_its_deadline_is_gone_with_deadline_exceeded(serve) -> None:
    channel, seen = serve(lambda context: time.sleep(0.3))
    with pytest.raises(grpc.RpcError) as failed:
        make(channel)(b"q", timeout=0.1)
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seen.made.wait(5)
    assert seen.caller.gone_at_start is Code.DEADLINE_EXCEEDED and seen.caller.gone() is Code.DEADLINE_EXCEEDED


def test_a_caller_made_after_its_caller_cancelled_is_gone_with_cancelled(serve) -> None:
    started, cancelled = threading.Event(), threading.Event()

    def wait_for_the_cancel(context: grpc.ServicerContext) -> None:
        started.set()
        end = time.monotonic() + 5
        while context.is_active() and time.monotonic() < end:  # until gRPC has ended the call
            time.sleep(0.01)
        cancelled.set()

    channel, seen = serve(wait_for_the_cancel)
    future = make(channel).future(b"q")
    assert started.wait(5)
    future.cancel()
    assert cancelled.wait(5) and seen.made.wait(5)
    assert seen.caller.ended and seen.caller.gone_at_start is Code.CANCELLED and seen.caller.gone() is Code.CANCELLED


def test_an_end_that_runs_as_the_calls_lock_is_released_is_not_lost() -> None:
    # A cancel may end the call the moment GrpcCaller lets go of the call's lock (gRPC's polling thread runs the
    # callbacks then): the caller must still read as ended, or the answer's ticket reserved next is never released.
    class Lock:
        def __init__(self) -> None:
            self.state = None

        def acquire(self) -> None:
            pass

        def release(self) -> None:  # the polling thread's turn: the call ends and its callbacks run
            callbacks, self.state.callbacks = self.state.callbacks, None
            for callback in callbacks:
                callback()

    lock = Lock()
    state = SimpleNamespace(condition=lock, callbacks=[], trailing_metadata=None)
    lock.state = state
    event = SimpleNamespace(
        call=SimpleNamespace(peer=lambda: b"ipv4:127.0.0.1:5000"),
        call_details=SimpleNamespace(deadline=9.2e18),
        invocation_metadata=(),
    )
    open_calls: set[object] = set()
    caller = GrpcCaller(SimpleNamespace(_rpc_event=event, _state=state), None, METHOD, TRAILERS, open_calls)
    assert caller.ended and caller.gone() is Code.CANCELLED and state.trailing_metadata == TRAILERS
    assert not open_calls  # ended as it was opened: nothing left for the server's stop to wait for
