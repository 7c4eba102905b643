"""Between protobuf messages and the kernel layer's types; shared by the server and the client.

Integer arrays travel as ``bytes`` of little-endian int32 (far cheaper to encode than packed ``repeated int32``:
docs/performance.md): decoding is a zero-copy ``np.frombuffer``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from indexer_service.kernels.inputs import (
    METADATA_ARRAY_FIELDS,
    METADATA_SCALAR_FIELDS,
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    InvalidInputError,
)
from indexer_service.kernels.planner import BatchInputs, ChunkSpec, PrefillPlan
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb

WIRE_INT32 = np.dtype("<i4")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PrefillMetadata"].full_name  # indexer.v1.PrefillMetadata


def decode_int32(data: bytes, field: str) -> np.ndarray:
    """A read-only int32 view of ``data``; a byte length that is not a multiple of 4 names ``field``."""
    if len(data) % WIRE_INT32.itemsize:
        raise InvalidInputError(field, f"byte length {len(data)} is not a multiple of 4 (little-endian int32)")
    return np.frombuffer(data, dtype=WIRE_INT32)


def encode_int32(values: object, field: str = "array") -> bytes:
    """Little-endian int32 bytes of ``values``; values outside int32 are an error, never wrapped."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{field}: must be 1-D, got shape {array.shape}")
    if array.dtype != WIRE_INT32:
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{field}: must hold integers, got dtype {array.dtype}")
        info = np.iinfo(np.int32)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise ValueError(f"{field}: values must fit int32")
        array = array.astype(WIRE_INT32)
    return array.tobytes()


def _dcp(request: pb.BuildChunkRequest | pb.PlanBatchRequest) -> DcpConfig:
    return DcpConfig(
        rank=request.dcp_rank,
        world_size=request.dcp_world_size if request.HasField("dcp_world_size") else 1,
        interleave=request.dcp_interleave if request.HasField("dcp_interleave") else 1,
    )


def _set_dcp(request: pb.BuildChunkRequest | pb.PlanBatchRequest, dcp: DcpConfig) -> None:
    if dcp != DcpConfig():
        request.dcp_rank, request.dcp_world_size, request.dcp_interleave = dcp.rank, dcp.world_size, dcp.interleave


# --- requests ---------------------------------------------------------------------------------------------


def chunk_inputs_from_proto(request: pb.BuildChunkRequest) -> ChunkInputs:
    query_slice = None
    if request.HasField("query_slice"):
        query_slice = (request.query_slice.start, request.query_slice.stop)
    return ChunkInputs(
        query_start_loc=decode_int32(request.query_start_loc, "query_start_loc"),
        seq_lens=decode_int32(request.seq_lens, "seq_lens"),
        compress_ratio=request.compress_ratio,
        req_start=request.req_start,
        req_end=request.req_end,
        query_slice=query_slice,
        skip_kv_gather=request.skip_kv_gather,
        dcp=_dcp(request),
    )


def chunk_inputs_to_proto(inputs: ChunkInputs, omit_token_to_seq: bool = False) -> pb.BuildChunkRequest:
    request = pb.BuildChunkRequest(
        query_start_loc=encode_int32(inputs.query_start_loc, "query_start_loc"),
        seq_lens=encode_int32(inputs.seq_lens, "seq_lens"),
        compress_ratio=inputs.compress_ratio,
        req_start=inputs.req_start,
        req_end=inputs.req_end,
        skip_kv_gather=inputs.skip_kv_gather,
        omit_token_to_seq=omit_token_to_seq,
    )
    if inputs.query_slice is not None:
        request.query_slice.start, request.query_slice.stop = inputs.query_slice
    _set_dcp(request, inputs.dcp)
    return request


def batch_inputs_from_proto(
    request: pb.PlanBatchRequest, default_max_model_len: int, default_max_logits_bytes: int
) -> BatchInputs:
    return BatchInputs(
        query_start_loc=decode_int32(request.query_start_loc, "query_start_loc"),
        seq_lens=decode_int32(request.seq_lens, "seq_lens"),
        compress_ratio=request.compress_ratio,
        num_decodes=request.num_decodes,
        max_model_len=request.max_model_len if request.HasField("max_model_len") else default_max_model_len,
        max_logits_bytes=(
            request.max_logits_bytes if request.HasField("max_logits_bytes") else default_max_logits_bytes
        ),
        dcp=_dcp(request),
    )


def batch_inputs_to_proto(batch: BatchInputs, omit_token_to_seq: bool = False) -> pb.PlanBatchRequest:
    request = pb.PlanBatchRequest(
        query_start_loc=encode_int32(batch.query_start_loc, "query_start_loc"),
        seq_lens=encode_int32(batch.seq_lens, "seq_lens"),
        compress_ratio=batch.compress_ratio,
        num_decodes=batch.num_decodes,
        max_model_len=batch.max_model_len,
        max_logits_bytes=batch.max_logits_bytes,
        omit_token_to_seq=omit_token_to_seq,
    )
    _set_dcp(request, batch.dcp)
    return request


# --- results ---------------------------------------------------------------------------------------------
# Responses leave the data plane as protobuf wire bytes written straight from the result arrays: one
# ``b"".join`` copies each array once into the answer, where filling a message and serializing it copied it
# three times (tobytes, into the message, out of it), megabytes for a large batch. Field numbers and types
# come from the message descriptors; tests check the bytes against protobuf's own encoding.

Part = bytes | memoryview


