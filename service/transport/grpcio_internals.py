"""What the gRPC transport uses of grpcio beyond its public API, named in one place and checked when ``serve`` starts.

Two places read or write grpcio's own call state (``grpc._server``'s ``_Context`` and ``_RPCState``, and the Cython
call objects behind them): :class:`~service.transport.grpc_server.GrpcCaller` and the request id lookup in
``served`` (the public methods were ten Python frames per call, benchmarks/RESULTS.md, issue 20), and health's
:func:`~service.transport.health.send_without_waiting` (grpcio's sync server offers only a send that waits). None of
it is API: a grpcio release may rename any of it. The container image pins the grpcio the tests ran on
(requirements/image-cpu.txt), but ``pip install`` of the package may bring another; without this check such a
server would start, report ready and fail every call. :func:`check_grpcio` refuses the start instead, with one line
naming what is missing. The names are checked, not their behaviour: tests/service/test_grpc_caller.py and the health
flood tests hold the behaviour to grpcio's public methods against a real server.
"""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)

# The grpcio minor version the tests ran on (requirements/image-cpu.txt pins its patch release).
TESTED_GRPCIO = "1.85"

# grpc._server's module-level helpers and tokens health's send_without_waiting calls as grpcio's own send does.
_SERVER_MODULE_NAMES = (
    "_Context",
    "_RPCState",
    "_is_rpc_state_active",
    "_get_send_message_op_flags_from_state",
    "_get_initial_metadata_operation",
    "_send_message",
    "_SEND_MESSAGE_TOKEN",
    "_SEND_INITIAL_METADATA_AND_SEND_MESSAGE_TOKEN",
)
# The fields of a call's _RPCState read or written: under its condition (GrpcCaller, health), the trailers and the
# end callbacks (None once the call has ended), and what health's send updates.
_STATE_FIELDS = (
    "condition",
    "trailing_metadata",
    "callbacks",
    "due",
    "initial_metadata_allowed",
    "disable_next_compression",
)
# The Cython objects: the request-call event (a context's _rpc_event), its call and its details.
_CYTHON_NAMES = (
    ("RequestCallEvent", ("call", "call_details", "invocation_metadata")),
    ("Call", ("peer", "start_server_batch")),
    ("CallDetails", ("deadline",)),
    ("SendMessageOperation", ()),
)


def missing_grpcio_internals() -> list[str]:
    """What this grpcio lacks of the above, each as a dotted name; empty when everything is there."""
    from grpc import _server
    from grpc._cython import cygrpc

    missing = [f"grpc._server.{name}" for name in _SERVER_MODULE_NAMES if not hasattr(_server, name)]
    for type_name, attributes in _CYTHON_NAMES:
        owner = getattr(cygrpc, type_name, None)
        if owner is None:
            missing.append(f"cygrpc.{type_name}")
            continue
        missing += [f"cygrpc.{type_name}.{name}" for name in attributes if not hasattr(owner, name)]
    if any(name.startswith(("grpc._server._Context", "grpc._server._RPCState")) for name in missing):
        return missing
    # Instance fields exist only on instances: make a call state and a context over it, as grpcio does per call.
    try:
        state = _server._RPCState()
        event = object()
        context = _server._Context(event, state, None)
    except Exception as exc:  # a changed constructor
        return [*missing, f"grpc._server._RPCState() / _Context(event, state, deserializer): {exc}"]
    # The instance's own fields (grpcio's _RPCState also has a class attribute ``due``, which hasattr would find)
    fields = (
        vars(state) if hasattr(state, "__dict__") else {name: None for name in _STATE_FIELDS if hasattr(state, name)}
    )
    missing += [f"grpc._server._RPCState.{name}" for name in _STATE_FIELDS if name not in fields]
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
    """Raise RuntimeError (``serve`` exits 1 with its one line) when this grpcio lacks what the transport uses of
    its call state; log a warning when everything is there but the version is not the tested one."""
    missing = missing_grpcio_internals()
    if missing:
        raise RuntimeError(
            f"grpcio {grpc.__version__} lacks what this server uses of its call state ({', '.join(missing)}); "
            f"install grpcio {TESTED_GRPCIO}.x, the version it is tested with (requirements/image-cpu.txt)"
        )
    if not grpc.__version__.startswith(f"{TESTED_GRPCIO}."):
        log.warning(
            "grpcio %s: this server is tested with %s.x; the call state it uses is there by name",
            grpc.__version__,
            TESTED_GRPCIO,
        )
