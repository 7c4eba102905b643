"""What the gRPC transport uses of grpcio beyond its public API, named in one place and checked when ``serve`` starts.

- :class:`~service.transport.grpc_server.GrpcCaller` and ``served`` read and write the call's own state
  (``grpc._server``'s ``_Context`` and ``_RPCState``, and the Cython call objects behind them: the peer, the
  deadline, the caller's metadata, the trailers and the end callbacks): the public methods were ten Python frames
  per call (benchmarks/RESULTS.md, issue 20).
- :func:`~service.transport.receive.receive_ahead` (the RPC pool's, and health's Check and List) recognises a unary
  call by grpcio's ``_unary_response_in_pool`` and its arguments' order, starts the call's receive on the polling
  thread with grpcio's ``_receive_message`` callback, and takes the request as grpcio's thunk does (the call's
  ``request`` and ``client`` fields, its abort): a call reaches a pool thread only once its request is in.
- Health's :func:`~service.transport.health.send_without_waiting` starts a send batch as grpcio's own send does,
  with its helpers and tokens: grpcio's sync server offers only a send that waits.
- Health's Watch and the unknown-method and reflection refusals name the pool a behaviour runs on, and whether a
  streaming one returns at once and sends through a callback (``experimental_thread_pool``,
  ``experimental_non_blocking``: attributes grpcio reads off the behaviour).

None of it is stable API: a grpcio release may rename any of it. The container image pins the grpcio the tests ran on
(requirements/image-cpu.txt), but ``pip install`` of the package may bring another; without this check such a server
would start, report ready and fail every call. :func:`check_grpcio` refuses the start instead, naming what is missing.
The names are checked, not their behaviour: tests/service/test_grpc_caller.py, tests/service/test_rpc_pool.py and the
health flood tests hold the behaviour (and the RPC pool's contract with grpcio's ``submit``) to grpcio's against a real
server.
"""

from __future__ import annotations

import inspect
import logging
from types import ModuleType

import grpc

log = logging.getLogger(__name__)

# The grpcio minor version the tests ran on (requirements/image-cpu.txt pins its patch release).
TESTED_GRPCIO = "1.85"

# grpc._server's helpers and tokens health's send_without_waiting calls as grpcio's own send does, those
# receive_ahead uses as grpcio's own receive does (with the function it recognises a unary call by), and the two
# call state classes (checked on instances below).
SERVER_MODULE_NAMES = (
    "_Context",
    "_RPCState",
    "_is_rpc_state_active",
    "_get_send_message_op_flags_from_state",
    "_get_initial_metadata_operation",
    "_send_message",
    "_SEND_MESSAGE_TOKEN",
    "_SEND_INITIAL_METADATA_AND_SEND_MESSAGE_TOKEN",
    "_unary_response_in_pool",
    "_receive_message",
    "_RECEIVE_MESSAGE_TOKEN",
    "_abort",
    "_CLOSED",
    "_CANCELLED",
)
# The parameters of the two grpc._server functions receive_ahead relies on, in order: the arguments grpcio submits
# for a unary call (after _unary_response_in_pool itself), and the receive callback it makes.
FUNCTION_PARAMETERS = {
    "_unary_response_in_pool": (
        "rpc_event",
        "state",
        "behavior",
        "argument_thunk",
        "request_deserializer",
        "response_serializer",
    ),
    "_receive_message": ("state", "call", "request_deserializer"),
}
# The attributes grpc._server reads off a behaviour (found in its source).
BEHAVIOUR_ATTRIBUTES = ("experimental_thread_pool", "experimental_non_blocking")
# The fields of a call's _RPCState read or written: under its condition (GrpcCaller, health), the trailers and the
# end callbacks (None once the call has ended), what health's send updates, and the request and the client's side
# that receive_ahead's thunk waits on.
STATE_FIELDS = (
    "condition",
    "trailing_metadata",
    "callbacks",
    "due",
    "initial_metadata_allowed",
    "disable_next_compression",
    "request",
    "client",
)
# A context's fields: the request-call event and the call state.
CONTEXT_FIELDS = ("_rpc_event", "_state")
# The Cython objects: the request-call event (a context's _rpc_event), its call and its details; the send operation.
CYTHON_NAMES = (
    ("RequestCallEvent", ("call", "call_details", "invocation_metadata")),
    ("Call", ("peer", "start_server_batch")),
    ("CallDetails", ("deadline",)),
    ("SendMessageOperation", ()),
    ("ReceiveMessageOperation", ()),
    ("CallError", ("ok",)),
)


