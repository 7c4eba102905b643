"""The RPC table of ``indexer.v1.PrefillMetadata``: each method's request and response types, from the proto's
descriptor, and whether it waits for readiness. The data plane binds a handler to each; both transports route
by this table and parse requests through :func:`parse_request`."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service.errors import InvalidArgument

# Answered before ready: it says why the server is not.
_ANSWERED_BEFORE_READY = frozenset({"GetWarmupStatus"})


@dataclass(frozen=True)
class Rpc:
    name: str
    request_type: type[Message]
    response_type: type[Message]
    needs_ready: bool


RPCS: dict[str, Rpc] = {
    method.name: Rpc(
        method.name,
        getattr(pb, method.input_type.name),
        getattr(pb, method.output_type.name),
        method.name not in _ANSWERED_BEFORE_READY,
    )
    for method in pb.DESCRIPTOR.services_by_name["PrefillMetadata"].methods
}
REQUEST_TYPES: dict[str, type[Message]] = {name: rpc.request_type for name, rpc in RPCS.items()}
RESPONSE_TYPES: dict[str, type[Message]] = {name: rpc.response_type for name, rpc in RPCS.items()}


def parse_request(method: str, data: bytes, where: str) -> Message:
    """``method``'s request message from its wire bytes; undecodable bytes are InvalidArgument naming ``where``."""
    request_type = REQUEST_TYPES[method]
    try:
        return request_type.FromString(data)
    except DecodeError:
        raise InvalidArgument(f"{where}: not a {request_type.__name__} message") from None
