"""grpcio past its public API: every reach into ``grpc._server`` and ``grpc._cython.cygrpc``, each feature with its
public fallback.

- ``call_state``: a behaviour reads its call's peer, deadline and metadata and sets its trailers and end callback
  on grpcio's own call state (``_Context._rpc_event``, ``_Context._state``) under the call's lock, as the public
  methods do (``peer()``, ``time_remaining()``, ``invocation_metadata()``, ``set_trailing_metadata()``,
  ``add_callback()``), which would cost more Python frames a call (docs/performance.md). The gate also reads a call's
  peer as grpcio submits it, before any thread is spent, for the per-peer share of places. Fallback: the public
  methods; the per-peer share is then applied when the call starts instead.
- ``receive_ahead``: a call with one request message (unary-unary, unary-stream) has its receive started on gRPC's
  polling thread as grpcio submits it, and reaches a thread only once the message is in; grpcio's request thunk is
  swapped for one that takes the message. Fallback: grpcio's own thunk, which holds a thread while it waits.
- ``send_without_waiting``: a streaming message handed to gRPC core without waiting for the peer's window (health's
  Watch). Fallback: grpcio's send callback, which waits on a health thread until the message is sent.

:func:`probe` checks every name and signature each feature relies on; :func:`features` takes each feature whose
check fails onto its fallback (service/adapters/__init__.py says how that is announced). Code of ours that runs on
gRPC's polling thread (a receive's or a send's completion) is guarded here: an exception is handed to ``on_error``
and the thread goes on.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType

import grpc

from indexer_service.service import adapters

LIBRARY = "grpcio"
# A call's deadline when it has none, as grpcio's call details give it (a time.time() far in the future).
NO_DEADLINE = float("inf")
Metadata = tuple[tuple[str, str | bytes], ...]
ErrorSink = Callable[[str, BaseException], None]  # (where, exception)

# What each feature relies on. grpc._server's module names:
_SERVER_NAMES = {
    "call_state": ("_Context", "_RPCState"),
    "receive_ahead": (
        "_RPCState",
        "_unary_response_in_pool",
        "_stream_response_in_pool",
        "_receive_message",
        "_RECEIVE_MESSAGE_TOKEN",
        "_is_rpc_state_active",
        "_abort",
    ),
    "send_without_waiting": (
        "_RPCState",
        "_is_rpc_state_active",
        "_get_send_message_op_flags_from_state",
        "_get_initial_metadata_operation",
        "_send_message",
        "_SEND_MESSAGE_TOKEN",
        "_SEND_INITIAL_METADATA_AND_SEND_MESSAGE_TOKEN",
    ),
}
# What grpcio submits to its pool for a call after the function itself, in order (both functions take the same).
_IN_POOL_PARAMETERS = (
    "rpc_event",
    "state",
    "behavior",
    "argument_thunk",
    "request_deserializer",
    "response_serializer",
)
# The parameters of the grpc._server functions a feature calls or recognises, in order.
_PARAMETERS = {
    "receive_ahead": {
        "_unary_response_in_pool": _IN_POOL_PARAMETERS,
        "_stream_response_in_pool": _IN_POOL_PARAMETERS,
        "_receive_message": ("state", "call", "request_deserializer"),
        "_abort": ("state", "call", "code", "details"),
    },
    "send_without_waiting": {
        "_send_message": ("state", "token"),
        "_get_initial_metadata_operation": ("state", "metadata"),
    },
}
# The fields of a call's _RPCState each feature reads or writes, and of its _Context.
_STATE_FIELDS = {
    "call_state": ("condition", "trailing_metadata", "callbacks"),
    "receive_ahead": ("condition", "due", "request", "client"),
    "send_without_waiting": ("condition", "due", "initial_metadata_allowed", "disable_next_compression"),
}
_CONTEXT_FIELDS = ("_rpc_event", "_state")
# The Cython types and their attributes each feature uses.
_CYTHON_NAMES = {
    "call_state": (
        ("RequestCallEvent", ("call", "call_details", "invocation_metadata")),
        ("Call", ("peer",)),
        ("CallDetails", ("deadline",)),
    ),
    "receive_ahead": (
        ("RequestCallEvent", ("call", "call_details")),
        ("Call", ("start_server_batch",)),
        ("ReceiveMessageOperation", ()),
        ("CallError", ("ok",)),
        ("StatusCode", ("unimplemented", "deadline_exceeded", "resource_exhausted")),
    ),
    "send_without_waiting": (
        ("RequestCallEvent", ("call",)),
        ("Call", ("start_server_batch",)),
        ("SendMessageOperation", ()),
    ),
}
# What grpcio's server must read off a behaviour for health's Watch to send through a callback.
_BEHAVIOUR_ATTRIBUTE = "experimental_non_blocking"
_PUBLIC_PATHS = {
    "call_state": "calls use the public ServicerContext methods, and no peer is known before a call starts: no "
    "per-peer share of places",
    "receive_ahead": "a call waits for its request on a thread (grpcio's own request thunk)",
    "send_without_waiting": "health Watch sends wait on a health thread until the peer reads",
}


def _grpcio_modules() -> tuple[ModuleType | None, ModuleType | None]:
    try:
        from grpc import _server as server
        from grpc._cython import cygrpc
    except ImportError:  # moved modules: every feature falls back
        return None, None
    return server, cygrpc


def probe(server: ModuleType | None = None, cygrpc: ModuleType | None = None) -> dict[str, list[str]]:
    """For each feature, what the given grpcio lacks of what it relies on (dotted names); an empty list: the
    feature can be on. ``server`` and ``cygrpc``: the modules to look in (grpcio's own by default; tests give
    others)."""
    if server is None and cygrpc is None:
        server, cygrpc = _grpcio_modules()
    if server is None or cygrpc is None:
        return {feature: ["grpc._server / grpc._cython.cygrpc"] for feature in adapters.FEATURES[LIBRARY]}
    state_fields, context_ok = _call_state_fields(server)
    found: dict[str, list[str]] = {}
    for feature in adapters.FEATURES[LIBRARY]:
        missing = [f"grpc._server.{name}" for name in _SERVER_NAMES[feature] if not hasattr(server, name)]
        for name, parameters in _PARAMETERS.get(feature, {}).items():
            if _parameters(getattr(server, name, None)) not in (None, parameters):
                missing.append(f"grpc._server.{name}({', '.join(parameters)})")
        missing += [f"grpc._server._RPCState.{name}" for name in _STATE_FIELDS[feature] if name not in state_fields]
        if not context_ok:
            missing.append(f"grpc._server._Context({', '.join(_CONTEXT_FIELDS)})")
        for type_name, attributes in _CYTHON_NAMES[feature]:
            owner = getattr(cygrpc, type_name, None)
            if owner is None:
                missing.append(f"cygrpc.{type_name}")
            else:
                missing += [f"cygrpc.{type_name}.{name}" for name in attributes if not hasattr(owner, name)]
        if feature == "send_without_waiting" and not _reads(server, _BEHAVIOUR_ATTRIBUTE):
            missing.append(f"grpc._server reads {_BEHAVIOUR_ATTRIBUTE}")
        found[feature] = missing
    return found


def _parameters(function: object) -> tuple[str, ...] | None:
    try:
        return None if function is None else tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # no signature to read: the order cannot be told
        return None


def _reads(server: ModuleType, attribute: str) -> bool:
    try:
        return attribute in inspect.getsource(server)
    except (OSError, TypeError):  # no source (a compiled module): the name cannot be told, taken as there
        return True


def _call_state_fields(server: ModuleType) -> tuple[set[str], bool]:
    """The fields a new call state has, made as grpcio makes one per call, and whether a context over it holds
    the request-call event and the state; where a constructor has changed, the fields the classes declare."""
    state_class, context_class = getattr(server, "_RPCState", None), getattr(server, "_Context", None)
    if state_class is None or context_class is None:
        return set(), False
    try:
        state = state_class()
        event = object()
        context = context_class(event, state, None)
    except Exception:  # a constructor that takes other arguments: the declared fields stand in
        declared = {*getattr(state_class, "__annotations__", {}), *dir(state_class)}
        declared_context = {*getattr(context_class, "__annotations__", {}), *dir(context_class)}
        return declared, all(name in declared_context for name in _CONTEXT_FIELDS)
    # The instance's own fields: grpcio's _RPCState also has a class attribute ``due``, which hasattr would find.
    fields = set(vars(state)) if hasattr(state, "__dict__") else set()
    condition = getattr(state, "condition", None)
    if condition is not None and not (hasattr(condition, "acquire") and hasattr(condition, "release")):
        fields.discard("condition")
    if getattr(state, "callbacks", None) != []:  # a new call's end callbacks: a list until the call ends
        fields.discard("callbacks")
    context_ok = getattr(context, "_rpc_event", None) is event and getattr(context, "_state", None) is state
    return fields, context_ok


@dataclass(frozen=True)
class GrpcioFeatures:
    """Which grpcio features are on in this process (the others are on their public path)."""

    call_state: bool
    receive_ahead: bool
    send_without_waiting: bool


def choose(missing: dict[str, list[str]]) -> GrpcioFeatures:
    """The features ``missing`` (:func:`probe`'s answer) allows; each one it does not is taken as a fallback."""
    for feature, names in missing.items():
        if names:
            adapters.take(adapters.Fallback(LIBRARY, feature, tuple(names), _PUBLIC_PATHS[feature]))
    # receive_ahead finds the call's state and event through what call_state checks too.
    on = {feature: not names for feature, names in missing.items()}
    on["receive_ahead"] = on["receive_ahead"] and on["call_state"]
    on["send_without_waiting"] = on["send_without_waiting"] and on["call_state"]
    return GrpcioFeatures(**on)


@functools.cache
def features() -> GrpcioFeatures:
    """This process's grpcio features, probed once."""
    return choose(probe())


# -- call_state -------------------------------------------------------------------------------------------------


def open_call_fast(context: grpc.ServicerContext, trailers: Metadata, on_end: Callable[[], None]) -> tuple:
    """``(peer, deadline, metadata, ended)`` of a call, its trailing metadata set to ``trailers`` and ``on_end``
    added to the callbacks gRPC runs once the call is over (``ended``: it is over already, and ``on_end`` was not
    added). ``deadline``: time.time() seconds."""
    event = context._rpc_event
    call = event.call
    state = context._state
    state.condition.acquire()  # the call's lock, as grpcio's own methods take it
    try:
        state.trailing_metadata = trailers
        callbacks = state.callbacks  # None: the call has already ended
        if callbacks is not None:
            callbacks.append(on_end)
    finally:
        state.condition.release()
    return (
        call.peer().decode("utf8", "replace"),
        event.call_details.deadline,
        event.invocation_metadata,
        callbacks is None,
    )


def open_call_public(context: grpc.ServicerContext, trailers: Metadata, on_end: Callable[[], None]) -> tuple:
    """:func:`open_call_fast` through the public ServicerContext methods."""
    context.set_trailing_metadata(trailers)
    ended = not context.add_callback(on_end)
    remaining = context.time_remaining()
    deadline = NO_DEADLINE if remaining is None else time.time() + remaining
    return context.peer(), deadline, tuple(context.invocation_metadata() or ()), ended


def call_opener() -> Callable[[grpc.ServicerContext, Metadata, Callable[[], None]], tuple]:
    """This process's way to open a call (:func:`open_call_fast` where ``call_state`` is on)."""
    return open_call_fast if features().call_state else open_call_public


# -- what grpcio submits to a server's pool -----------------------------------------------------------------------


@dataclass(frozen=True)
class Submitted:
    """A call as grpcio submits it to the server's pool: the behaviour it will run, the caller's address (None
    where ``call_state`` is off) and whether it has exactly one request message."""

    behavior: object
    peer: str | None
    unary_request: bool


def submitted(args: tuple, unary_request: Callable[[object], bool]) -> Submitted | None:
    """What ``args`` (grpcio's arguments after the context's ``run``) are a call of; None where they are not
    grpcio's call arguments as this adapter knows them. ``unary_request(behavior)``: whether the behaviour's method
    has one request message (its handler says; the arguments alone do not tell unary-stream from stream-stream)."""
    if not _readable(args):
        return None
    function, rpc_event, _state, behavior = args[:4]
    if function is not _UNARY_RESPONSE_IN_POOL and function is not _STREAM_RESPONSE_IN_POOL:
        return None
    return Submitted(behavior, _host_port(rpc_event.call.peer()), unary_request(behavior))


def behavior_among(args: Iterable[object], known: object) -> object | None:
    """The first of ``args`` that is a key of ``known`` (a dict of behaviours): a call's behaviour where
    :func:`submitted` cannot read grpcio's arguments."""
    return next((arg for arg in args if callable(arg) and arg in known), None)


def _host_port(peer: bytes) -> str:
    return peer.decode("utf8", "replace")


def _readable(args: tuple) -> bool:
    """Whether ``args`` can be read as grpcio's arguments for a call (``receive_ahead`` on, their number right)."""
    return len(args) == 7 and features().receive_ahead


# -- receive_ahead ------------------------------------------------------------------------------------------------


def receive_ahead(args: tuple, queue: Callable[[tuple], None], on_error: ErrorSink) -> bool:
    """For a call with one request message (grpcio's arguments, :func:`submitted` says so): start receiving its
    request now, on gRPC's polling thread that submits the call, and ``queue`` its arguments, grpcio's request
    thunk swapped for one that takes the message, once the message is in (or the call ended without one), from
    the polling thread. True when it did; False where gRPC would not start the receive: the caller queues those as
    they are (grpcio's own thunk receives).

    The swapped thunk answers as grpcio's does: None when the call ended first, UNIMPLEMENTED "requires exactly
    one request message" when the caller half-closed without one, else the request. The polling thread holds the
    call's condition here (grpcio's ``_handle_with_method_handler``), as grpcio's thunk holds it to start the
    receive, and handles the receive's completion itself, so the call is queued exactly once, after this returns.
    An exception from ``queue`` is handed to ``on_error`` (the polling thread must go on); the call then ends with
    the server, as a call nobody took."""
    from grpc import _server as internals
    from grpc._cython import cygrpc

    respond, rpc_event, state, behavior, _grpcio_thunk, request_deserializer, response_serializer = args
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
        try:
            queue((respond, rpc_event, state, behavior, take_request, request_deserializer, response_serializer))
        except Exception as exc:
            on_error("receive_ahead", exc)
        return finished

    try:
        started = call.start_server_batch((cygrpc.ReceiveMessageOperation(0),), received)
    except ValueError:  # a call gRPC no longer knows: grpcio's thunk meets it on the thread, as it would anyway
        return False
    if started != cygrpc.CallError.ok:  # no completion will come: leave the call to grpcio's thunk
        on_error("receive_ahead", RuntimeError(f"gRPC refused to start a request's receive (call error {started})"))
        return False
    state.due.add(internals._RECEIVE_MESSAGE_TOKEN)
    return True


def without_request(args: tuple) -> tuple:
    """grpcio's arguments for a call with one request message that is refused, its request thunk swapped for one
    that does not wait for the request (the refusal does not read it: b"" stands in, or None when the call has
    already ended, as grpcio's thunk gives); others as they are. grpcio's own thunk would hold a refusal thread
    until the request came."""
    if not _readable(args):
        return args
    from grpc import _server as internals

    state = args[2]

    def no_request() -> bytes | None:
        with state.condition:
            return b"" if internals._is_rpc_state_active(state) else None

    return (*args[:4], no_request, *args[5:])


def deadline_of(args: tuple) -> float | None:
    """The deadline (time.time() seconds) of a call grpcio submitted; None where ``receive_ahead`` is off (the
    arguments cannot be read)."""
    if not _readable(args):
        return None
    return args[1].call_details.deadline


def peer_of(args: tuple) -> str | None:
    """The caller's address of a call grpcio submitted; None where ``receive_ahead`` is off."""
    if not _readable(args):
        return None
    return _host_port(args[1].call.peer())


def end_call(args: tuple, code: str, details: str) -> bool:
    """End a call grpcio submitted (its arguments, :func:`submitted` read them) with status ``code`` (a
    ``grpc.StatusCode`` name in lower case) and ``details``, as grpcio's own abort does, without running it. False
    where the call had ended already, or where ``receive_ahead`` is off (the arguments cannot be read)."""
    if not _readable(args):
        return False
    from grpc import _server as internals
    from grpc._cython import cygrpc

    rpc_event, state = args[1], args[2]
    with state.condition:
        if not internals._is_rpc_state_active(state):
            return False
        internals._abort(state, rpc_event.call, getattr(cygrpc.StatusCode, code), details.encode())
    return True


# -- send_without_waiting ---------------------------------------------------------------------------------------


def send_without_waiting(
    context: grpc.ServicerContext, payload: bytes, on_sent: Callable[[], None], on_error: ErrorSink
) -> bool:
    """Hand one serialized message of a server-streaming call to gRPC core and return at once; ``on_sent()`` runs
    on gRPC's polling thread (it must not block) once core has sent it or the call ended (an exception from it is
    handed to ``on_error``). False when the call has already ended. At most one message may be on its way per
    call. The same batch as grpcio's own send (``_send_response``) without the wait."""
    from grpc import _server as internals
    from grpc._cython import cygrpc

    state, call = context._state, context._rpc_event.call
    with state.condition:
        if not internals._is_rpc_state_active(state):
            return False
        message = cygrpc.SendMessageOperation(payload, internals._get_send_message_op_flags_from_state(state))
        if state.initial_metadata_allowed:
            operations = (internals._get_initial_metadata_operation(state, None), message)
            state.initial_metadata_allowed = False
            token = internals._SEND_INITIAL_METADATA_AND_SEND_MESSAGE_TOKEN
        else:
            operations, token = (message,), internals._SEND_MESSAGE_TOKEN
        finish = internals._send_message(state, token)

        def sent(event: object) -> object:
            done = finish(event)  # the call's state, as grpcio's own send leaves it
            try:
                on_sent()
            except Exception as exc:
                on_error("send_without_waiting", exc)
            return done

        call.start_server_batch(operations, sent)
        state.due.add(token)
        state.disable_next_compression = False
    return True


def non_blocking(behaviour: Callable) -> Callable:
    """``behaviour`` marked for grpcio's server to call with a send callback and let return at once (a streaming
    behaviour that sends later, from any thread). Set on a function of its own: bound methods take no attributes."""

    def behaviour_sending_later(*args: object) -> object:
        return behaviour(*args)

    setattr(behaviour_sending_later, _BEHAVIOUR_ATTRIBUTE, True)
    return behaviour_sending_later


_SERVER_MODULE, _ = _grpcio_modules()
# What grpcio submits first among a call's arguments (after the context's ``run``); None where this grpcio has no
# such function (receive_ahead is then off).
_UNARY_RESPONSE_IN_POOL = getattr(_SERVER_MODULE, "_unary_response_in_pool", None)
_STREAM_RESPONSE_IN_POOL = getattr(_SERVER_MODULE, "_stream_response_in_pool", None)
