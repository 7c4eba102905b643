"""Between protobuf messages and the kernel layer's types; shared by the server and the client.

Integer arrays travel as ``bytes`` of little-endian int32 (measured ~50x cheaper than packed ``repeated
int32``): decoding is a zero-copy ``np.frombuffer``.
"""

from __future__ import annotations

import numpy as np

from kernels.inputs import ChunkInputs, ChunkMetadata, DcpConfig, InvalidInputError
from kernels.planner import BatchInputs, ChunkSpec, PrefillPlan
from protos.indexer.v1 import indexer_pb2 as pb

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


# --- results ----------------------------------------------------------------------------------------------


def write_metadata(meta: ChunkMetadata, omit_token_to_seq: bool, into: pb.ChunkMetadata) -> None:
    """Fill ``into`` (a response's own submessage) in place: building a separate message and assigning it
    would copy every array once more, megabytes for a large batch."""
    a, b = meta.query_slice
    into.cu_seq_lens = encode_int32(meta.cu_seq_lens)
    if not omit_token_to_seq:
        into.token_to_seq = encode_int32(meta.token_to_seq)
    into.cu_seqlen_ks = encode_int32(meta.cu_seqlen_ks)
    into.cu_seqlen_ke = encode_int32(meta.cu_seqlen_ke)
    into.total_seq_lens = meta.total_seq_lens
    into.token_start = meta.token_start
    into.token_end = meta.token_end
    into.num_reqs = meta.num_reqs
    into.skip_kv_gather = meta.skip_kv_gather
    into.local_cu_seq_lens = encode_int32(meta.local_cu_seq_lens)
    into.local_total_seq_lens = meta.local_total_seq_lens
    into.max_local_total_seq_lens = meta.max_local_total_seq_lens
    into.req_start = meta.req_start
    into.req_end = meta.req_end
    into.query_slice.start, into.query_slice.stop = a, b
    into.token_to_seq_omitted = omit_token_to_seq


def metadata_from_proto(message: pb.ChunkMetadata) -> ChunkMetadata:
    """The kernel layer's type; ``token_to_seq`` is None when the server omitted it."""
    return ChunkMetadata(
        cu_seq_lens=decode_int32(message.cu_seq_lens, "cu_seq_lens"),
        token_to_seq=None if message.token_to_seq_omitted else decode_int32(message.token_to_seq, "token_to_seq"),
        cu_seqlen_ks=decode_int32(message.cu_seqlen_ks, "cu_seqlen_ks"),
        cu_seqlen_ke=decode_int32(message.cu_seqlen_ke, "cu_seqlen_ke"),
        total_seq_lens=message.total_seq_lens,
        token_start=message.token_start,
        token_end=message.token_end,
        num_reqs=message.num_reqs,
        skip_kv_gather=message.skip_kv_gather,
        local_cu_seq_lens=decode_int32(message.local_cu_seq_lens, "local_cu_seq_lens"),
        local_total_seq_lens=message.local_total_seq_lens,
        max_local_total_seq_lens=message.max_local_total_seq_lens,
        req_start=message.req_start,
        req_end=message.req_end,
        query_slice=(message.query_slice.start, message.query_slice.stop),
    )


def plan_to_proto(plan: PrefillPlan, omit_token_to_seq: bool) -> pb.PlanBatchResponse:
    response = pb.PlanBatchResponse(
        chunks=[
            pb.ChunkSpec(req_start=c.req_start, req_end=c.req_end, query_start=c.query_start, query_stop=c.query_stop)
            for c in plan.chunks
        ],
        max_prefill_seq_len=plan.max_prefill_seq_len,
    )
    for meta in plan.metadata:
        write_metadata(meta, omit_token_to_seq, response.metadata.add())
    return response


def plan_from_proto(message: pb.PlanBatchResponse) -> PrefillPlan:
    return PrefillPlan(
        chunks=[ChunkSpec(c.req_start, c.req_end, c.query_start, c.query_stop) for c in message.chunks],
        metadata=[metadata_from_proto(m) for m in message.metadata],
        max_prefill_seq_len=message.max_prefill_seq_len,
    )
