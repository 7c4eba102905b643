"""gRPC server reflection, ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha`` (the same messages under two
package names), sending the service's descriptors with their comments.

grpcio-reflection serves only v1alpha, and from the descriptors compiled into ``*_pb2.py``, which carry no
comments: ``grpcurl describe`` could not show the one rule every caller must know (arrays are little-endian
int32 bytes). Here the files come from ``indexer_descriptor.binpb`` (``make protos`` writes it with the source
comments), plus health and reflection's own.

A reflection stream reads its requests on a thread it holds while open (grpcio's sync server has no other way to
read a stream), so streams are bounded (docs/overload.md, "Long-lived streams"): the gate runs them on a lane of
their own, never on the RPC threads; at most ``reflection_max_streams`` are open at once and two per connection
(streams.REFLECTION_STREAMS_PER_CONNECTION; more are refused with RESOURCE_EXHAUSTED before they take a thread,
shed ``stream_limit``, but for one at a time that waits up to streams.REFLECTION_LAG_SECONDS for its connection's
last stream to end); a stream that waits longer than ``reflection_idle_seconds`` for a request is cancelled
(shed ``idle_stream``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from importlib import resources

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from indexer_service.service.overload.admission import DrainWatchdog, Watched
from indexer_service.service.reasons import ShedReason
from indexer_service.service.transport.gate import CallGate
from indexer_service.service.transport.streams import (
    REFLECTION_LAG_SECONDS,
    REFLECTION_STREAMS_PER_CONNECTION,
    ShedFn,
    StreamSlots,
    parsed_or_refused,
)

V1ALPHA = rpb.DESCRIPTOR.services_by_name["ServerReflection"].full_name
V1 = V1ALPHA.replace(".v1alpha.", ".v1.")
REFLECTION_NAMES = (V1, V1ALPHA)
_INDEXER_DESCRIPTORS = ("indexer_service.protos.indexer.v1", "indexer_descriptor.binpb")
METHOD = "ServerReflectionInfo"


def _proto_of(file_descriptor) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    return proto


def _v1_reflection_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file with the package renamed (the messages are equal)."""
    proto = _proto_of(rpb.DESCRIPTOR)
    old, new = proto.package, proto.package.replace("v1alpha", "v1")
    proto.name, proto.package = proto.name.replace("v1alpha", "v1"), new
    for message in proto.message_type:
        for field in message.field:
            field.type_name = field.type_name.replace(f".{old}.", f".{new}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    return proto


def served_files() -> list[descriptor_pb2.FileDescriptorProto]:
    """Every file reflection answers with: the service's (with comments), health, and reflection v1/v1alpha."""
    package, name = _INDEXER_DESCRIPTORS
    indexer = descriptor_pb2.FileDescriptorSet.FromString(resources.files(package).joinpath(name).read_bytes())
    return [*indexer.file, _proto_of(health_pb2.DESCRIPTOR), _proto_of(rpb.DESCRIPTOR), _v1_reflection_file()]


def _symbols(proto: descriptor_pb2.FileDescriptorProto) -> Iterator[str]:
    prefix = f"{proto.package}." if proto.package else ""

    def messages(items: Iterable[descriptor_pb2.DescriptorProto], scope: str) -> Iterator[str]:
        for message in items:
            name = f"{scope}{message.name}"
            yield name
            yield from (f"{name}.{f.name}" for f in message.field)
            yield from (f"{name}.{e.name}" for e in message.enum_type)
            yield from messages(message.nested_type, f"{name}.")

    yield from messages(proto.message_type, prefix)
    for enum in proto.enum_type:
        yield f"{prefix}{enum.name}"
        yield from (f"{prefix}{value.name}" for value in enum.value)
    for service in proto.service:
        yield f"{prefix}{service.name}"
        yield from (f"{prefix}{service.name}.{method.name}" for method in service.method)


class ReflectionServicer:
    """ServerReflectionInfo over a fixed set of files and listed services."""

    def __init__(self, service_names: Sequence[str], files: Sequence[descriptor_pb2.FileDescriptorProto]) -> None:
        self.service_names = tuple(sorted(service_names))
        self._files = {f.name: f for f in files}
        self._by_symbol = {symbol: f.name for f in files for symbol in _symbols(f)}

    def _with_dependencies(self, name: str) -> list[bytes]:
        order: list[str] = []

        def visit(file_name: str) -> None:
            if file_name in order or file_name not in self._files:
                return
            order.append(file_name)
            for dependency in self._files[file_name].dependency:
                visit(dependency)

        visit(name)
        return [self._files[n].SerializeToString() for n in order]

    def answer(self, request: rpb.ServerReflectionRequest) -> rpb.ServerReflectionResponse:
        kind = request.WhichOneof("message_request")
        response = rpb.ServerReflectionResponse(valid_host=request.host, original_request=request)
        if kind == "list_services":
            response.list_services_response.service.extend(rpb.ServiceResponse(name=n) for n in self.service_names)
            return response
        name = None
        if kind == "file_by_filename":
            name = request.file_by_filename if request.file_by_filename in self._files else None
            missing = f"no file {request.file_by_filename!r}"
        elif kind == "file_containing_symbol":
            name = self._by_symbol.get(request.file_containing_symbol)
            missing = f"no symbol {request.file_containing_symbol!r}"
        else:
            missing = f"{kind}: this server defines no extensions"
        if name is None:
            response.error_response.error_code = grpc.StatusCode.NOT_FOUND.value[0]
            response.error_response.error_message = missing
            return response
        response.file_descriptor_response.file_descriptor_proto.extend(self._with_dependencies(name))
        return response


class Reflection:
    """Reflection under both package names (``handlers``), on a lane of ``gate``; :meth:`close` at stop."""

    def __init__(
        self, service_names: Sequence[str], max_streams: int, idle_seconds: float, shed: ShedFn, gate: CallGate
    ) -> None:
        self.servicer = ReflectionServicer([*service_names, *REFLECTION_NAMES], served_files())
        self.slots = StreamSlots(
            "reflection streams", REFLECTION_STREAMS_PER_CONNECTION, max_streams, REFLECTION_LAG_SECONDS
        )
        self.shed = shed
        self._idle = DrainWatchdog(idle_seconds)
        # Two threads beyond the slots: open streams hold at most max_streams threads and the one stream that waits
        # for its connection's lagging slot (StreamSlots.lag_seconds) one more, so a stream over a limit is always
        # refused at once, never queued behind the open ones.
        lane = gate.lane("reflection", max_streams + 2, max_streams + 2, REFLECTION_STREAMS_PER_CONNECTION + 1)
        # Bytes in, parsed in _serve: a request that does not parse is refused and counted here.
        method = grpc.stream_stream_rpc_method_handler(
            self._serve, response_serializer=rpb.ServerReflectionResponse.SerializeToString
        )
        gate.route(method.stream_stream, METHOD, lane, unary_request=False)
        self.handlers: tuple[grpc.GenericRpcHandler, ...] = tuple(
            grpc.method_handlers_generic_handler(name, {METHOD: method}) for name in REFLECTION_NAMES
        )

    def _serve(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[rpb.ServerReflectionResponse]:
        peer = self.slots.take_or_abort(context, self.shed, METHOD)
        try:
            while True:
                wait = Watched()  # one wait for the stream's next request: released once it came
                self._idle.watch(wait, lambda: self._cut(context, peer))
                try:
                    request = next(requests)
                except (StopIteration, grpc.RpcError):  # the client closed, or cancelled (or was cut here)
                    return
                finally:
                    wait.release()
                yield self.servicer.answer(
                    parsed_or_refused(rpb.ServerReflectionRequest, request, context, METHOD, self.shed)
                )
        finally:
            self.slots.give_back(peer)

    def _cut(self, context: grpc.ServicerContext, peer: str) -> None:
        self.shed(
            METHOD, ShedReason.IDLE_STREAM, f"a reflection stream of {peer} sent no request for {self._idle.seconds} s"
        )
        context.cancel()

    def close(self) -> None:
        self._idle.stop()
