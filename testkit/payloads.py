"""The requests the attacks send, built with the service's own protobuf classes, and gRPC's message framing."""

from __future__ import annotations

import struct

import numpy as np

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb

SERVICE_PATH = "/indexer.v1.PrefillMetadata"
BUILD_CHUNK_PATH = f"{SERVICE_PATH}/BuildChunk"
PLAN_BATCH_PATH = f"{SERVICE_PATH}/PlanBatch"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20  # the server's default max_message_bytes
DEFAULT_MAX_MODEL_LEN = 2**20  # the server's default max_model_len: the longest sequence it accepts
# What the server's size check (service/overload/limits.py RequestLimits.check_sizes) adds to the arrays of a one-chunk
# answer, plus slack for the real encoding's tags and lengths: the answer stays under max_message_bytes.
_ANSWER_SLACK_BYTES = 4096


def int32_bytes(values: object) -> bytes:
    """Little-endian int32, the wire form of every array field (service/codec.py)."""
    return np.asarray(values, dtype="<i4").tobytes()


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: 1 byte "not compressed", 4 bytes big-endian length, the message."""
    return struct.pack(">BI", 0, len(message)) + message


# A small, valid BuildChunk (three sequences, nine query tokens): the well-behaved victim's call.
SMALL_BUILD_CHUNK = pb.BuildChunkRequest(
    query_start_loc=int32_bytes([0, 1, 4, 9]),
    seq_lens=int32_bytes([20, 10, 5]),
    compress_ratio=4,
    req_start=1,
    req_end=3,
)


def big_answer_build_chunk(
    answer_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_model_len: int = DEFAULT_MAX_MODEL_LEN
) -> pb.BuildChunkRequest:
    """A ~140-byte BuildChunk whose answer is just under ``answer_bytes``: compress ratio 1, one query token per
    sequence, so the answer is almost all ``token_to_seq`` (4 bytes per KV token of the chunk). Sequences are
    at most ``max_model_len`` long; the chunk's KV workspace (max_model_len * 40) holds 40 of them."""
    tokens = (answer_bytes - _ANSWER_SLACK_BYTES) // 4
    sequences = -(-tokens // max_model_len)
    seq_lens = [max_model_len] * (sequences - 1) + [tokens - max_model_len * (sequences - 1)]
    return pb.BuildChunkRequest(
        query_start_loc=int32_bytes(np.arange(sequences + 1)),
        seq_lens=int32_bytes(seq_lens),
        compress_ratio=1,
        req_start=0,
        req_end=sequences,
    )


def one_row_chunks_plan_batch(chunks: int) -> pb.PlanBatchRequest:
    """A PlanBatch of one 2^20-token sequence with ``chunks`` query tokens and a logits budget of one fp32
    value: the planner cuts it into ``chunks`` one-row chunks, each of which is built. About 2 bytes of request
    per chunk of server work."""
    return pb.PlanBatchRequest(
        query_start_loc=int32_bytes([0, chunks]),
        seq_lens=int32_bytes([2**20]),
        compress_ratio=4,
        max_logits_bytes=4,
        omit_token_to_seq=True,
    )


# Issue 10's CPU amplifier: 22 bytes on the wire, about a second of server CPU (8,192 one-row chunks, the most
# query tokens a request may have); omit_token_to_seq keeps the answer small, so the cost is all CPU.
AMPLIFIER_PLAN_BATCH = one_row_chunks_plan_batch(8192)


# Greetings of connections that then say nothing (testkit.http1raw.IdleConnections): a gRPC client's first bytes
# (the HTTP/2 preface, an empty SETTINGS frame, and the acknowledgement of the server's SETTINGS, sent ahead: a
# connection that never acknowledges them is closed by gRPC after its 60 s settings timeout, a live idle client's
# is not), and 11 bytes of a TLS ClientHello (record header and the start of the handshake message), never
# finished.
H2_PREFACE = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    + b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
)
CLIENT_HELLO_START = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"