_ONE_BYTE_VARINTS = [bytes([v]) for v in range(0x80)]


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE_VARINTS[value]
    value &= (1 << 64) - 1  # a negative integer is ten bytes of two's complement, as protobuf writes it
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _wire_view(values: np.ndarray, field: str) -> memoryview:
    """The array's little-endian int32 bytes, without a copy when it already is one."""
    if values.dtype != WIRE_INT32 or not values.flags.c_contiguous:
        values = np.frombuffer(encode_int32(values, field), dtype=WIRE_INT32)
    return memoryview(values).cast("B")


_MESSAGE, _BYTES, _SCALAR = range(3)
_VARINT_TYPES = frozenset(
    getattr(FieldDescriptor, f"TYPE_{name}") for name in ("INT32", "INT64", "UINT32", "UINT64", "BOOL", "ENUM")
)


class _WireMessage:
    """Encodes one message type's fields, given by name, in field-number order; proto3 fields without
    presence are left out at their default, as protobuf does."""

    def __init__(self, descriptor: Descriptor) -> None:
        self.fields = []  # name, tag bytes, kind, repeated, written at its default
        for f in sorted(descriptor.fields, key=lambda f: f.number):
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                kind, wire_type = _MESSAGE, 2
            elif f.type == FieldDescriptor.TYPE_BYTES:
                kind, wire_type = _BYTES, 2
            elif f.type in _VARINT_TYPES:
                kind, wire_type = _SCALAR, 0
            else:  # a proto change this encoder does not speak must fail at import, not garble answers
                raise TypeError(f"{descriptor.full_name}.{f.name}: field type {f.type} is not encoded here")
            self.fields.append((f.name, _varint(f.number << 3 | wire_type), kind, f.is_repeated, f.has_presence))

    def parts(self, values: Mapping[str, object]) -> list[Part]:
        parts: list[Part] = []
        for name, tag, kind, repeated, has_presence in self.fields:
            value = values.get(name)
            if value is None:
                continue
            if kind == _MESSAGE:
                # A submessage, or a repeated one's items, each already as parts.
                for item in value if repeated else [value]:
                    parts += [tag + _varint(sum(map(len, item))), *item]
            elif kind == _BYTES:
                if len(value) or has_presence:
                    parts += [tag + _varint(len(value)), value]
            elif value or has_presence:
                parts.append(tag + _varint(int(value)))
        return parts


_CHUNK_METADATA = _WireMessage(pb.ChunkMetadata.DESCRIPTOR)
_QUERY_SLICE = _WireMessage(pb.QuerySlice.DESCRIPTOR)
_CHUNK_SPEC = _WireMessage(pb.ChunkSpec.DESCRIPTOR)
_BUILD_CHUNK_RESPONSE = _WireMessage(pb.BuildChunkResponse.DESCRIPTOR)
_PLAN_BATCH_RESPONSE = _WireMessage(pb.PlanBatchResponse.DESCRIPTOR)


def _metadata_parts(meta: ChunkMetadata, omit_token_to_seq: bool) -> list[Part]:
    values: dict[str, object] = {name: getattr(meta, name) for name in METADATA_SCALAR_FIELDS}
    for name in METADATA_ARRAY_FIELDS:
        values[name] = None if omit_token_to_seq and name == "token_to_seq" else _wire_view(getattr(meta, name), name)
    a, b = meta.query_slice
    values["query_slice"] = _QUERY_SLICE.parts({"start": a, "stop": b})
    values["token_to_seq_omitted"] = omit_token_to_seq
    return _CHUNK_METADATA.parts(values)


def build_chunk_response_bytes(meta: ChunkMetadata | None, omit_token_to_seq: bool) -> bytes:
    """A serialized BuildChunkResponse: ``metadata`` absent when the chunk holds no compressed token."""
    metadata = None if meta is None else _metadata_parts(meta, omit_token_to_seq)
    return b"".join(_BUILD_CHUNK_RESPONSE.parts({"metadata": metadata}))


def plan_response_bytes(plan: PrefillPlan, omit_token_to_seq: bool) -> bytes:
    """A serialized PlanBatchResponse."""
    fields = ("req_start", "req_end", "query_start", "query_stop")
    chunks = [_CHUNK_SPEC.parts({name: getattr(c, name) for name in fields}) for c in plan.chunks]
    metadata = [_metadata_parts(meta, omit_token_to_seq) for meta in plan.metadata]
    values = {"chunks": chunks, "metadata": metadata, "max_prefill_seq_len": plan.max_prefill_seq_len}
    return b"".join(_PLAN_BATCH_RESPONSE.parts(values))


def metadata_from_proto(message: pb.ChunkMetadata) -> ChunkMetadata:
    """The kernel layer's type; ``token_to_seq`` is None when the server omitted it."""
    arrays = {name: decode_int32(getattr(message, name), name) for name in METADATA_ARRAY_FIELDS}
    if message.token_to_seq_omitted:
        arrays["token_to_seq"] = None
    return ChunkMetadata(
        **arrays,
        **{name: getattr(message, name) for name in METADATA_SCALAR_FIELDS},
        query_slice=(message.query_slice.start, message.query_slice.stop),
    )


def plan_from_proto(message: pb.PlanBatchResponse) -> PrefillPlan:
    return PrefillPlan(
        chunks=[ChunkSpec(c.req_start, c.req_end, c.query_start, c.query_stop) for c in message.chunks],
        metadata=[metadata_from_proto(m) for m in message.metadata],
        max_prefill_seq_len=message.max_prefill_seq_len,
    )
