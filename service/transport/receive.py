"""A unary call's request, received on gRPC's polling thread before any pool thread is spent on the call.

grpcio's sync server hands a unary call to its pool with a request thunk that starts receiving the message on the
pool thread and sleeps there until the polling thread delivers it. Two costs follow: a caller that opens calls and
never sends their message holds a pool thread per call until it leaves (8 such calls from one connection stopped
every other caller's calls on the RPC port; 2 stopped the health port's Check, and with it the kubelet's probes),
and every call pays one more sleep and wake-up of each thread (benchmarks/RESULTS.md, issue 20). Here the receive
is started as the call is submitted, and the call reaches a pool thread only once its message is in
(:func:`receive_ahead`); a call that will only be refused does not wait for it at all (:func:`without_request`).

Both read grpcio's own call state and helpers (``grpc._server``, grpcio 1.85), named and checked when ``serve``
starts in service/transport/grpcio_internals.py. tests/service/test_rpc_pool.py holds the answers to grpcio's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from grpc import _server as grpc_server_internals
from grpc._cython import cygrpc

log = logging.getLogger(__name__)


def receive_ahead(args: tuple, queue: Callable[[tuple], None]) -> bool:
    """For a unary call (grpcio's arguments ``_unary_response_in_pool`` and what follows it): start receiving its
    request message now, on gRPC's polling thread that submits the call, and ``queue`` its arguments, grpcio's
    request thunk swapped for one that takes the message, once the message is in (or the call ended without one),
    from the same thread. True when it did; False for any other call, or where gRPC would not start the receive:
    the caller queues those as they are (grpcio's own thunk receives).

    Queued once the message is in, a call whose message never comes holds no thread, only its place under
    ``max_concurrent_rpcs`` until its caller leaves. A call waiting for a thread holds its request meanwhile, at most
    ``max_request_bytes`` (gRPC refuses a longer one): 24 MiB for ``max_concurrent_rpcs`` calls at the defaults.

    The swapped thunk answers as grpcio's does: None when the call ended first (the caller cancelled or reset the
    stream, or its deadline passed), UNIMPLEMENTED "requires exactly one request message" when the caller
    half-closed without one, else the request. The polling thread holds the call's condition here (grpcio's
    ``_handle_with_method_handler``), as grpcio's thunk holds it to start the receive, and handles the receive's
    completion itself, so the call is queued exactly once, after this returns."""
    if not _is_unary(args):
        return False
    respond, rpc_event, state, behavior, _grpcio_thunk, request_deserializer, response_serializer = args
    internals = grpc_server_internals
    call = rpc_event.call
    grpcio_receive = internals._receive_message(state, call, request_deserializer)

    def take_request() -> object:
        with state.condition:
            if not internals._is_rpc_state_active(state):
                return None
            request, state.request = state.request, None
            if request is None:  # grpcio's receive saw the caller half-close without a message
                method = rpc_event.call_details.method.decode(errors="replace")
                details = f'"{method}" requires exactly one request message.'.encode()
                internals._abort(state, call, cygrpc.StatusCode.unimplemented, details)
            return request

    def received(event: object) -> object:
        finished = grpcio_receive(event)  # the call's state, as grpcio's own receive leaves it
        queue((respond, rpc_event, state, behavior, take_request, request_deserializer, response_serializer))
        return finished

    try:
        started = call.start_server_batch((cygrpc.ReceiveMessageOperation(0),), received)
    except ValueError:  # a call gRPC no longer knows: grpcio's thunk meets it on the pool thread, as before
        return False
    if started != cygrpc.CallError.ok:  # no completion will come: leave the call to grpcio's thunk
        log.warning("gRPC refused to start a request's receive (call error %s); a pool thread receives it", started)
        return False
    state.due.add(internals._RECEIVE_MESSAGE_TOKEN)
    return True


def without_request(args: tuple) -> tuple:
    """grpcio's arguments for a unary call that is refused, its request thunk swapped for one that does not wait
    for the request (the refusal does not read it: b"" stands in, or None when the call has already ended, as
    grpcio's thunk gives); any other call's as they are. grpcio's own thunk would hold one of the two refusal
    threads until the request came: two calls that never send theirs stopped every refusal, and a caller past
    ``max_concurrent_rpcs`` waited out its deadline instead of hearing RESOURCE_EXHAUSTED."""
    if not _is_unary(args):
        return args
    state = args[2]

    def no_request() -> bytes | None:
        with state.condition:
            return b"" if grpc_server_internals._is_rpc_state_active(state) else None

    return (*args[:4], no_request, *args[5:])


class ReceiveAheadExecutor(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` for a behaviour's ``experimental_thread_pool`` (health's Check and List) that runs a
    unary call only once its request is in (:func:`receive_ahead`): the future grpcio gets back is done when the
    call has run, or failed to."""

    def submit(self, fn: Callable, /, *args: object, **kwargs: object) -> Future:
        if kwargs:
            return super().submit(fn, *args, **kwargs)
        outer: Future = Future()

        def run(received: tuple) -> None:
            try:
                inner = super(ReceiveAheadExecutor, self).submit(fn, *received)
            except RuntimeError as exc:  # shut down meanwhile: the call ends with the server
                outer.set_exception(exc)
                return
            inner.add_done_callback(lambda done: _settle(outer, done))

        if receive_ahead(args, run):
            return outer
        return super().submit(fn, *args)


def _settle(outer: Future, inner: Future) -> None:
    """``outer`` done as ``inner`` is."""
    if inner.cancelled():  # shut down with its calls queued
        outer.cancel()
    elif (exc := inner.exception()) is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(inner.result())


# What grpcio submits first among a unary call's arguments (after the context's ``run``); None where this grpcio has
# no such function (serve refuses to start on it: service/transport/grpcio_internals.py), and no call is matched.
_UNARY_RESPONSE_IN_POOL = getattr(grpc_server_internals, "_unary_response_in_pool", None)


def _is_unary(args: tuple) -> bool:
    """Whether ``args`` are grpcio's for a unary call: ``_unary_response_in_pool``, the request-call event, the
    call's state, the behaviour, the request thunk, the request deserializer and the response serializer."""
    return len(args) == 7 and args[0] is _UNARY_RESPONSE_IN_POOL