def missing_grpcio_internals(server: ModuleType | None = None, cygrpc: ModuleType | None = None) -> list[str]:
    """What grpcio lacks of the above, each as a dotted name; empty when everything is there. ``server`` and
    ``cygrpc``: the modules to look in (grpcio's own by default; tests give others)."""
    if server is None or cygrpc is None:
        try:
            from grpc import _server as grpc_server
            from grpc._cython import cygrpc as grpc_cygrpc
        except ImportError as exc:  # moved modules: nothing below can be looked up
            return [f"grpc._server / grpc._cython.cygrpc ({exc})"]
        server = grpc_server if server is None else server
        cygrpc = grpc_cygrpc if cygrpc is None else cygrpc

    missing = [f"grpc._server.{name}" for name in SERVER_MODULE_NAMES if not hasattr(server, name)]
    for name, parameters in FUNCTION_PARAMETERS.items():
        function = getattr(server, name, None)
        try:
            found = None if function is None else tuple(inspect.signature(function).parameters)
        except (TypeError, ValueError):  # no signature to read: the order cannot be told
            found = None
        if found is not None and found != parameters:
            missing.append(f"grpc._server.{name}({', '.join(parameters)})")
    try:
        source = inspect.getsource(server)
    except (OSError, TypeError):  # no source to read (a compiled or frozen module): the names cannot be told
        source = None
    if source is not None:
        missing += [f"grpc._server reads {name}" for name in BEHAVIOUR_ATTRIBUTES if name not in source]
    for type_name, attributes in CYTHON_NAMES:
        owner = getattr(cygrpc, type_name, None)
        if owner is None:
            missing.append(f"cygrpc.{type_name}")
            continue
        missing += [f"cygrpc.{type_name}.{name}" for name in attributes if not hasattr(owner, name)]
    if hasattr(server, "_RPCState") and hasattr(server, "_Context"):
        missing += _missing_call_state_fields(server._RPCState, server._Context)
    return missing


def _missing_call_state_fields(state_class: type, context_class: type) -> list[str]:
    """The instance fields a call state and a context over it lack, made as grpcio makes them per call; where a
    constructor has changed, the fields the classes declare (their annotations, then class attributes)."""
    try:
        state = state_class()
        event = object()
        context = context_class(event, state, None)
    except Exception:  # a constructor that takes other arguments: the declared fields stand in
        declared_state = {*getattr(state_class, "__annotations__", {}), *dir(state_class)}
        declared_context = {*getattr(context_class, "__annotations__", {}), *dir(context_class)}
        return [f"grpc._server._RPCState.{name}" for name in STATE_FIELDS if name not in declared_state] + [
            f"grpc._server._Context.{name}" for name in CONTEXT_FIELDS if name not in declared_context
        ]
    # The instance's own fields: grpcio 1.85's _RPCState also has a class attribute ``due``, which hasattr would find
    # on an instance without the field.
    fields = set(vars(state)) if hasattr(state, "__dict__") else {name for name in STATE_FIELDS if hasattr(state, name)}
    missing = [f"grpc._server._RPCState.{name}" for name in STATE_FIELDS if name not in fields]
    condition = getattr(state, "condition", None)
    if condition is not None and not (hasattr(condition, "acquire") and hasattr(condition, "release")):
        missing.append("grpc._server._RPCState.condition.acquire/release")
    if getattr(state, "callbacks", None) != []:  # a new call's end callbacks: a list until the call ends
        missing.append("grpc._server._RPCState.callbacks (a list on a new call)")
    if getattr(context, "_rpc_event", None) is not event:
        missing.append("grpc._server._Context._rpc_event")
    if getattr(context, "_state", None) is not state:
        missing.append("grpc._server._Context._state")
    return missing


def check_grpcio() -> None:
    """Raise RuntimeError (``serve`` exits 1 with it on stderr) when this grpcio lacks what the transport uses; log a
    warning when everything is there but the version is not the tested one."""
    missing = missing_grpcio_internals()
    if missing:
        raise RuntimeError(
            f"grpcio {grpc.__version__} lacks what this server uses of its internals ({', '.join(missing)}); "
            f"install grpcio {TESTED_GRPCIO}.x, the version it is tested with (requirements/image-cpu.txt)"
        )
    if not grpc.__version__.startswith(f"{TESTED_GRPCIO}."):
        log.warning(
            "grpcio %s: this server is tested with %s.x; the internals it uses are there by name",
            grpc.__version__,
            TESTED_GRPCIO,
        )
